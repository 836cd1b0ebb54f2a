"""Sampling flags shared by `pagoda generate` and `pagoda chat`."""

from __future__ import annotations

import argparse
from typing import Any

from pagoda.sampling_params import SamplingParams
from pagoda.structured.cli_args import add_structured_output_args, structured_outputs_from_args


def add_sampling_args(parser: argparse.ArgumentParser, *, default_max_tokens: int) -> None:
    group = parser.add_argument_group("sampling (unset values fall back to the model's generation_config.json)")
    group.add_argument("--max-tokens", type=int, default=default_max_tokens)
    group.add_argument("--temperature", type=float, default=None, help="0 = greedy")
    group.add_argument("--top-p", type=float, default=None)
    group.add_argument("--top-k", type=int, default=None)
    group.add_argument("--min-p", type=float, default=None)
    group.add_argument("--repetition-penalty", type=float, default=None)
    group.add_argument("--seed", type=int, default=None)
    group.add_argument("--stop", action="append", default=None, help="stop string (repeatable)")
    group.add_argument("--ignore-eos", action="store_true")
    add_structured_output_args(parser)


def sampling_params_from_args(args: argparse.Namespace, defaults: dict[str, Any], **extra: Any) -> SamplingParams:
    values: dict[str, Any] = dict(defaults)
    for name in ("temperature", "top_p", "top_k", "min_p", "repetition_penalty", "seed", "stop"):
        value = getattr(args, name)
        if value is not None:
            values[name] = value
    values.update(
        max_tokens=args.max_tokens,
        ignore_eos=args.ignore_eos,
        structured_outputs=structured_outputs_from_args(args),
        **extra,
    )
    return SamplingParams(**values)
