"""Structured-output flags for `pagoda generate` and `pagoda chat` (llama.cpp-style)."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

from pagoda.sampling_params import StructuredOutputsParams


def add_structured_output_args(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group("structured output (at most one)")
    group.add_argument(
        "--json-schema",
        metavar="JSON|FILE",
        default=None,
        help="constrain the output to this JSON schema (inline JSON or a file)",
    )
    group.add_argument("--json-object", action="store_true", help="constrain the output to any JSON object")
    group.add_argument("--regex", default=None, help="constrain the output to match this regular expression")
    group.add_argument("--choice", action="append", default=None, help="one allowed output (repeatable)")
    group.add_argument(
        "--grammar",
        metavar="GBNF|FILE",
        default=None,
        help="constrain the output to this EBNF/GBNF or Lark grammar (inline or a file)",
    )


def structured_outputs_from_args(args: argparse.Namespace) -> StructuredOutputsParams | None:
    """The constraint the flags ask for, or None. Raises ValueError naming the flag."""
    given: dict[str, Any] = {
        name: value
        for name, value in (
            ("json", getattr(args, "json_schema", None)),
            ("json_object", getattr(args, "json_object", False) or None),
            ("regex", getattr(args, "regex", None)),
            ("choice", getattr(args, "choice", None)),
            ("grammar", getattr(args, "grammar", None)),
        )
        if value is not None
    }
    if not given:
        return None
    if len(given) > 1:
        raise ValueError("--json-schema, --json-object, --regex, --choice and --grammar are exclusive")
    if "json" in given:
        text = _inline_or_file(given["json"])
        try:
            given["json"] = json.loads(text)
        except json.JSONDecodeError as exc:
            raise ValueError(f"--json-schema is not valid JSON: {exc}") from None
    if "grammar" in given:
        given["grammar"] = _inline_or_file(given["grammar"])
    params = StructuredOutputsParams(**given)
    from pagoda.structured.grammar import build_grammar  # llguidance: only when a flag is used

    build_grammar(
        params, field="--" + {"json": "json-schema", "json_object": "json-object"}.get(params.kind, params.kind)
    )
    return params


def _inline_or_file(value: str) -> str:
    path = Path(value)
    if len(value) < 4096 and "\n" not in value and path.is_file():
        return path.read_text()
    return value
