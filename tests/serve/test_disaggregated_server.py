"""Prefill/decode disaggregation through the server: `--replica-roles
prefill=1,decode=1` runs two engine processes behind the router, the KV moving between them
over TCP. Greedy output equals one co-located engine's (completions, streamed chat); /health
and /metrics tell each replica's role; a prefill process killed mid-run loses no request. One
server for the module (engine processes take seconds to start); the kill runs last."""

from __future__ import annotations

import asyncio
import json
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagoda.replicas.replica_set import ReplicaSet
from server_utils import MODEL_NAME, LiveServer, build_tiny_model, start_server

PROMPTS = [f"def function_{i}(values):\n    total = 0\n    for value in values:\n" * (1 + i % 3) for i in range(6)]


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("disagg") / "model")


@pytest.fixture(scope="module")
def expected(model: Path) -> list[str]:
    """The co-located engine's greedy completions."""
    live = start_server(model)
    try:
        return [completion(live, prompt) for prompt in PROMPTS]
    finally:
        live.stop()


@pytest.fixture(scope="module")
def server(model: Path) -> LiveServer:
    live = start_server(
        model,
        transport="process",
        engine={"max_num_batched_tokens": 64},
        deployment={"replica_roles": "prefill=1,decode=1", "max_local_prefill_tokens": 0, "restart": False},
    )
    yield live
    live.stop()


def completion(server: LiveServer, prompt: str, **body: Any) -> str:
    response = httpx.post(
        server.base_url + "/completions",
        timeout=60,
        json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 12, "temperature": 0, "ignore_eos": True, **body},
    )
    assert response.status_code == 200, response.text
    return response.json()["choices"][0]["text"]


def replicas(server: LiveServer) -> ReplicaSet:
    assert isinstance(server.llm, ReplicaSet)
    return server.llm


def wait_idle(server: LiveServer) -> None:
    deadline = time.monotonic() + 10
    while True:
        states = [r.llm.get_stats() for r in replicas(server).replicas if r.is_alive]
        if all(s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks for s in states):
            assert all(r.outstanding_tokens == 0 and r.num_requests == 0 for r in replicas(server).replicas)
            return
        assert time.monotonic() < deadline, states
        time.sleep(0.02)


def test_greedy_output_equals_one_engine_and_the_kv_moves(server: LiveServer, expected: list[str]) -> None:
    async def scenario() -> list[str]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            responses = await asyncio.gather(
                *(
                    client.post(
                        "/completions",
                        json={
                            "model": MODEL_NAME,
                            "prompt": prompt,
                            "max_tokens": 12,
                            "temperature": 0,
                            "ignore_eos": True,
                        },
                    )
                    for prompt in PROMPTS
                )
            )
        return [r.json()["choices"][0]["text"] for r in responses]

    assert asyncio.run(scenario()) == expected
    prefill, decode = (r.llm.get_stats().disaggregation for r in replicas(server).replicas)
    assert prefill.handoffs_exported == len(PROMPTS) and decode.handoffs_imported == len(PROMPTS)
    assert decode.fallback_prefills == 0 and decode.bytes_received > 0
    wait_idle(server)


def test_streamed_chat_arrives_whole(server: LiveServer) -> None:
    body = {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "count to five"}],
        "max_tokens": 10,
        "temperature": 0,
        "stream": True,
        "ignore_eos": True,
        "stream_options": {"include_usage": True},
    }
    with httpx.stream("POST", server.base_url + "/chat/completions", json=body, timeout=60) as response:
        assert response.status_code == 200
        events = [line for line in response.iter_lines() if line.startswith("data: ")]
    assert events[-1] == "data: [DONE]"
    chunks = [json.loads(line.removeprefix("data: ")) for line in events[:-1]]
    assert chunks[-1]["usage"]["completion_tokens"] == 10
    text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
    whole = httpx.post(
        server.base_url + "/chat/completions",
        timeout=60,
        json={k: v for k, v in body.items() if k not in ("stream", "stream_options")},
    )
    assert whole.json()["choices"][0]["message"]["content"] == text
    wait_idle(server)


def test_health_and_metrics_name_the_roles(server: LiveServer) -> None:
    health = httpx.get(server.url + "/health").json()
    assert [(r["role"], r["alive"]) for r in health["replicas"]] == [("prefill", True), ("decode", True)]
    assert all(isinstance(r["pid"], int) and r["pid"] != os.getpid() for r in health["replicas"])
    metrics = httpx.get(server.url + "/metrics").text
    assert 'pagoda:kv_handoffs_exported_total{model_name="tiny-llama",replica="0",role="prefill"}' in metrics
    assert 'pagoda:kv_handoffs_imported_total{model_name="tiny-llama",replica="1",role="decode"}' in metrics
    for phase in ("queue", "prefill", "transfer", "first_decode"):
        assert f'phase="{phase}"' in metrics


def test_a_killed_prefill_replica_loses_no_request(server: LiveServer, expected: list[str]) -> None:
    """Runs last: SIGKILLs the prefill engine process while requests are in flight."""
    prefill = replicas(server).replicas[0]

    async def scenario() -> list[httpx.Response]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            requests = [
                asyncio.ensure_future(
                    client.post(
                        "/completions",
                        json={
                            "model": MODEL_NAME,
                            "prompt": prompt * 4,
                            "max_tokens": 12,
                            "temperature": 0,
                            "ignore_eos": True,
                        },
                    )
                )
                for prompt in PROMPTS
            ]
            while prefill.llm.get_stats().num_waiting + prefill.llm.get_stats().num_running == 0:
                await asyncio.sleep(0.002)
            os.kill(prefill.llm.engine_pid, signal.SIGKILL)
            return [await r for r in requests]

    responses = asyncio.run(scenario())
    assert [r.status_code for r in responses] == [200] * len(PROMPTS)
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200 and health.json()["status"] == "degraded"
    # Served by the decode replica alone now, output unchanged.
    assert completion(server, PROMPTS[0]) == expected[0]
    decode = replicas(server).replicas[1].llm.get_stats().disaggregation
    assert decode.fallback_prefills >= 1
    wait_idle(server)


@pytest.mark.parametrize("architecture", ["qwen2", "qwen3", "mistral"])
def test_other_architectures_through_the_server_match_one_engine(model_dirs, architecture) -> None:
    """Engines on threads here (fast to start); token-id prompts with a shared prefix, so
    the decode replica's prefix cache serves part of the later handoffs."""
    model = model_dirs[architecture]
    shared = [11 + (i * 7) % 250 for i in range(32)]
    prompts = [shared + [5 + i, 9 + i, 13 + i] * (2 + i) for i in range(4)]

    def run(live: LiveServer) -> list[list[tuple[str, float]]]:
        outputs = []
        for prompt in prompts:
            response = httpx.post(
                live.base_url + "/completions",
                timeout=60,
                json={
                    "model": MODEL_NAME,
                    "prompt": prompt,
                    "max_tokens": 8,
                    "temperature": 0,
                    "ignore_eos": True,
                    "logprobs": 1,
                },
            )
            assert response.status_code == 200, response.text
            logprobs = response.json()["choices"][0]["logprobs"]
            # This tokenizer's tokens mostly print alike: their logprobs tell them apart.
            outputs.append(list(zip(logprobs["tokens"], logprobs["token_logprobs"])))
        return outputs

    one = start_server(model)
    try:
        expected = run(one)
    finally:
        one.stop()
    pair = start_server(
        model,
        engine={"enable_prefix_caching": True},
        deployment={"replica_roles": "prefill=1,decode=1", "max_local_prefill_tokens": 0},
    )
    try:
        got = run(pair)
        assert [[token for token, _ in output] for output in got] == [[t for t, _ in o] for o in expected]
        for output, reference in zip(got, expected):
            assert [lp for _, lp in output] == pytest.approx([lp for _, lp in reference], abs=1e-4)
        decode = replicas(pair).replicas[1].llm.get_stats().disaggregation
        assert decode.handoffs_imported == len(prompts) and decode.blocks_cached > 0
        wait_idle(pair)
    finally:
        pair.stop()
