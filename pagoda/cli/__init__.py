"""`pagoda` command line: serve | generate | run-batch | chat | bench | plan | gate | audit | doctor | eval | inspect.

One module per command in this package; each exposes `add_parser(subparsers)`, which registers
the command's flags and sets `func` to the function that runs it. Adding a command is one
module plus one line in `COMMANDS`.

Only argument parsing lives here: a command turns its flags into the dataclass its domain
module takes (EngineConfig, DeploymentConfig, ServerSettings, the bench options, PlanOptions, PerplexityOptions,
RunBatchOptions) and calls it. Command
modules import heavy packages (torch, fastapi, transformers) inside their run functions so that
`pagoda --help` and `pagoda COMMAND --help` stay fast (tests/cli/test_cli_startup.py).
"""

from __future__ import annotations

import argparse
import importlib

# The command modules, in the order `pagoda --help` lists them.
COMMANDS = (
    "pagoda.cli.serve",  # pagoda serve
    "pagoda.cli.generate",  # pagoda generate
    "pagoda.cli.run_batch",  # pagoda run-batch
    "pagoda.cli.chat",  # pagoda chat
    "pagoda.cli.bench",  # pagoda bench serve|offline|compare
    "pagoda.cli.plan",  # pagoda plan
    "pagoda.cli.gate",  # pagoda gate | gate record
    "pagoda.cli.audit",  # pagoda audit
    "pagoda.cli.doctor",  # pagoda doctor
    "pagoda.cli.eval",  # pagoda eval perplexity
    "pagoda.cli.inspect",  # pagoda inspect MODEL
)


class VersionAction(argparse.Action):
    """`pagoda --version`: the package version and the native kernels active on this machine
    (imports torch, so only when asked)."""

    def __init__(self, option_strings: list[str], dest: str, **kwargs: object) -> None:
        super().__init__(
            option_strings,
            dest,
            nargs=0,
            help="print pagoda's version and the native CPU kernels it runs here, then exit",
        )

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        from importlib.metadata import PackageNotFoundError, version

        from pagoda.kernels import native_version_line

        try:
            package_version = version("pagoda")
        except PackageNotFoundError:
            package_version = "(not installed)"
        print(f"pagoda {package_version}\n{native_version_line()}")
        parser.exit()


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="pagoda", description="An LLM inference server.")
    parser.add_argument("--version", action=VersionAction)
    subparsers = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    for module_name in COMMANDS:
        importlib.import_module(module_name).add_parser(subparsers)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        result = args.func(args)
    except KeyboardInterrupt:  # Ctrl-C outside a command's own handling: no traceback
        return 130
    return int(result or 0)
