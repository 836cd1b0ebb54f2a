"""`pagoda eval perplexity`: flags, turned into PerplexityOptions + EngineConfig; pagoda/eval/
does the work (perplexity of the engine as configured, and its delta against full precision)."""

from __future__ import annotations

import argparse
import sys

from pagoda.cli.options import options_from_args
from pagoda.config import EngineConfig
from pagoda.eval.options import PerplexityOptions


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "eval",
        help="evaluate model quality with the engine (perplexity)",
        description="Evaluate model quality with the engine itself.",
    )
    evals = parser.add_subparsers(dest="eval_command", metavar="EVAL", required=True)
    perplexity = evals.add_parser(
        "perplexity",
        help="perplexity on local text, with the delta against full precision",
        description="Perplexity over sliding windows of prompt logprobs, for the engine as configured "
        "(--quantization, --kv-cache-dtype, ...) and for the same model at full precision.",
    )
    defaults = PerplexityOptions(text="")
    perplexity.add_argument("--text", required=True, help="a text file, or a directory of text files (recursive)")
    perplexity.add_argument(
        "--window", type=int, default=defaults.window, help="tokens per window (capped by the model length)"
    )
    perplexity.add_argument(
        "--stride",
        type=int,
        default=defaults.stride,
        help="tokens a window advances; each token gets at least window - stride of context",
    )
    perplexity.add_argument(
        "--max-tokens", type=int, default=defaults.max_tokens, help="score at most this many tokens (0: all)"
    )
    perplexity.add_argument("--no-baseline", dest="baseline", action="store_false", help="skip the full-precision run")
    perplexity.add_argument("--json", action="store_true", help="print one JSON object")
    EngineConfig.add_cli_args(perplexity)
    perplexity.set_defaults(func=run_perplexity)


def run_perplexity(args: argparse.Namespace) -> int:
    from pagoda.eval.perplexity import evaluate_perplexity, render_report, report_json

    options = options_from_args(PerplexityOptions, args)
    try:
        runs = evaluate_perplexity(options, EngineConfig.from_cli_args(args))
    except ValueError as error:
        print(f"pagoda eval perplexity: {error}", file=sys.stderr)
        return 2
    print(report_json(runs, options) if options.json else render_report(runs))
    return 0
