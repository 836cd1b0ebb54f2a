"""Data-parallel replicas through the server: two engine processes behind the
cache-aware router. One server for the module (each engine process takes seconds to start);
the replica-failure test kills a replica, so it runs last."""

from __future__ import annotations

import asyncio
import textwrap
import time
from typing import Any

import httpx
import pytest

from pagoda.replicas.replica_set import ReplicaSet
from pagoda.serve.admission.tenants import TenantRegistry
from server_utils import MODEL_NAME, LiveServer, build_tiny_model, start_server

KEYS_FILE = """\
tenants:
  alice: {api_keys: [key-alice]}
  bob: {api_keys: [key-bob]}
"""
# Several full KV blocks (16 tokens each) of shared prefix.
SYSTEM_PROMPT = (
    "import os\nimport sys\n\nclass Config:\n    def __init__(self, path):\n        self.path = path\n"
) * 3


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    root = tmp_path_factory.mktemp("dp")
    keys = root / "keys.yaml"
    keys.write_text(textwrap.dedent(KEYS_FILE))
    live = start_server(
        build_tiny_model(root / "model"),
        transport="process",
        engine={"max_num_seqs": 2},
        deployment={"data_parallel_size": 2, "restart": False},
        tenants=TenantRegistry.from_file(keys),
    )
    yield live
    live.stop()


def replicas(server: LiveServer) -> ReplicaSet:
    assert isinstance(server.llm, ReplicaSet)
    return server.llm


def routed_counts(server: LiveServer) -> list[int]:
    return [r.num_routed for r in replicas(server).replicas]


def complete(server: LiveServer, key: str, prompt: str, **body: Any) -> httpx.Response:
    return httpx.post(
        server.base_url + "/completions",
        timeout=60,
        headers={"Authorization": f"Bearer {key}"},
        json={"model": MODEL_NAME, "prompt": prompt, "max_tokens": 4, "temperature": 0, **body},
    )


def landed_on(server: LiveServer, send: Any) -> tuple[int, httpx.Response]:
    """Which replica one request was routed to, and its response."""
    before = routed_counts(server)
    response = send()
    after = routed_counts(server)
    moved = [i for i, (a, b) in enumerate(zip(before, after)) if b > a]
    assert len(moved) == 1, (before, after)
    return moved[0], response


def wait_idle_replicas(server: LiveServer) -> None:
    """Every live replica idle with every KV block free (the idle invariant, per replica)."""
    deadline = time.monotonic() + 10
    while True:
        states = [(r.llm.get_stats(), r) for r in replicas(server).replicas if r.is_alive]
        idle = all(
            s.num_running == 0 and s.num_waiting == 0 and s.num_free_blocks == s.num_total_blocks for s, _ in states
        )
        if idle:
            assert all(r.outstanding_tokens == 0 and r.num_requests == 0 for _, r in states), [
                (r.outstanding_tokens, r.num_requests) for _, r in states
            ]
            return
        assert time.monotonic() < deadline, [s for s, _ in states]
        time.sleep(0.02)


def test_both_replicas_serve(server: LiveServer) -> None:
    prompts = [f"def function_{i}(x):\n    return" for i in range(6)]
    for prompt in prompts:
        assert complete(server, "key-alice", prompt).status_code == 200
    wait_idle_replicas(server)
    assert all(count > 0 for count in routed_counts(server))
    generated = [r.llm.get_stats().num_generation_tokens for r in replicas(server).replicas]
    assert all(tokens > 0 for tokens in generated), generated
    health = httpx.get(server.url + "/health").json()
    assert health["status"] == "ok" and [r["alive"] for r in health["replicas"]] == [True, True]
    metrics = httpx.get(server.url + "/metrics").text
    for label in ("0", "1"):
        assert f'pagoda:generation_tokens_total{{model_name="{MODEL_NAME}",replica="{label}"}}' in metrics


def test_one_tenants_prefix_sticks_to_one_replica(server: LiveServer) -> None:
    landed, cached = set(), []
    for i in range(4):
        replica, response = landed_on(
            server, lambda i=i: complete(server, "key-alice", SYSTEM_PROMPT + f"question {i}:")
        )
        assert response.status_code == 200
        landed.add(replica)
        cached.append(response.json()["usage"]["prompt_tokens_details"]["cached_tokens"])
    assert len(landed) == 1
    assert cached[0] == 0 and all(c >= 3 * 16 for c in cached[1:]), cached
    wait_idle_replicas(server)


def test_other_tenants_identical_prompt_not_steered_by_first_tenants_cache(server: LiveServer) -> None:
    prompt = "# shared words, two tenants\n" + SYSTEM_PROMPT

    async def scenario() -> list[int]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:

            def send(key: str, max_tokens: int) -> Any:
                return client.post(
                    "/completions",
                    headers={"Authorization": f"Bearer {key}"},
                    json={
                        "model": MODEL_NAME,
                        "prompt": prompt,
                        "max_tokens": max_tokens,
                        "temperature": 0,
                        "ignore_eos": True,
                    },
                )

            # alice's long request keeps her replica the busier one while the others arrive.
            before = routed_counts(server)
            first = asyncio.ensure_future(send("key-alice", 200))
            while sum(routed_counts(server)) == sum(before):
                await asyncio.sleep(0.01)
            alice = routed_counts(server)
            # alice again: her cached prefix wins over load; bob: no prefix of his, least load.
            again = await send("key-alice", 2)
            after_alice = routed_counts(server)
            bob = await send("key-bob", 2)
            after_bob = routed_counts(server)
            assert again.status_code == bob.status_code == 200
            assert again.json()["usage"]["prompt_tokens_details"]["cached_tokens"] > 0
            assert bob.json()["usage"]["prompt_tokens_details"]["cached_tokens"] == 0
            assert (await first).status_code == 200
            return [diff(before, alice), diff(alice, after_alice), diff(after_alice, after_bob)]

    def diff(a: list[int], b: list[int]) -> int:
        (moved,) = [i for i, (x, y) in enumerate(zip(a, b)) if y > x]
        return moved

    alice_first, alice_again, bob = asyncio.run(scenario())
    assert alice_again == alice_first
    assert bob != alice_first
    wait_idle_replicas(server)


def test_killed_replica_loses_no_request_that_had_not_started(server: LiveServer) -> None:
    """Runs last: it kills replica 1. With max_num_seqs=2 per replica, at most 2 requests had
    started on it; every other request, queued there or not, must complete."""
    victim = replicas(server).replicas[1]
    num_requests = 8

    async def scenario() -> list[int]:
        async with httpx.AsyncClient(base_url=server.base_url, timeout=60) as client:
            requests = [
                asyncio.ensure_future(
                    client.post(
                        "/completions",
                        json={
                            "model": MODEL_NAME,
                            "prompt": f"request {i} says",
                            "max_tokens": 200,
                            "temperature": 0,
                            "ignore_eos": True,
                        },
                        headers={"Authorization": "Bearer key-alice"},
                    )
                )
                for i in range(num_requests)
            ]
            # Killed while it runs its first two and the rest wait in its queue.
            while victim.llm.get_stats().num_waiting < 2:
                await asyncio.sleep(0.005)
            victim.llm._transport.process.kill()
            return [(await r).status_code for r in requests]

    statuses = asyncio.run(scenario())
    assert victim.num_moved_away >= 2  # its queued requests were served elsewhere
    assert statuses.count(200) >= num_requests - 2, statuses
    assert set(statuses) <= {200, 503}
    health = httpx.get(server.url + "/health")
    assert health.status_code == 200
    assert health.json()["status"] == "degraded"
    assert [r["alive"] for r in health.json()["replicas"]] == [True, False]
    # Still serving, on the replica left; nothing held once idle.
    assert complete(server, "key-bob", "after the failure").status_code == 200
    wait_idle_replicas(server)
