"""`pagoda --help` and `pagoda COMMAND --help` stay fast: no heavy package is imported to parse flags."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from pagoda.cli import COMMANDS

HEAVY = ("torch", "transformers", "fastapi", "uvicorn", "httpx", "matplotlib", "numpy")

# Runs `pagoda ARGV` in a fresh interpreter and reports the heavy modules it imported.
PROBE = f"""
import contextlib, io, json, sys
from pagoda.cli import main
with contextlib.redirect_stdout(io.StringIO()):
    try:
        main(sys.argv[1:])
    except SystemExit:
        pass
print(json.dumps(sorted(m for m in {repr(HEAVY)} if m in sys.modules)))
"""


def heavy_modules_after(*argv: str) -> list[str]:
    result = subprocess.run([sys.executable, "-c", PROBE, *argv], capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    return json.loads(result.stdout.splitlines()[-1])


# A module per command, named as the command (run_batch: `pagoda run-batch`).
COMMAND_NAMES = [name.rsplit(".", 1)[1].replace("_", "-") for name in COMMANDS]


@pytest.mark.parametrize(
    "argv",
    [
        ["--help"],
        *[[name, "--help"] for name in COMMAND_NAMES],
        ["bench", "serve", "--help"],
        ["bench", "offline", "--help"],
        ["bench", "compare", "--help"],
    ],
)
def test_help_imports_nothing_heavy(argv: list[str]) -> None:
    assert heavy_modules_after(*argv) == []


def test_help_is_fast() -> None:
    # The bound is generous for a shared CI machine; a quiet one takes ~0.1 s.
    start = time.perf_counter()
    result = subprocess.run([sys.executable, "-m", "pagoda.cli", "--help"], capture_output=True, text=True, timeout=60)
    elapsed = time.perf_counter() - start
    assert result.returncode == 0 and "serve" in result.stdout and "plan" in result.stdout
    assert elapsed < 3.0


def test_every_command_module_registers_its_command() -> None:
    from pagoda.cli import build_parser

    parser = build_parser()
    subcommands = next(a for a in parser._actions if a.dest == "command")
    assert list(subcommands.choices) == COMMAND_NAMES
