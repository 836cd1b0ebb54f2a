"""The Autoscaler over a replica set of real engines on threads (fast to start; the Ray
backend's own test is test_ray_autoscale.py): a held queue adds a replica that joins the
router once ready; idleness drains the newest replica, whose request in flight finishes
normally before it is stopped; every decision is in /health and the metrics; nothing is left
holding KV afterwards."""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from pagoda.config import DeploymentConfig, EngineConfig
from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.engine_request import EngineRequest
from pagoda.engine.llm_engine import LLMEngine
from pagoda.replicas.autoscaler import Autoscaler
from pagoda.replicas.replica_set import ReplicaSet
from pagoda.replicas.scale_decider import ScalingRules
from pagoda.replicas.start import start_engines
from pagoda.sampling_params import SamplingParams
from pagoda.serve.metrics.server import ServerMetrics


class _PacedEngine(LLMEngine):
    """A step takes at least a few milliseconds, so a queue holds while the test looks."""

    def step(self):  # type: ignore[override]
        time.sleep(0.005)
        return super().step()


def start(llama_dir: Path, deployment: DeploymentConfig) -> ReplicaSet:
    config = EngineConfig(model=str(llama_dir), num_threads=1, num_kv_blocks=64, max_num_seqs=1)

    def starter(index: int, config: EngineConfig) -> AsyncLLM:
        return AsyncLLM(config, transport="thread", engine_factory=_PacedEngine)

    return ReplicaSet.start(config, deployment, starter)


def autoscale(replicas: ReplicaSet, deployment: DeploymentConfig) -> None:
    """Put an autoscaler with `deployment`'s rules on the set, in place of the one it had."""
    if replicas.autoscaler is not None:
        replicas.autoscaler.stop()
    replicas.autoscaler = Autoscaler(replicas, ScalingRules.of(deployment), interval=0.02)


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.02)


async def read(stream) -> tuple[list[int], str | None]:
    tokens, reason = [], None
    async for delta in stream:
        for sample in delta.outputs:
            tokens.extend(sample.token_ids)
            reason = sample.finish_reason or reason
    return tokens, reason


def test_a_held_queue_adds_a_replica_and_idleness_drains_it_without_cutting_its_request(
    llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level(logging.INFO, logger="pagoda.replicas.autoscaler")
    deployment = DeploymentConfig(
        min_replicas=1, max_replicas=2, router="round_robin", scale_up_queue_depth=2, scale_up_window=0.05
    )
    replicas = start(llama_dir, deployment)
    autoscale(replicas, deployment)  # scales down only after the default window (minutes)
    metrics = ServerMetrics("tiny", replicas.get_stats, replica_stats=replicas.replica_stats, health=replicas.health)
    try:
        assert replicas.health()["autoscale"]["desired"] == 1
        long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)

        async def hold_a_queue() -> None:
            # One sequence at a time on the one replica: the rest wait in its engine.
            streams = [await replicas.add_request(EngineRequest(f"q{i}", [7, 8, 9, 10 + i], long)) for i in range(5)]
            await asyncio.to_thread(wait_for, lambda: len(replicas.replicas) == 2, "the added replica")
            results = await asyncio.gather(*(read(s) for s in streams))
            assert all(len(tokens) == 40 for tokens, _ in results)

        asyncio.run(hold_a_queue())
        health = replicas.health()
        assert health["autoscale"]["desired"] == 2 and health["autoscale"]["replicas"] == 2
        assert {"direction": "up", "reason": "queue_depth", "count": 1} in health["autoscale"]["scale_events"]
        text = generate_latest(metrics.registry).decode()
        assert 'pagoda:replicas_desired{model_name="tiny"} 2.0' in text
        assert 'pagoda:scale_events_total{direction="up",model_name="tiny",reason="queue_depth"} 1.0' in text
        added = replicas.replicas[1]
        assert added.index == 1 and added.llm.is_alive

        async def drain_under_a_request() -> tuple[list[int], str | None]:
            # Round robin: one of two requests lands on the added replica, the newest, which
            # idleness drains while that request is still unread.
            for i in range(2):
                stream = await replicas.add_request(EngineRequest(f"b{i}", [5, 6, 7], long))
                if stream.replica == added.index:
                    break
                await read(stream)
            assert stream.replica == added.index
            autoscale(replicas, dataclasses.replace(deployment, scale_down_window=0.1))
            await asyncio.to_thread(wait_for, lambda: added.draining, "the drain")
            assert added.llm.is_alive and added in replicas.replicas  # its request is not read yet
            # A new request goes to the replica that stays.
            short = SamplingParams(temperature=0.0, max_tokens=1, ignore_eos=True)
            other = await replicas.add_request(EngineRequest("c", [5], short))
            assert other.replica == 0
            await read(other)
            return await read(stream)

        tokens, reason = asyncio.run(drain_under_a_request())
        assert len(tokens) == 40 and reason == "length"
        wait_for(lambda: replicas.health()["autoscale"]["draining"] == 0, "the drained replica to stop")
        assert added not in replicas.replicas
        assert not added.llm.is_alive
        health = replicas.health()["autoscale"]
        assert (health["replicas"], health["desired"], health["draining"]) == (1, 1, 0)
        assert {"direction": "down", "reason": "idle", "count": 1} in health["scale_events"]
        text = generate_latest(metrics.registry).decode()
        assert 'pagoda:replicas_desired{model_name="tiny"} 1.0' in text
        assert 'pagoda:scale_events_total{direction="down",model_name="tiny",reason="idle"} 1.0' in text
        decisions = [r.message.split(": ", 1)[1] for r in caplog.records if "scaling" in r.message]
        assert [d.split(":")[0] for d in decisions] == [
            "scaling up from 1 to 2 replicas",
            "scaling down from 2 to 1 replicas",
        ]
        # The idle invariant: no replica holds a request or a KV block.
        for replica in replicas.replicas:
            stats = replica.llm.get_stats()
            assert (stats.num_running, stats.num_waiting) == (0, 0)
            assert stats.num_free_blocks == stats.num_total_blocks
            assert replica.outstanding_tokens == 0 and replica.num_requests == 0
    finally:
        replicas.shutdown()


def test_without_ray_the_count_stays_fixed_and_one_line_says_why(
    llama_dir: Path, caplog: pytest.LogCaptureFixture
) -> None:
    config = EngineConfig(model=str(llama_dir), num_threads=1, num_kv_blocks=64)
    with caplog.at_level(logging.WARNING, logger="pagoda.replicas.start"):
        llm = start_engines(config, DeploymentConfig(min_replicas=2, max_replicas=3, restart=False), transport="thread")
    try:
        assert [r.message for r in caplog.records] == [
            "--min-replicas 2 / --max-replicas 3: autoscaling needs --distributed-executor-backend ray; "
            "serving a fixed 2 replicas"
        ]
        assert isinstance(llm, ReplicaSet) and len(llm.replicas) == 2 and llm.autoscaler is None
        assert "autoscale" not in llm.health()
    finally:
        llm.shutdown()


def test_a_replica_that_cannot_start_is_logged_and_the_set_keeps_serving(llama_dir: Path) -> None:
    config = EngineConfig(model=str(llama_dir), num_threads=1, num_kv_blocks=64, max_num_seqs=1)

    def starter(index: int, config: EngineConfig) -> AsyncLLM:
        if index > 0:  # as a cluster without room would, after its timeout
            raise RuntimeError("the engine failed to start")
        return AsyncLLM(config, transport="thread", engine_factory=_PacedEngine)

    deployment = DeploymentConfig(min_replicas=1, max_replicas=2, scale_up_queue_depth=2, scale_up_window=0.05)
    replicas = ReplicaSet.start(config, deployment, starter)
    autoscale(replicas, deployment)
    try:

        async def scenario() -> None:
            long = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
            streams = [await replicas.add_request(EngineRequest(f"q{i}", [7, 8, 9, 10 + i], long)) for i in range(5)]
            await asyncio.to_thread(
                wait_for, lambda: replicas.health()["autoscale"]["failed_starts"] >= 1, "the failed start"
            )
            assert all(len(tokens) == 40 for tokens, _ in await asyncio.gather(*(read(s) for s in streams)))

        asyncio.run(scenario())
        assert len(replicas.replicas) == 1 and replicas.health()["status"] == "ok"
    finally:
        replicas.shutdown()


def test_an_added_replica_has_the_runtime_adapters_before_it_joins(llama_dir: Path, tmp_path: Path) -> None:
    from lora_factory import build_adapter
    from pagoda.lora_request import LoRARequest

    config = EngineConfig(model=str(llama_dir), num_threads=1, num_kv_blocks=64, enable_lora=True)
    replicas = ReplicaSet.start(config, DeploymentConfig(), lambda index, config: AsyncLLM(config, transport="thread"))
    try:
        adapter = LoRARequest("sql", 1, str(build_adapter(llama_dir, tmp_path / "sql", rank=4)))
        asyncio.run(replicas.add_lora(adapter))
        added = replicas.add_replica()
        assert added.index == 1 and added in replicas.replicas
        assert added.llm.lora_names == ["sql"] and added.supervisor.adapters == {"sql": adapter}
        assert replicas.drain_replica() is added and replicas.retire_drained(added)
        assert replicas.replicas == [replicas.replicas[0]] and not added.llm.is_alive
        assert replicas.drain_replica() is None  # the last one stays
    finally:
        replicas.shutdown()


def test_an_added_replica_serves_the_latest_weights(llama_dir: Path, tmp_path: Path) -> None:
    from model_factory import build_model, hf_greedy, load_hf_model

    config = EngineConfig(model=str(llama_dir), num_threads=1, num_kv_blocks=64)
    replicas = ReplicaSet.start(config, DeploymentConfig(), lambda index, config: AsyncLLM(config, transport="thread"))
    try:
        updated = build_model(tmp_path / "updated", "llama", seed=7)
        asyncio.run(replicas.engine_command("update_weights_from_disk", {"model_path": str(updated)}))
        added = replicas.add_replica()
        prompt, greedy = list(range(5, 25)), SamplingParams(temperature=0.0, max_tokens=6)

        async def answer() -> list[int]:
            outputs = [output async for output in added.llm.generate(EngineRequest("on-added", prompt, greedy))]
            return list(outputs[-1].outputs[0].token_ids)

        assert asyncio.run(answer()) == hf_greedy(load_hf_model(updated), prompt, 6)[0]
    finally:
        replicas.shutdown()
