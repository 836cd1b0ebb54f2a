"""The `pagoda generate` and `pagoda chat` commands, run as a user would."""

from __future__ import annotations

import json
import os
import subprocess
import sys


def run_cli(*args: str, stdin: str = "") -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "pagoda.cli", *args],
        input=stdin,
        capture_output=True,
        text=True,
        timeout=120,
        # A user's environment after `make install`: the native kernels built in the cache (this run's).
        env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin", "XDG_CACHE_HOME": os.environ["XDG_CACHE_HOME"]},
    )


def test_generate_prints_json_per_prompt(llama_dir):
    result = run_cli(
        "generate",
        "--model",
        str(llama_dir),
        "--prompt",
        "def f",
        "--prompt",
        "import os",
        "--max-tokens",
        "6",
        "--temperature",
        "0",
        "--ignore-eos",
        "--json",
    )
    assert result.returncode == 0, result.stderr
    lines = [json.loads(line) for line in result.stdout.splitlines()]
    assert [line["prompt"] for line in lines] == ["def f", "import os"]
    assert all(line["completions"][0]["num_tokens"] == 6 for line in lines)


def test_generate_reports_user_errors(llama_dir):
    result = run_cli("generate", "--model", str(llama_dir), "--prompt", "x", "--top-p", "7")
    assert result.returncode == 2 and "top_p" in result.stderr


def test_chat_streams_replies_and_keeps_history(llama_dir):
    result = run_cli(
        "chat",
        "--model",
        str(llama_dir),
        "--max-tokens",
        "5",
        "--temperature",
        "0",
        "--ignore-eos",
        stdin="hello\n/reset\nagain\n/exit\n",
    )
    assert result.returncode == 0, result.stderr
    assert len(result.stdout.splitlines()) == 2  # one streamed reply per message
