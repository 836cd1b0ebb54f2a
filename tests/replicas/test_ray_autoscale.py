"""Autoscaling replicas on a local Ray (one node of two CPUs, room for two replicas): a held
queue adds a replica that Ray places and that joins the router once ready; idleness drains the
newest replica, whose request in flight finishes normally before the replica is stopped and its
placement group removed; afterwards no replica holds KV. Starting Ray and actors takes seconds:
one test, marked `ray`, skipped without Ray. The decision itself is test_scale_decider.py's."""

from __future__ import annotations

import asyncio
import os
import time
from pathlib import Path

import pytest

from pagoda.config import DeploymentConfig, EngineConfig
from pagoda.engine.engine_request import EngineRequest
from pagoda.replicas.start import start_engines
from pagoda.sampling_params import SamplingParams

ray = pytest.importorskip("ray", reason="Ray is optional (pip install 'pagoda[ray]')")

pytestmark = pytest.mark.ray
REPO_ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture
def local_ray(monkeypatch: pytest.MonkeyPatch):
    # Ray's workers import pagoda from this checkout, as the test process does.
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")])))
    if ray.is_initialized():
        ray.shutdown()
    # A Ray of its own ("local"), not one another process on this machine started.
    ray.init(address="local", num_cpus=2, include_dashboard=False, log_to_driver=False)
    yield
    ray.shutdown()


def wait_for(condition, what: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


async def read(stream) -> tuple[list[int], str | None]:
    tokens, reason = [], None
    async for delta in stream:
        for sample in delta.outputs:
            tokens.extend(sample.token_ids)
            reason = sample.finish_reason or reason
    return tokens, reason


def test_ray_replicas_scale_up_under_a_held_queue_and_drain_away_when_idle(local_ray, llama_dir: Path) -> None:
    config = EngineConfig(
        model=str(llama_dir), num_threads=1, num_kv_blocks=64, max_num_seqs=1, distributed_executor_backend="ray"
    )
    deployment = DeploymentConfig(
        min_replicas=1,
        max_replicas=2,
        router="round_robin",
        restart=False,
        scale_up_queue_depth=1,
        scale_up_window=0.2,
        scale_down_window=2.0,
    )
    replicas = start_engines(config, deployment)
    long = SamplingParams(temperature=0.0, max_tokens=250, ignore_eos=True)
    try:
        assert len(replicas.replicas) == 1 and replicas.autoscaler is not None

        async def scenario() -> None:
            # One sequence at a time on the one replica: the rest wait in its engine.
            queued = [await replicas.add_request(EngineRequest(f"q{i}", [7, 8, 9, 10 + i], long)) for i in range(10)]
            await asyncio.to_thread(wait_for, lambda: len(replicas.replicas) == 2, "the added replica")
            added = replicas.replicas[1]
            assert added.llm.is_alive and added.llm._transport.node_id
            # The added replica takes requests (round robin: one of two lands there); it is the
            # newest, so idleness drains it while its request is unread.
            for i in range(2):
                stream = await replicas.add_request(EngineRequest(f"b{i}", [5, 6, 7], long))
                if stream.replica == added.index:
                    break
                queued.append(stream)
            assert stream.replica == added.index
            await asyncio.to_thread(wait_for, lambda: added.draining, "the drain")
            assert added.llm.is_alive and added in replicas.replicas
            tokens, reason = await read(stream)
            assert len(tokens) == 250 and reason == "length"  # not cut by the drain
            placement_group = added.llm._transport.placement_group
            await asyncio.to_thread(
                wait_for, lambda: replicas.health()["autoscale"]["draining"] == 0, "the drained replica to stop"
            )
            assert added not in replicas.replicas
            assert ray.util.placement_group_table(placement_group)["state"] == "REMOVED"
            for tokens, reason in await asyncio.gather(*(read(s) for s in queued)):
                assert len(tokens) == 250 and reason == "length"

        asyncio.run(scenario())
        autoscale = replicas.health()["autoscale"]
        assert (autoscale["replicas"], autoscale["desired"]) == (1, 1)
        assert {(e["direction"], e["reason"], e["count"]) for e in autoscale["scale_events"]} == {
            ("up", "queue_depth", 1),
            ("down", "idle", 1),
        }
        # The idle invariant: nothing running, waiting or holding a KV block.
        for replica in replicas.replicas:
            stats = replica.llm.get_stats()
            assert (stats.num_running, stats.num_waiting) == (0, 0)
            assert stats.num_free_blocks == stats.num_total_blocks
            assert replica.outstanding_tokens == 0 and replica.num_requests == 0
    finally:
        replicas.shutdown()
