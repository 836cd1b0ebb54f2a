"""`pagoda serve` from the command line, end to end in a subprocess."""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from pagoda.config import DEFAULT_MODEL_DIR, EngineConfig
from pagoda.cli.serve import add_parser
from server_utils import build_tiny_model, start_server

REPO_ROOT = Path(__file__).resolve().parents[2]


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_flags_cover_the_engine_config() -> None:
    args = parse()
    assert (args.host, args.port, args.model) == ("127.0.0.1", 8000, str(DEFAULT_MODEL_DIR))
    config = EngineConfig.from_cli_args(parse("--max-num-seqs", "7", "--no-enable-prefix-caching",
                                              "--kv-cache-memory", "64MiB"))
    assert config.max_num_seqs == 7 and not config.enable_prefix_caching
    assert config.kv_cache_bytes == 64 * 2**20
    args = parse("--max-queued-requests", "none", "--max-request-bytes", "1MiB")
    assert args.max_queued_requests is None and args.max_request_bytes == 2**20
    assert args.func.__name__ == "run_serve"


def test_bundled_default_model_serves() -> None:
    """No --model: the bundled model, its chat template and its sampling defaults."""
    config = EngineConfig.from_cli_args(parse("--num-threads", "1", "--num-kv-blocks", "64"))
    assert config.model == str(DEFAULT_MODEL_DIR)
    live = start_server(DEFAULT_MODEL_DIR, engine={"num_kv_blocks": 64})
    try:
        assert live.llm.generation_defaults.get("temperature") == 0.7
        response = httpx.post(live.base_url + "/chat/completions", timeout=30, json={
            "messages": [{"role": "user", "content": "Read a file and count its lines."}],
            "max_tokens": 16, "seed": 1})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["usage"]["completion_tokens"] > 0 and body["choices"][0]["message"]["content"]
    finally:
        live.stop()


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def test_serve_subprocess(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "model")
    port = free_port()
    command = [sys.executable, "-m", "pagoda.cli", "serve", "--model", str(model), "--port",
               str(port), "--served-model-name", "cli-model", "--api-key", "sekrit",
               "--num-kv-blocks", "64", "--num-threads", "1", "--log-level", "warning",
               "--engine-transport", "process"]  # the default, named for clarity
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    process = subprocess.Popen(command, env=env, stdout=subprocess.PIPE,
                               stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            if process.poll() is not None:
                pytest.fail(f"pagoda serve exited: {process.stdout.read()}")
            try:
                if httpx.get(url + "/health", timeout=1).status_code == 200:
                    break
            except httpx.TransportError:
                pass
            assert time.monotonic() < deadline, "pagoda serve did not come up"
            time.sleep(0.2)
        headers = {"Authorization": "Bearer sekrit"}
        models = httpx.get(url + "/v1/models", headers=headers).json()
        assert [m["id"] for m in models["data"]] == ["cli-model"]
        response = httpx.post(url + "/v1/chat/completions", headers=headers, timeout=30, json={
            "model": "cli-model", "messages": [{"role": "user", "content": "hi"}],
            "max_tokens": 3})
        assert response.status_code == 200, response.text
        assert httpx.get(url + "/v1/models").status_code == 401
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()
    assert process.returncode is not None
