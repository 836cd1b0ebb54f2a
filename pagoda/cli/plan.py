"""`pagoda plan`: flags of the capacity worksheet; pagoda/plan.py does the arithmetic."""

from __future__ import annotations

import argparse
import sys
from typing import TYPE_CHECKING

from pagoda.cli.options import options_from_args
from pagoda.plan import (
    CLASSES_HELP,
    ModelsFit,
    PlanOptions,
    machine_memory_bytes,
    model_need,
    parse_reserve,
    plan_from_options,
    render_plan,
)

if TYPE_CHECKING:
    from pagoda.config import DeploymentConfig, EngineConfig


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "plan",
        help="capacity worksheet: weights, KV cache, concurrency",
        description="How many sequences fit: weight bytes, KV bytes per token/sequence, blocks, "
        "per-class concurrency, and what quantization or a shorter context would change. "
        "Pure arithmetic from config.json (and safetensors headers when present).",
        formatter_class=argparse.RawTextHelpFormatter,
    )
    parser.add_argument(
        "--model", default=None, help="model directory or its config.json, or a bundled model's name (pagoda-coder)"
    )
    parser.add_argument(
        "--models",
        default=None,
        metavar="FILE",
        help="instead of --model: whether the models of a `pagoda serve --models` file fit\n"
        "(each model's replicas, its weights and the KV pool serve allocates, as serve\n"
        "would run them on this machine)",
    )
    parser.add_argument(
        "--memory",
        default=None,
        help="accelerator memory, e.g. 80GiB, 24GB (default: with --model,\n"
        "what `pagoda serve` runs on this machine: its dtype, KV dtype and the KV pool of\n"
        "--kv-cache-memory (a share of the memory free after the weights), as its banner\n"
        "shows; with --models, this machine's memory)",
    )
    parser.add_argument(
        "--kv-cache-memory",
        default=None,
        metavar="SIZE",
        help="without --memory: serve's --kv-cache-memory (default: serve's, auto: a share of the memory\n"
        "free after the weights)",
    )
    parser.add_argument(
        "--kv-cache-memory-share",
        type=float,
        default=None,
        metavar="SHARE",
        help="without --memory, with --kv-cache-memory auto: serve's --kv-cache-memory-share (default: serve's, 0.5)",
    )
    parser.add_argument(
        "--dtype", default=None, help="weight dtype: bf16, fp16, fp32, int8, int4 (default: the config's, else bf16)"
    )
    parser.add_argument(
        "--kv-dtype",
        default=None,
        help="KV cache dtype: bf16, fp16, fp32, fp8, int8; fp8/int8 "
        "as --kv-cache-dtype stores them,\nwith a scale per head vector "
        "(default: --dtype, or bf16 if that is a quantized type)",
    )
    parser.add_argument(
        "--quantization-group-size",
        type=int,
        default=None,
        help="int4 weights: inputs per (scale, zero) pair, 32, 64 or 128 (default: as the server "
        "chooses, the largest that divides each layer's input)",
    )
    parser.add_argument(
        "--context", type=int, default=None, help="tokens per sequence (default: the model's max_position_embeddings)"
    )
    parser.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default: 16)")
    parser.add_argument(
        "--reserve",
        default="10%",
        help="memory kept back for activations, CUDA context and fragmentation:\n"
        "a percentage of --memory or bytes (default: 10%%)",
    )
    parser.add_argument("--classes", nargs="+", default=None, metavar="SPEC", help=CLASSES_HELP)
    parser.add_argument(
        "--pipeline-parallel-size",
        type=int,
        default=1,
        help="pipeline stages, each on a device of --memory: per-stage weights and KV (default: 1)",
    )
    parser.add_argument(
        "--pp-layer-partition",
        default=None,
        metavar="N,N,...",
        help="layers per pipeline stage, e.g. 3,5 (default: an even split)",
    )
    parser.add_argument("--json", action="store_true", help="print the plan as JSON")
    parser.set_defaults(func=run_plan)


def run_plan(args: argparse.Namespace) -> int:
    if (args.model is None) == (args.models is None):
        print("pagoda plan: error: give --model or --models", file=sys.stderr)
        return 2
    if args.models is not None:
        return _run_models_plan(args)
    try:
        from pagoda.config import resolve_model_path

        plan = plan_from_options(options_from_args(PlanOptions, args, model=resolve_model_path(args.model)))
    except ValueError as e:
        print(f"pagoda plan: error: {e}", file=sys.stderr)
        return 2
    print(plan.to_json() if args.json else render_plan(plan))
    return 0


def models_fit(
    path: str, config: EngineConfig, deployment: DeploymentConfig, memory_bytes: int, reserve: str = "10%"
) -> ModelsFit:
    """Whether the models of the models file at `path` fit in `memory_bytes` (less `reserve`),
    with `config` and `deployment` as every model's defaults; ValueError (naming the line) for
    a bad file or model."""
    from pagoda.serve.models_file import load_models_file

    models_file = load_models_file(path)
    needs = []
    for entry in models_file.models:
        engine = entry.engine_config(config, len(models_file.models))
        try:
            replicas = entry.deployment_config(deployment)
            needs.append(model_need(entry.name, entry.line, engine, engines=replicas.num_replicas))
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}:{entry.line}: model {entry.name!r}: {exc}") from None
    return ModelsFit(needs, memory_bytes, parse_reserve(reserve, memory_bytes))


def _run_models_plan(args: argparse.Namespace) -> int:
    from pagoda.config import DeploymentConfig, EngineConfig, parse_bytes

    try:
        memory = parse_bytes(args.memory) if args.memory else machine_memory_bytes("auto")
        fit = models_fit(args.models, EngineConfig(), DeploymentConfig(), memory, args.reserve)
    except (OSError, ValueError) as e:
        print(f"pagoda plan: error: {e}", file=sys.stderr)
        return 2
    print(fit.describe(args.models))
    return 0 if fit.fits else 1
