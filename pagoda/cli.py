"""`pagoda` command line: serve | generate | chat | bench | plan | eval.

Each subcommand lives in its own module exposing `add_parser(subparsers)`, which registers its
flags and sets `func` to the function that runs it. Modules import heavy packages (torch,
fastapi) inside their run functions so `pagoda --help` stays fast.
"""

from __future__ import annotations

import argparse
import importlib
import sys

SUBCOMMAND_MODULES = (
    "pagoda.serve.cli",      # pagoda serve
    "pagoda.generate_cli",   # pagoda generate
    "pagoda.chat_cli",       # pagoda chat
    "pagoda.bench.cli",      # pagoda bench serve|offline|compare
    "pagoda.plan",           # pagoda plan
    "pagoda.eval.cli",       # pagoda eval perplexity
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="An LLM inference server.")
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in SUBCOMMAND_MODULES:
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    result = args.func(args)
    return int(result or 0)


if __name__ == "__main__":
    sys.exit(main())
