"""`pagoda bench serve` against a real `pagoda serve` subprocess on a tiny random Llama."""

from __future__ import annotations

import argparse
import json
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from model_factory import build_model
from pagoda.cli import bench as bench_cli
from pagoda.http_client.server_process import ServerStartError, free_port, start_server, stop_server

SMALL = ["--length-scale", "0.03", "--max-model-len", "384", "--no-progress", "--ignore-eos"]
ALL_CLASSES = "chat=0.3,rag=0.3,summarize=0.1,agent=0.3"


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("bench-model"), "llama")


@pytest.fixture(scope="module")
def server(tiny_model: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    command = [
        sys.executable,
        "-m",
        "pagoda.cli",
        "serve",
        "--model",
        str(tiny_model),
        "--port",
        str(port),
        "--served-model-name",
        "tiny",
        "--num-threads",
        "1",
        "--num-kv-blocks",
        "512",
        "--log-level",
        "warning",
    ]
    try:
        process = start_server(
            command,
            url + "/health",
            timeout=90,
            name="pagoda serve",
            log_path=tmp_path_factory.mktemp("server-log") / "serve.log",
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            cwd=Path(__file__).resolve().parents[2],
        )
    except ServerStartError as exc:
        pytest.fail(str(exc))
    try:
        yield url
    finally:
        stop_server(process, grace_s=15)


def bench(argv: list[str]) -> int:
    parser = argparse.ArgumentParser(prog="pagoda")
    bench_cli.add_parser(parser.add_subparsers())
    args = parser.parse_args(["bench", *argv])
    return args.func(args)


def check_run(out: Path, num_requests: int) -> dict:
    result = json.loads((out / "results.json").read_text())
    requests = result["requests"]
    assert len(requests) == num_requests
    assert all(r["status"] == 200 and r["error"] is None for r in requests), result["summary"]["errors"]
    for r in requests:
        assert r["output_tokens"] == r["output_len"]  # ignore_eos: exact lengths
        assert r["reported_prompt_tokens"] is not None and r["ttft"] is not None
    for png in ("latency_cdf.png", "over_time.png"):
        assert (out / png).read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    return result


def test_closed_loop_completions_every_class(
    server: str, tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "closed"
    rc = bench(
        [
            "serve",
            "--base-url",
            server,
            "--model",
            "tiny",
            "--tokenizer",
            str(tiny_model),
            "--mix",
            ALL_CLASSES,
            "--concurrency",
            "4",
            "--num-requests",
            "24",
            "--warmup",
            "1",
            "--out",
            str(out),
            *SMALL,
        ]
    )
    assert rc == 0, capsys.readouterr()
    result = check_run(out, 24)
    # Completions prompts are counted exactly as the server counts them.
    assert all(r["reported_prompt_tokens"] == r["prompt_len"] for r in result["requests"])
    summary = result["summary"]
    assert {c["name"] for c in summary["per_class"]} == {"chat", "rag", "summarize", "agent"}
    server_delta = summary["server"]
    assert server_delta["source"] == "pagoda:" and server_delta["num_preemptions"] == 0
    assert server_delta["prefix_cache_hit_rate"] > 0  # rag documents and agent turns are shared prefixes
    assert server_delta["queue_time_count"] == 24


def test_open_loop_chat_every_class(
    server: str, tiny_model: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    out = tmp_path / "open"
    rc = bench(
        [
            "serve",
            "--base-url",
            server + "/v1",
            "--model",
            "tiny",
            "--tokenizer",
            str(tiny_model),
            "--endpoint",
            "chat",
            "--mix",
            ALL_CLASSES,
            "--request-rate",
            "25",
            "--num-requests",
            "16",
            "--slo",
            "ttft=5,itl=5",
            "--seed",
            "1",
            "--out",
            str(out),
            *SMALL,
        ]
    )
    assert rc == 0, capsys.readouterr()
    result = check_run(out, 16)
    assert result["summary"]["overall"]["num_good"] == 16
    assert {r["class_name"] for r in result["requests"]} >= {"chat", "rag", "agent"}


def test_tokenizer_and_context_default_to_the_served_models(
    server: str, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No --tokenizer, no --max-model-len: both come from the local server's /v1/models."""
    out = tmp_path / "defaults"
    rc = bench(
        [
            "serve",
            "--base-url",
            server,
            "--model",
            "tiny",
            "--mix",
            "summarize",
            "--num-requests",
            "3",
            "--concurrency",
            "3",
            "--no-progress",
            "--out",
            str(out),
        ]
    )
    captured = capsys.readouterr()
    printed = captured.out
    assert rc == 0, captured.err
    assert "the served model's, from /v1/models" in printed
    assert "lengths capped at the served context: 512 tokens" in printed
    requests = json.loads((out / "results.json").read_text())["requests"]
    assert requests and all(r["prompt_len"] + r["output_len"] <= 512 for r in requests)
    assert bench(["serve", "--base-url", "http://127.0.0.1:9", "--model", "m", "--num-requests", "1"]) == 2
