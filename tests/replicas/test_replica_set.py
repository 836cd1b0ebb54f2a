"""ReplicaSet over real engines on threads (fast to start): pools and rules, failover of
requests that had not started, load paid back, per-replica stats, the idle invariant."""

from __future__ import annotations

import asyncio
import dataclasses
from pathlib import Path

import pytest

from pagoda.config import DeploymentConfig, EngineConfig
from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.engine_request import EngineRequest
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.transport import EngineDeadError
from pagoda.replicas.replica_set import ReplicaSet
from pagoda.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)


class _EngineThatDies(LLMEngine):
    """Crashes at its `dies_at`-th step (1: before any request was accepted)."""

    dies_at = 1

    def step(self):  # type: ignore[override]
        self.dies_at -= 1
        if self.dies_at <= 0:
            raise RuntimeError("simulated replica crash")
        return super().step()


def start(
    llama_dir: Path,
    dying: set[int] = frozenset(),
    dies_at: int = 1,  # type: ignore[assignment]
    **options: object,
) -> ReplicaSet:
    """`options`: EngineConfig and DeploymentConfig fields."""
    deployment = DeploymentConfig(
        **{f.name: options.pop(f.name) for f in dataclasses.fields(DeploymentConfig) if f.name in options}
    )
    config = EngineConfig(model=str(llama_dir), num_threads=1, num_kv_blocks=64, **options)

    def dying_engine(config: EngineConfig) -> LLMEngine:
        engine = _EngineThatDies(config)
        engine.dies_at = dies_at
        return engine

    def starter(index: int, config: EngineConfig) -> AsyncLLM:
        return AsyncLLM(config, transport="thread", engine_factory=dying_engine if index in dying else None)

    return ReplicaSet.start(config, deployment, starter)


async def generate(replicas: ReplicaSet, request_id: str, prompt: list[int], **hints: str) -> list[int]:
    stream = await replicas.add_request(EngineRequest(request_id, prompt, GREEDY, **hints))
    tokens: list[int] = []
    async for delta in stream:
        tokens.extend(t for s in delta.outputs for t in s.token_ids)
    return tokens


def assert_idle(replicas: ReplicaSet) -> None:
    for replica in replicas.replicas:
        if replica.is_alive:
            stats = replica.llm.get_stats()
            assert (stats.num_running, stats.num_waiting) == (0, 0)
            assert stats.num_free_blocks == stats.num_total_blocks
        assert replica.outstanding_tokens == 0 and replica.num_requests == 0


def test_pools_route_by_rules_and_fall_back_when_a_pool_is_empty(llama_dir: Path, tmp_path: Path) -> None:
    rules = tmp_path / "rules.yaml"
    rules.write_text(
        "default: chat\nrules:\n  - {pool: long, min_prompt_tokens: 40}\n  - {pool: long, tenants: [batch-jobs]}\n"
    )
    replicas = start(
        llama_dir, data_parallel_size=3, replica_pools="chat=2,long=1", route_rules=str(rules), router="round_robin"
    )
    try:

        async def scenario() -> None:
            await asyncio.gather(*(generate(replicas, f"short-{i}", [5 + i] * 10) for i in range(4)))
            assert [r.num_routed for r in replicas.replicas] == [2, 2, 0]
            await asyncio.gather(*(generate(replicas, f"long-{i}", [7 + i] * 50) for i in range(3)))
            await generate(replicas, "tenant", [3] * 5, tenant="batch-jobs")
            assert [r.num_routed for r in replicas.replicas] == [2, 2, 4]
            assert [r.pool for r in replicas.replicas] == ["chat", "chat", "long"]
            # The long pool's only replica gone: its requests go to any live replica.
            replicas.replicas[2].llm.shutdown()
            await generate(replicas, "long-late", [9] * 50)
            assert replicas.replicas[2].num_routed == 4
            assert replicas.health()["status"] == "degraded"

        asyncio.run(scenario())
        assert_idle(replicas)
        stats = replicas.replica_stats()
        assert set(stats) == {"0", "1", "2"}
        total = replicas.get_stats()
        assert total.num_total_blocks == sum(s.num_total_blocks for s in stats.values())
    finally:
        replicas.shutdown()


@pytest.mark.parametrize("dies_at", [1, 2], ids=["before-accepting", "after-its-first-token"])
def test_requests_move_off_a_replica_that_dies_before_they_start(llama_dir: Path, dies_at: int) -> None:
    """Dying at its first step, the replica never accepted anything: all 3 requests sent there
    move. Dying at its second step (one request running at a time), the one that had started
    fails and the 2 accepted but waiting move."""
    replicas = start(
        llama_dir, dying={1}, dies_at=dies_at, data_parallel_size=2, router="round_robin", max_num_seqs=1, restart=False
    )
    try:

        async def scenario() -> list[list[int] | BaseException]:
            return await asyncio.gather(
                *(generate(replicas, f"r{i}", [11 + i] * 20) for i in range(6)), return_exceptions=True
            )

        outputs = asyncio.run(scenario())
        failed = [o for o in outputs if isinstance(o, BaseException)]
        assert len(failed) == dies_at - 1 and all(isinstance(e, EngineDeadError) for e in failed)
        assert all(len(o) == GREEDY.max_tokens for o in outputs if not isinstance(o, BaseException))
        assert replicas.replicas[1].num_moved_away == 4 - dies_at
        assert not replicas.replicas[1].is_alive and replicas.is_alive
        assert replicas.health()["status"] == "degraded"
        assert_idle(replicas)
        # Every replica dead: refused as a dead engine would be.
        replicas.replicas[0].llm.shutdown()
        with pytest.raises(EngineDeadError):
            asyncio.run(generate(replicas, "late", [1] * 4))
        assert not replicas.is_alive and replicas.health()["status"] == "dead"
    finally:
        replicas.shutdown()


def test_aborted_requests_pay_back_their_load(llama_dir: Path) -> None:
    replicas = start(llama_dir, data_parallel_size=2)
    try:

        async def scenario() -> None:
            params = SamplingParams(temperature=0.0, max_tokens=200, ignore_eos=True)
            streams = [await replicas.add_request(EngineRequest(f"a{i}", [3 + i] * 30, params)) for i in range(4)]
            assert sum(r.outstanding_tokens for r in replicas.replicas) > 0
            await streams[0].get()
            replicas.abort([s.request_id for s in streams])

        asyncio.run(scenario())
        for replica in replicas.replicas:  # the engines free the aborted requests' blocks
            for _ in range(200):
                stats = replica.llm.get_stats()
                if stats.num_running == stats.num_waiting == 0:
                    break
                asyncio.run(asyncio.sleep(0.01))
        assert_idle(replicas)
    finally:
        replicas.shutdown()


def test_adapters_load_on_every_replica_and_route_apart_from_the_base(llama_dir: Path, tmp_path: Path) -> None:
    from lora_factory import build_adapter
    from pagoda.engine.llm import LLM
    from pagoda.lora_request import LoRARequest

    adapter = LoRARequest("sql", 1, str(build_adapter(llama_dir, tmp_path / "sql", rank=4)))
    prompt = [11, 12, 13, 14] * 4
    expected = (
        LLM(str(llama_dir), num_threads=1, num_kv_blocks=64, enable_lora=True)
        .generate([prompt], GREEDY, lora_request=adapter)[0]
        .outputs[0]
        .token_ids
    )
    replicas = start(llama_dir, data_parallel_size=2, router="cache_aware", enable_lora=True)
    try:

        async def scenario() -> None:
            await replicas.add_lora(adapter)
            assert all(r.llm.lora_names == ["sql"] for r in replicas.replicas)
            for replica in replicas.replicas:  # every replica serves the adapter alike
                stream = await replica.llm.add_request(
                    EngineRequest(f"on-{replica.index}", prompt, GREEDY, lora_request=adapter)
                )
                tokens = [t async for delta in stream for s in delta.outputs for t in s.token_ids]
                assert tokens == list(expected)
            stream = await replicas.add_request(EngineRequest("routed", prompt, GREEDY, lora_request=adapter))
            assert [t async for delta in stream for s in delta.outputs for t in s.token_ids] == list(expected)
            generated = [
                o async for o in replicas.generate(EngineRequest("generated", prompt, GREEDY, lora_request=adapter))
            ]
            assert generated[-1].outputs[0].token_ids == list(expected)
            base = await generate(replicas, "base", prompt)
            assert base != list(expected)  # the adapter changed the output: it was applied
            await replicas.remove_lora("sql")
            assert all(r.llm.lora_names == [] for r in replicas.replicas)

        asyncio.run(scenario())
        assert_idle(replicas)
    finally:
        replicas.shutdown()
