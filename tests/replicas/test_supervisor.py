"""Engine supervision over real engines on threads (fast to start): a replica or single engine
that dies is restarted with backoff, rejoins the router, gets its runtime adapters back, and
stays down with the reason once its restart budget is spent. Real process kills are in
tests/serve/test_supervision.py."""

from __future__ import annotations

import asyncio
import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest

from pagoda.config import DeploymentConfig, EngineConfig
from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.engine_request import EngineRequest
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.transport import EngineDeadError
from pagoda.replicas.replica_set import ReplicaSet
from pagoda.replicas.supervised_engine import SupervisedEngine
from pagoda.replicas.supervisor import MAX_BACKOFF_S, EngineKeeper, EngineSupervisor, RestartPolicy
from pagoda.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
FAST = {"replica_restart_backoff": 0.01}


class _EngineThatDies(LLMEngine):
    """Crashes at its first step with work."""

    def step(self):  # type: ignore[override]
        if self.core.has_unfinished_requests():
            raise RuntimeError("simulated engine crash")
        return super().step()


def dying_starts(count: int) -> Callable[[EngineConfig], LLMEngine]:
    """An engine factory whose first `count` engines crash at their first step with work."""
    built = [0]

    def factory(config: EngineConfig) -> LLMEngine:
        built[0] += 1
        return _EngineThatDies(config) if built[0] <= count else LLMEngine(config)

    return factory


def engine_config(llama_dir: Path, **options: Any) -> EngineConfig:
    return EngineConfig(model=str(llama_dir), num_threads=1, num_kv_blocks=64, **options)


def start_set(llama_dir: Path, dying: Callable[[EngineConfig], LLMEngine], **options: Any) -> ReplicaSet:
    """Two replicas on threads, round robin; replica 1's engines come from `dying`."""
    deployment = DeploymentConfig(
        **{f.name: options.pop(f.name) for f in dataclasses.fields(DeploymentConfig) if f.name in options},
        data_parallel_size=2,
        router="round_robin",
    )

    def starter(index: int, config: EngineConfig) -> AsyncLLM:
        return AsyncLLM(config, transport="thread", engine_factory=dying if index == 1 else None)

    return ReplicaSet.start(engine_config(llama_dir, **options), deployment, starter)


async def generate(client: Any, request_id: str, prompt: list[int]) -> list[int]:
    stream = await client.add_request(EngineRequest(request_id, prompt, GREEDY))
    return [t async for delta in stream for s in delta.outputs for t in s.token_ids]


def generate_all(client: Any, prefix: str, prompts: list[list[int]]) -> list[list[int]]:
    async def all_of() -> list[list[int]]:
        return await asyncio.gather(*(generate(client, f"{prefix}-{i}", p) for i, p in enumerate(prompts)))

    return asyncio.run(all_of())


def wait_for(condition: Callable[[], Any], what: str, timeout: float = 30) -> Any:
    deadline = time.monotonic() + timeout
    while not (value := condition()):
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.01)
    return value


def test_backoff_doubles_per_recent_restart_and_is_capped() -> None:
    policy = RestartPolicy(backoff=1.0)
    assert [policy.delay(n) for n in range(4)] == [1.0, 2.0, 4.0, 8.0]
    assert policy.delay(30) == MAX_BACKOFF_S
    assert RestartPolicy(backoff=2 * MAX_BACKOFF_S).delay(3) == 2 * MAX_BACKOFF_S
    assert RestartPolicy.of(DeploymentConfig(restart=False, max_replica_restarts=2)) == RestartPolicy(
        enabled=False, max_restarts=2
    )


@pytest.mark.parametrize(
    "field, value", [("max_replica_restarts", -1), ("replica_restart_window", 0), ("replica_restart_backoff", -0.5)]
)
def test_restart_settings_are_checked(field: str, value: float) -> None:
    with pytest.raises(ValueError, match=field):
        DeploymentConfig(**{field: value})


def test_a_dead_replica_is_restarted_and_rejoins_the_router(llama_dir: Path) -> None:
    replicas = start_set(llama_dir, dying_starts(1), **FAST)
    try:
        first = replicas.replicas[1].llm
        # Round robin: r1 kills replica 1 before it started, so it moves to replica 0.
        outputs = generate_all(replicas, "r", [[5 + i] * 10 for i in range(2)])
        assert all(len(tokens) == GREEDY.max_tokens for tokens in outputs)
        assert replicas.replicas[1].num_moved_away == 1
        wait_for(lambda: replicas.replicas[1].llm is not first and replicas.replicas[1].is_alive, "replica 1 restarted")
        health = replicas.health()
        assert health["status"] == "ok"
        assert [(r["replica"], r["status"], r["restarts"]) for r in health["replicas"]] == [
            ("0", "ok", 0),
            ("1", "ok", 1),
        ]
        assert first.error is not None and not first.is_alive
        # Back in rotation: round robin reaches it again.
        routed = replicas.replicas[1].num_routed
        generate_all(replicas, "after", [[9] * 10] * 2)
        assert replicas.replicas[1].num_routed == routed + 1
        for replica in replicas.replicas:  # the idle invariant, on the restarted replica too
            stats = replica.llm.get_stats()
            assert (stats.num_running, stats.num_waiting) == (0, 0)
            assert stats.num_free_blocks == stats.num_total_blocks
            assert replica.outstanding_tokens == 0 and replica.num_requests == 0
    finally:
        replicas.shutdown()


def test_past_the_budget_a_replica_stays_down_with_the_reason(llama_dir: Path) -> None:
    replicas = start_set(llama_dir, dying_starts(10), max_replica_restarts=1, **FAST)
    try:
        victim = replicas.replicas[1]
        for attempt in range(2):  # each death is caused by the request routed there
            engine = victim.llm
            generate_all(replicas, f"a{attempt}", [[5] * 8] * 2)
            wait_for(lambda engine=engine: not engine.is_alive, "the replica died")
            if attempt == 0:
                wait_for(lambda engine=engine: victim.llm is not engine and victim.is_alive, "replica 1 restarted")
        state = wait_for(lambda: (s := victim.supervisor.state()).status == "failed" and s, "replica 1 given up")
        assert state.restarts == 1 and not state.alive
        assert "--max-replica-restarts" in state.error and "simulated engine crash" in state.error
        health = replicas.health()
        assert health["status"] == "degraded" and health["replicas"][1]["status"] == "failed"
        time.sleep(0.1)  # and stays down
        assert victim.supervisor.state().status == "failed" and victim.supervisor.restarts == 1
    finally:
        replicas.shutdown()


def test_runtime_adapters_are_loaded_again_on_a_restarted_replica(llama_dir: Path, tmp_path: Path) -> None:
    from lora_factory import build_adapter
    from pagoda.lora_request import LoRARequest

    adapter = LoRARequest("sql", 1, str(build_adapter(llama_dir, tmp_path / "sql", rank=4)))
    replicas = start_set(llama_dir, dying_starts(1), enable_lora=True, **FAST)
    try:
        asyncio.run(replicas.add_lora(adapter))
        first = replicas.replicas[1].llm
        generate_all(replicas, "r", [[5 + i] * 10 for i in range(2)])
        wait_for(lambda: replicas.replicas[1].llm is not first and replicas.replicas[1].is_alive, "replica 1 restarted")
        assert replicas.replicas[1].llm.lora_names == ["sql"]
    finally:
        replicas.shutdown()


def test_a_single_engine_is_restarted_and_a_deliberate_shutdown_is_not(llama_dir: Path) -> None:
    config = engine_config(llama_dir)
    factory = dying_starts(1)

    def start(config: EngineConfig) -> AsyncLLM:
        return AsyncLLM(config, transport="thread", engine_factory=factory)

    engine = SupervisedEngine(
        EngineSupervisor(EngineKeeper(lambda: start(config), "test-engine"), start, "0", RestartPolicy(backoff=0.2))
    )
    try:
        first = engine.supervisor.llm
        with pytest.raises(EngineDeadError):
            asyncio.run(generate(engine, "dies", [5] * 8))
        assert not engine.is_alive and engine.health()["status"] in ("restarting", "ok")
        wait_for(lambda: engine.is_alive, "the engine restarted")
        assert engine.supervisor.llm is not first
        assert engine.health() == {
            "pid": engine.supervisor.llm.engine_pid,
            "alive": True,
            "status": "ok",
            "restarts": 1,
        }
        assert len(asyncio.run(generate(engine, "served", [5] * 8))) == GREEDY.max_tokens
        engine.supervisor.llm.shutdown()  # on purpose: not a death
        time.sleep(0.3)
        assert engine.health()["status"] == "dead" and engine.supervisor.restarts == 1
    finally:
        engine.shutdown()


def test_a_restart_that_cannot_start_counts_against_the_budget(llama_dir: Path) -> None:
    config = engine_config(llama_dir)
    starts = [0]

    def start(config: EngineConfig) -> AsyncLLM:
        starts[0] += 1
        if starts[0] > 1:
            raise RuntimeError("the engine failed to start") from OSError("model files gone")
        return AsyncLLM(config, transport="thread", engine_factory=dying_starts(1))

    engine = SupervisedEngine(
        EngineSupervisor(
            EngineKeeper(lambda: start(config), "test-engine"), start, "0", RestartPolicy(backoff=0.01, max_restarts=2)
        )
    )
    try:
        with pytest.raises(EngineDeadError):
            asyncio.run(generate(engine, "dies", [5] * 8))
        wait_for(lambda: engine.health()["status"] == "failed", "the engine given up")
        health = engine.health()
        assert health["restarts"] == 2 and "model files gone" in health["error"]
        with pytest.raises(EngineDeadError):
            asyncio.run(generate(engine, "refused", [5] * 8))
    finally:
        engine.shutdown()
