"""`pagoda run-batch -i in.jsonl -o out.jsonl --model DIR`: OpenAI batch lines run offline, in
vLLM's run-batch format (pagoda/batch_offline.py runs them)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from pagoda.config import EngineConfig


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "run-batch",
        help="run a JSONL file of OpenAI requests offline (vLLM's run-batch)",
        description="Run each line of a JSONL file ({custom_id, method, url, body}; url /v1/chat/completions, "
        "/v1/completions or /v1/embeddings) through the engine, no server, and write one "
        "response line per request in OpenAI's batch output shape.",
    )
    parser.add_argument("-i", "--input-file", required=True, help="the requests, one JSON object a line")
    parser.add_argument("-o", "--output-file", required=True, help="where the response lines are written")
    parser.add_argument(
        "--pooling",
        choices=("last", "mean"),
        default="last",
        help="how /v1/embeddings lines pool the final hidden states (default: last)",
    )
    EngineConfig.add_cli_args(parser)
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from pagoda.batch_offline import RunBatchOptions, run_batch
    from pagoda.engine.llm import LLM

    options = RunBatchOptions(args.input_file, args.output_file, args.pooling)
    try:
        config = EngineConfig.from_cli_args(args)
        if not Path(options.input_file).is_file():
            raise ValueError(f"{options.input_file}: no such file")
        llm = LLM(**vars(config))
        summary = run_batch(
            llm,
            options,
            Path(config.model).name,
            progress=lambda line: print(f"pagoda run-batch: {line}", file=sys.stderr),
        )
    except ValueError as error:
        print(f"pagoda run-batch: {error}", file=sys.stderr)
        return 2
    print(
        f"pagoda run-batch: {summary.succeeded} succeeded, {summary.failed} failed in "
        f"{summary.seconds:.2f} s -> {options.output_file}",
        file=sys.stderr,
    )
    return 0 if summary.failed == 0 else 1
