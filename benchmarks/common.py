"""Shared by the benchmark scripts: the benchmark model, a `pagoda serve` subprocess, bookkeeping.

The model is a ~10M-parameter random Llama in float32 with a 4k BPE tokenizer trained on ASCII
lines of the Python standard library. The tokenizer has no raw non-ASCII byte tokens, so every
token a random model emits decodes to complete text and streams as its own chunk: inter-token
latency measured over HTTP is then the time between tokens, not between flushed characters.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import platform
import subprocess
import sys
import sysconfig
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[1]
RESULTS = REPO / "benchmarks" / "results"
PYTHON = sys.executable

MODEL_SHAPE = dict(
    hidden_size=256,
    intermediate_size=768,
    num_hidden_layers=10,
    num_attention_heads=8,
    num_key_value_heads=4,
    max_position_embeddings=2048,
)
VOCAB_SIZE = 4096
# A ~100M model of the same family, where matmuls weigh more than per-step host work.
MODEL_SHAPE_100M = dict(
    hidden_size=768,
    intermediate_size=2048,
    num_hidden_layers=12,
    num_attention_heads=12,
    num_key_value_heads=4,
    max_position_embeddings=2048,
)


def build_tokenizer(directory: Path) -> None:
    from transformers import PreTrainedTokenizerFast

    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    stdlib = Path(sysconfig.get_paths()["stdlib"])
    files = sorted(stdlib.glob("*.py"))[:60]

    def ascii_lines() -> Iterator[str]:
        for path in files:
            for line in path.read_text(errors="ignore").splitlines():
                if line.isascii():
                    yield line + "\n"

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=["<|endoftext|>"], show_progress=False)
    tokenizer.train_from_iterator(ascii_lines(), trainer=trainer)
    fast = PreTrainedTokenizerFast(tokenizer_object=tokenizer, eos_token="<|endoftext|>", pad_token="<|endoftext|>")
    fast.chat_template = (
        "{% for m in messages %}{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    fast.save_pretrained(directory)


def build_bench_model(directory: Path, seed: int = 0, shape: dict[str, int] | None = None) -> Path:
    """Tokenizer + random Llama (float32) in the Hugging Face layout; reused if already built."""
    import torch
    import transformers

    directory = Path(directory)
    if (directory / "model.safetensors").exists():
        return directory
    directory.mkdir(parents=True, exist_ok=True)
    build_tokenizer(directory)
    vocab = len(transformers.AutoTokenizer.from_pretrained(directory))
    config = transformers.LlamaConfig(
        vocab_size=vocab,
        eos_token_id=0,
        pad_token_id=0,
        bos_token_id=None,
        tie_word_embeddings=False,
        rope_theta=10000.0,
        **(shape or MODEL_SHAPE),
    )
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config)
    with torch.no_grad():  # larger weights: peaked distributions, like a trained model's
        for param in model.parameters():
            if param.dim() == 2:
                param.normal_(0.0, 0.08)
    model.save_pretrained(directory, safe_serialization=True)
    return directory


def num_params(model_dir: Path) -> int:
    from pagoda.plan import load_model

    return load_model(str(model_dir))[1].total


@contextlib.contextmanager
def pagoda_server(model_dir: Path, engine_flags: list[str], log_path: Path) -> Iterator[str]:
    """`pagoda serve` as a subprocess on a free loopback port; yields its base URL."""
    with pagoda_server_process(model_dir, engine_flags, log_path) as (url, _):
        yield url


@contextlib.contextmanager
def pagoda_server_process(
    model_dir: Path, engine_flags: list[str], log_path: Path, env: dict[str, str] | None = None
) -> Iterator[tuple[str, subprocess.Popen]]:
    """`pagoda serve` as a subprocess on a free loopback port; yields its base URL and process.
    `env`: variables set for the server over this process's (default: OMP_WAIT_POLICY=PASSIVE)."""
    from pagoda.http_client.server_process import free_port, running_server

    port = free_port()
    command = [
        PYTHON,
        "-m",
        "pagoda.cli",
        "serve",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--served-model-name",
        "bench",
        "--log-level",
        "warning",
        *engine_flags,
    ]
    url = f"http://127.0.0.1:{port}"
    with running_server(
        command,
        url + "/health",
        timeout=120,
        log_path=log_path,
        cwd=REPO,
        env={**os.environ, **(env if env is not None else {"OMP_WAIT_POLICY": "PASSIVE"})},
        name="pagoda serve",
    ) as proc:
        yield url, proc


def bench(argv: list[str]) -> int:
    """Run `pagoda bench ...` in this process (so the load generator is not the server's process)."""
    from pagoda.cli import bench as bench_cli

    parser = argparse.ArgumentParser(prog="pagoda")
    bench_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", *argv])
    print("$ pagoda bench " + " ".join(argv), flush=True)
    return args.func(args)


def git_commit() -> str | None:
    # A source snapshot (git archive HEAD | tar -x, then `git rev-parse --short HEAD > COMMIT`)
    # runs outside the repository's own history: it names its commit in a file.
    if (REPO / "COMMIT").is_file():
        return (REPO / "COMMIT").read_text().strip()
    try:
        return subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True, check=True
        ).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return None


def metadata(script: str, argv: list[str], model_dir: Path, shape: dict[str, int] | None = None) -> dict[str, Any]:
    from pagoda.bench.report import machine_info

    return {
        "command": " ".join([".venv/bin/python", f"benchmarks/{script}", *argv]),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "git_commit": git_commit(),
        "machine": machine_info(),
        "load_average_at_start": os.getloadavg() if hasattr(os, "getloadavg") else None,
        "model": {
            "shape": shape or MODEL_SHAPE,
            "vocab_size": VOCAB_SIZE,
            "params": num_params(model_dir),
            "dtype": "float32",
            "weights": "random N(0, 0.08)",
        },
        "python": platform.python_version(),
    }


META_KEYS = ("command", "date", "git_commit", "machine", "load_average_at_start", "model", "python")


def replot_compare(out: Path) -> None:
    """Redraw `pagoda bench compare`'s plots from its results.json."""
    from pagoda.bench.compare import plot_comparison
    from pagoda.bench.plots import plot_target_cdfs
    from pagoda.bench.records import records_from_json
    from pagoda.bench.report import summarize

    runs = load_results(out / "results.json")["runs"]
    records = {run["summary"]["target"]: records_from_json(run["requests"]) for run in runs}
    plot_comparison(
        [summarize(run["summary"]["target"], records[run["summary"]["target"]], run["duration"]) for run in runs],
        out / "compare.png",
    )
    plot_target_cdfs(records, out / "compare_cdf.png", "same requests, back to back: latency CDFs")


def load_results(path: Path) -> dict[str, Any]:
    return json.loads(path.read_text())


def write_summary(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=2) + "\n")
