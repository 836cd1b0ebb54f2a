"""vLLM's `vllm serve` launch lines on `pagoda serve`: parsed, validated, mapped onto pagoda's
settings; the flags with no meaning here refused in one line; one line started for real."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import httpx
import pytest

from pagoda.cli import build_parser
from pagoda.cli.serve import serve_configs
from pagoda.cli.vllm_flags import REFUSED
from pagoda.config import default_chat_model, resolve_model_path
from pagoda.http_client import server_process
from server_utils import REPO_ROOT, build_tiny_model, free_port


def configs(*argv: str):
    return serve_configs(build_parser().parse_args(["serve", *argv]))


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("vllm") / "model")


def test_launch_lines_map_onto_pagoda_settings(model: Path) -> None:
    engine, deployment, settings = configs(
        str(model),
        "--host",
        "0.0.0.0",
        "--port",
        "8001",
        "--served-model-name",
        "my-model",
        "--max-model-len",
        "512",
        "--dtype",
        "half",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--api-key",
        "k",
        "--max-num-seqs",
        "8",
        "--disable-log-requests",
        "--num-gpu-blocks-override",
        "40",
        "--uvicorn-log-level",
        "warning",
    )
    assert engine.model == str(model) and engine.max_model_len == 512 and engine.dtype == "float16"
    assert engine.max_num_seqs == 8 and engine.num_kv_blocks == 40
    assert (settings.host, settings.port, settings.served_model_names) == ("0.0.0.0", 8001, ["my-model"])
    assert settings.tool_call_parser == "hermes" and deployment.data_parallel_size == 1
    assert settings.log_level == "warning"
    engine, _, _ = configs(
        "--model",
        str(model),
        "--tensor-parallel-size",
        "2",
        "--dtype",
        "float",
        "--enable-prefix-caching",
        "--max-num-batched-tokens",
        "1024",
    )
    assert engine.tensor_parallel_size == 2 and engine.dtype == "float32" and engine.max_num_batched_tokens == 1024


def test_gpu_memory_utilization_is_the_budget_on_cpu(model: Path) -> None:
    from pagoda import plan

    # As on a GPU: the KV pool is the share of the host's memory the weights leave.
    engine, _, _ = configs(str(model), "--device", "cpu", "--gpu-memory-utilization", "0.9")
    weights = plan.serving_weight_bytes(engine)
    assert int(engine.kv_cache_memory) == int(0.9 * plan.machine_memory_bytes("cpu")) - weights
    # An explicit pool keeps its size: the fraction is a budget it must fit in.
    sized, _, _ = configs(str(model), "--device", "cpu", "--gpu-memory-utilization", "0.9", "--kv-cache-memory", "1GiB")
    assert sized.kv_cache_memory == "1GiB"
    with pytest.raises(SystemExit, match="budget of .* lower --kv-cache-memory"):
        configs(str(model), "--device", "cpu", "--gpu-memory-utilization", "0.001", "--kv-cache-memory", "8GiB")
    with pytest.raises(SystemExit, match=r"must be in \(0, 1\]"):
        configs(str(model), "--gpu-memory-utilization", "1.5")


@pytest.mark.parametrize("flag", sorted(REFUSED))
def test_flags_without_meaning_are_refused_in_one_line(
    flag: str, model: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as refused:
        build_parser().parse_args(["serve", str(model), flag, "x"])
    message = str(refused.value.code)
    assert message.startswith(f"pagoda serve: {flag} ") and "\n" not in message
    assert REFUSED[flag] in message


def test_trust_remote_code_says_no_repository_code_runs() -> None:
    with pytest.raises(SystemExit, match="never runs a model repository's code"):
        build_parser().parse_args(["serve", "Qwen/Qwen2.5-0.5B-Instruct", "--trust-remote-code"])


def test_a_hub_id_says_download_it_first() -> None:
    with pytest.raises(
        SystemExit,
        match=r"pagoda loads local models only: download it first \(e\.g\. "
        r"`huggingface-cli download Qwen/Qwen2.5-0.5B-Instruct --local-dir DIR`\)",
    ):
        configs("--model", "Qwen/Qwen2.5-0.5B-Instruct")
    with pytest.raises(ValueError, match="local models only"):
        resolve_model_path("Qwen/Qwen2.5-0.5B-Instruct")


def test_model_given_twice_is_refused(model: Path) -> None:
    with pytest.raises(SystemExit, match="given twice"):
        configs(str(model), "--model", str(model.parent))


def test_help_names_every_api_and_one_default_per_option() -> None:
    serve = build_parser()._subparsers._group_actions[0].choices["serve"]
    for endpoint in (
        "/v1/chat/completions",
        "/v1/completions",
        "/v1/responses",
        "/v1/embeddings",
        "/v1/messages",
        "/v1/models",
        "/tokenize",
        "/detokenize",
        "/health",
        "/metrics",
    ):
        assert endpoint in serve.description
    for action in serve._actions:
        assert (action.help or "").count("default:") <= 1, action.option_strings
    model = next(action for action in serve._actions if action.dest == "model")
    assert model.default == default_chat_model()


def test_a_vllm_launch_line_serves(model: Path) -> None:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "pagoda.cli",
        "serve",
        str(model),
        "--port",
        str(port),
        "--served-model-name",
        "vllm-style",
        "--enable-auto-tool-choice",
        "--tool-call-parser",
        "hermes",
        "--max-model-len",
        "256",
        "--gpu-memory-utilization",
        "0.9",
        "--disable-log-requests",
        "--num-threads",
        "1",
        "--num-gpu-blocks-override",
        "32",
        "--max-num-seqs",
        "4",
    ]
    process = server_process.start_server(
        command,
        f"http://127.0.0.1:{port}/health",
        timeout=180,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        start_new_session=True,
        name="pagoda serve",
    )
    try:
        url = f"http://127.0.0.1:{port}/v1"
        assert [m["id"] for m in httpx.get(url + "/models").json()["data"]] == ["vllm-style"]
        response = httpx.post(
            url + "/chat/completions",
            timeout=60,
            json={"model": "vllm-style", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 3},
        )
        assert response.status_code == 200, response.text
    finally:
        process.terminate()
        try:
            process.wait(15)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


def test_gpu_memory_utilization_sizes_the_kv_pool_on_a_gpu(model: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """On a GPU the share of its memory less the weights (in the dtype serve runs there) is the KV pool."""
    import torch

    from pagoda import plan

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(plan, "machine_memory_bytes", lambda device: 10 * 2**30 if device == "cuda" else 0)
    engine, _, _ = configs(str(model), "--gpu-memory-utilization", "0.5")
    weights = plan.serving_weight_bytes(engine)
    assert plan.model_need("m", 0, engine, engines=1).dtype == "bf16"
    assert int(engine.kv_cache_memory) == 5 * 2**30 - weights
    with pytest.raises(SystemExit, match="not both"):
        configs(str(model), "--gpu-memory-utilization", "0.5", "--kv-cache-memory", "2GiB")
