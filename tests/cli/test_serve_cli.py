"""`pagoda serve` from the command line, end to end in a subprocess."""

from __future__ import annotations

import argparse
import subprocess
from pathlib import Path

import httpx

from pagoda.cli.serve import add_parser
from pagoda.config import DEFAULT_MODEL_DIR, EngineConfig, default_chat_model, resolve_model_path
from server_utils import build_tiny_model, free_port, start_serve_process, start_server


def parse(*argv: str) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    add_parser(parser.add_subparsers())
    return parser.parse_args(["serve", *argv])


def test_flags_cover_the_engine_config() -> None:
    args = parse()
    assert (args.host, args.port, args.model) == ("127.0.0.1", 8000, default_chat_model())
    config = EngineConfig.from_cli_args(
        parse("--max-num-seqs", "7", "--no-enable-prefix-caching", "--kv-cache-memory", "64MiB")
    )
    assert config.max_num_seqs == 7 and not config.enable_prefix_caching
    assert config.kv_cache_bytes == 64 * 2**20
    args = parse("--max-queued-requests", "none", "--max-request-bytes", "1MiB")
    assert args.max_queued_requests is None and args.max_request_bytes == 2**20
    assert args.func.__name__ == "run_serve"


def test_bundled_model_serves() -> None:
    """The bundled model by name: its chat template and its sampling defaults."""
    config = EngineConfig.from_cli_args(parse("--num-threads", "1", "--num-kv-blocks", "64"))
    assert config.model == resolve_model_path(default_chat_model())
    config = EngineConfig.from_cli_args(parse("--model", "pagoda-coder"))
    assert config.model == str(DEFAULT_MODEL_DIR)
    live = start_server(DEFAULT_MODEL_DIR, engine={"num_kv_blocks": 64})
    try:
        assert live.llm.generation_defaults.get("temperature") == 0.7
        response = httpx.post(
            live.base_url + "/chat/completions",
            timeout=30,
            json={
                "messages": [{"role": "user", "content": "Read a file and count its lines."}],
                "max_tokens": 16,
                "seed": 1,
            },
        )
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["usage"]["completion_tokens"] > 0 and body["choices"][0]["message"]["content"]
    finally:
        live.stop()


def test_serve_subprocess(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "model")
    port = free_port()
    process = start_serve_process(
        model,
        port,
        "--served-model-name",
        "cli-model",
        "--api-key",
        "sekrit",
        "--num-kv-blocks",
        "64",
        "--log-level",
        "warning",
        "--engine-transport",
        "process",
    )  # the default, named for clarity
    url = f"http://127.0.0.1:{port}"
    try:
        headers = {"Authorization": "Bearer sekrit"}
        models = httpx.get(url + "/v1/models", headers=headers).json()
        assert [m["id"] for m in models["data"]] == ["cli-model"]
        response = httpx.post(
            url + "/v1/chat/completions",
            headers=headers,
            timeout=30,
            json={"model": "cli-model", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
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
