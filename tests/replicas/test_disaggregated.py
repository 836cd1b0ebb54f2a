"""Disaggregated replicas (--replica-roles): a prefill replica hands each request and its KV to
a decode replica through the router. Engines on threads (fast to start); greedy output equal to
one co-located engine, the fallbacks when a prefill replica dies, stalls or the transfer
drops, and the idle invariant on every replica after each."""

from __future__ import annotations

import asyncio
import dataclasses
import random
import time
import uuid
from pathlib import Path

import pytest

from pagoda.config import DeploymentConfig, EngineConfig
from pagoda.engine.async_llm import AsyncLLM
from pagoda.engine.engine_request import EngineRequest
from pagoda.engine.llm_engine import LLMEngine
from pagoda.engine.step_output import EngineStepOutput
from pagoda.kv_transfer import handoff as handoff_wire
from pagoda.replicas.replica_set import ReplicaSet
from pagoda.sampling_params import SamplingParams

GREEDY = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)


def start(model: Path, engine_factory=None, **options: object) -> ReplicaSet:
    # Every request through a prefill replica unless a test says otherwise (these prompts are short).
    options = {"max_local_prefill_tokens": 0, **options}
    deployment = DeploymentConfig(
        **{f.name: options.pop(f.name) for f in dataclasses.fields(DeploymentConfig) if f.name in options}
    )
    config = EngineConfig(
        model=str(model), num_threads=1, num_kv_blocks=96, block_size=8, max_num_batched_tokens=32, **options
    )

    def starter(index: int, replica: EngineConfig) -> AsyncLLM:
        factory = engine_factory if engine_factory is not None and replica.role == "prefill" else None
        return AsyncLLM(replica, transport="thread", engine_factory=factory)

    return ReplicaSet.start(config, deployment, starter)


def prompts(count: int, length: int, seed: int = 0, shared: int = 0) -> list[list[int]]:
    rng = random.Random(seed)
    prefix = [rng.randrange(3, 300) for _ in range(shared)]
    return [prefix + [rng.randrange(3, 300) for _ in range(length - shared)] for _ in range(count)]


async def generate(
    replicas, request_id: str, prompt: list[int], params: SamplingParams = GREEDY, **hints: object
) -> list[int]:
    stream = await replicas.add_request(EngineRequest(request_id, prompt, params, **hints))
    tokens: list[int] = []
    async for delta in stream:
        tokens.extend(t for s in delta.outputs for t in s.token_ids)
    return tokens


def run_all(replicas, token_lists, params: SamplingParams = GREEDY, salts=None) -> list[list[int]]:
    run = uuid.uuid4().hex[:6]  # request ids are never reused (as the server's are not)

    async def scenario() -> list[list[int]]:
        return list(
            await asyncio.gather(
                *(
                    generate(replicas, f"{run}-{i}", tokens, params, cache_salt=salts[i] if salts else None)
                    for i, tokens in enumerate(token_lists)
                )
            )
        )

    return asyncio.run(scenario())


def assert_idle(replicas: ReplicaSet, within: float = 5.0) -> None:
    """Every live replica idle with every block free (aborts reach an engine asynchronously:
    wait up to `within` seconds for its stats to say so), and the router's books closed."""
    deadline = time.monotonic() + within
    while time.monotonic() < deadline and not all(_idle(r.llm.get_stats()) for r in replicas.replicas if r.is_alive):
        time.sleep(0.05)
    for replica in replicas.replicas:
        if replica.is_alive:
            stats = replica.llm.get_stats()
            assert (stats.num_running, stats.num_waiting) == (0, 0)
            assert stats.num_free_blocks == stats.num_total_blocks
        assert replica.outstanding_tokens == 0 and replica.num_requests == 0
    assert not replicas._legs


def _idle(stats) -> bool:
    return (stats.num_running, stats.num_waiting) == (0, 0) and stats.num_free_blocks == stats.num_total_blocks


def colocated(model: Path, token_lists, params: SamplingParams = GREEDY) -> list[list[int]]:
    replicas = start(model, data_parallel_size=1, router="round_robin", replica_pools="all=1")
    try:
        return run_all(replicas, token_lists, params)
    finally:
        replicas.shutdown()


def disagg_stats(replicas: ReplicaSet):
    return [r.llm.get_stats().disaggregation for r in replicas.replicas]


@pytest.mark.parametrize("architecture,transport", [("llama", "tcp"), ("qwen2", "shm"), ("qwen3", "tcp")])
def test_prefill_and_decode_replicas_match_one_engine(model_dirs, architecture, transport) -> None:
    model = model_dirs[architecture]
    # A shared prefix, so the decode replica's own prefix cache serves later handoffs.
    token_lists = prompts(4, 37, seed=3, shared=16)
    expected = colocated(model, token_lists)
    replicas = start(model, replica_roles="prefill=1,decode=1", kv_transport=transport)
    try:
        assert [r.role for r in replicas.replicas] == ["prefill", "decode"]
        assert run_all(replicas, token_lists) == expected
        prefill, decode = disagg_stats(replicas)
        assert prefill.handoffs_exported == 4 and decode.handoffs_imported == 4
        assert decode.fallback_prefills == 0 and not any(decode.failures.values())
        assert decode.blocks_received + decode.blocks_cached == 4 * 5
        assert_idle(replicas)
    finally:
        replicas.shutdown()


def test_requests_that_cannot_be_handed_off_run_whole_on_a_decode_replica(llama_dir) -> None:
    token_lists = prompts(2, 20, seed=5)
    one_token = SamplingParams(temperature=0.0, max_tokens=1)
    sampled = SamplingParams(n=2, temperature=0.8, seed=7, max_tokens=5)
    replicas = start(llama_dir, replica_roles="prefill=1,decode=1")
    try:
        # Finished at its first token on the prefill replica: that output reaches the client.
        first = run_all(replicas, token_lists, one_token)
        assert [len(tokens) for tokens in first] == [1, 1]
        # n > 1 is not handed off: the decode replica runs it whole.
        many = run_all(replicas, token_lists, sampled)
        assert [len(tokens) for tokens in many] == [10, 10]
        prefill, decode = disagg_stats(replicas)
        assert prefill.handoffs_exported == 0 and decode.handoffs_imported == 0
        assert replicas.replicas[0].num_routed == 2 and replicas.replicas[1].num_routed == 4
        assert_idle(replicas)
    finally:
        replicas.shutdown()


class _PrefillThatDies(LLMEngine):
    """A prefill engine that crashes in its first step with work (before any handoff)."""

    def step(self):  # type: ignore[override]
        if self.core.has_unfinished_requests():
            raise RuntimeError("simulated prefill replica crash")
        return super().step()


def test_a_dead_prefill_replica_leaves_the_decode_replica_to_prefill(llama_dir) -> None:
    token_lists = prompts(3, 30, seed=9)
    expected = colocated(llama_dir, token_lists)
    replicas = start(llama_dir, engine_factory=_PrefillThatDies, replica_roles="prefill=1,decode=1", restart=False)
    try:
        assert run_all(replicas, token_lists) == expected
        assert not replicas.replicas[0].is_alive
        assert replicas.health()["status"] == "degraded"
        decode = disagg_stats(replicas)[1]
        assert decode.fallback_prefills == 3 and decode.handoffs_imported == 0
        # Later requests go straight to the decode replica's own prefill.
        assert run_all(replicas, token_lists[:1]) == expected[:1]
        assert_idle(replicas)
    finally:
        replicas.shutdown()


def test_a_dropped_transfer_is_prefilled_on_the_decode_replica(llama_dir, monkeypatch) -> None:
    token_lists = prompts(3, 41, seed=11)
    expected = colocated(llama_dir, token_lists)
    real_send = handoff_wire._sendall
    sent_runs = {"count": 0}

    def drop_after_the_first_run(sock, session, *parts, **signed):
        # Runs of blocks carry a run header + payload: drop the connection on the second one.
        if len(parts) > 1:
            sent_runs["count"] += 1
            sock.close()
            raise handoff_wire.TransferError("connection dropped (injected)")
        return real_send(sock, session, *parts, **signed)

    monkeypatch.setattr(handoff_wire, "_sendall", drop_after_the_first_run)
    monkeypatch.setattr(handoff_wire, "CHUNK_BYTES", 1)  # one block per run
    replicas = start(llama_dir, replica_roles="prefill=1,decode=1", kv_transfer_timeout=2.0)
    try:
        assert run_all(replicas, token_lists) == expected
        prefill, decode = disagg_stats(replicas)
        assert prefill.failures["send"] == 3 and decode.failures["receive"] == 3
        assert decode.fallback_prefills == 3 and decode.handoffs_imported == 0
        assert sent_runs["count"] == 3
        assert_idle(replicas)
    finally:
        replicas.shutdown()


def test_a_stalled_prefill_replica_times_out_to_the_decode_replica(llama_dir) -> None:
    token_lists = prompts(2, 30, seed=13)
    expected = colocated(llama_dir, token_lists)

    class _Stalled(LLMEngine):
        def step(self):  # type: ignore[override]
            time.sleep(0.05)
            return EngineStepOutput() if self.core.has_unfinished_requests() else super().step()

    replicas = start(llama_dir, engine_factory=_Stalled, replica_roles="prefill=1,decode=1", kv_prefill_timeout=0.5)
    try:
        assert run_all(replicas, token_lists) == expected
        decode = disagg_stats(replicas)[1]
        assert decode.fallback_prefills == 2
        # The stalled replica's requests were aborted by the router: nothing held there.
        assert_idle(replicas)
    finally:
        replicas.shutdown()


def test_tenant_salts_travel_with_the_blocks_and_an_abort_leaks_nothing(llama_dir) -> None:
    token_lists = prompts(3, 33, seed=17, shared=24)
    salts = ["a", "a", "b"]
    replicas = start(llama_dir, replica_roles="prefill=1,decode=1")
    try:
        expected = colocated(llama_dir, token_lists)
        outputs = run_all(replicas, token_lists[:1], salts=salts[:1])
        outputs += run_all(replicas, token_lists[1:], salts=salts[1:])
        assert outputs == expected
        decode = disagg_stats(replicas)[1]
        # Tenant a's second request finds its 3 shared blocks in the decode cache; b none.
        assert decode.blocks_cached == 3 and decode.blocks_received == 3 * 5 - 3
        assert decode.handoffs_imported == 3

        async def aborted() -> None:
            stream = await replicas.add_request(EngineRequest("gone", token_lists[0], SamplingParams(max_tokens=50)))
            await asyncio.sleep(0.05)
            replicas.abort(["gone"])
            assert stream is not None

        asyncio.run(aborted())
        assert_idle(replicas)
    finally:
        replicas.shutdown()


def test_replica_roles_are_checked(llama_dir) -> None:
    with pytest.raises(ValueError, match="replica_roles must look like"):
        DeploymentConfig(replica_roles="prefill=1")
    with pytest.raises(ValueError, match="replica_roles counts add up to 2"):
        DeploymentConfig(replica_roles="prefill=1,decode=1", data_parallel_size=3)
    with pytest.raises(ValueError, match="set each replica's role"):
        DeploymentConfig(replica_roles="prefill=1,decode=1").validate_with(
            EngineConfig(model=str(llama_dir), role="decode")
        )
    assert DeploymentConfig(replica_roles="prefill=1,decode=2").num_replicas == 3
    from pagoda.replicas.start import start_engines

    with pytest.raises(ValueError, match="--replica-roles"):
        start_engines(EngineConfig(model=str(llama_dir), role="prefill"))


class _DecodeThatDies(LLMEngine):
    """A decode engine that crashes when the first handoff reaches it (nothing streamed yet)."""

    def step(self):  # type: ignore[override]
        if self.kv_connector.has_events():
            raise RuntimeError("simulated decode replica crash")
        return super().step()


def test_a_dead_decode_replica_moves_its_requests_and_the_prefill_side_holds_nothing(llama_dir) -> None:
    token_lists = prompts(3, 30, seed=19)
    expected = colocated(llama_dir, token_lists)
    config = EngineConfig(
        model=str(llama_dir),
        num_threads=1,
        num_kv_blocks=96,
        block_size=8,
        max_num_batched_tokens=32,
        kv_transfer_timeout=2.0,
    )
    deployment = DeploymentConfig(
        replica_roles="prefill=1,decode=2", router="round_robin", max_local_prefill_tokens=0, restart=False
    )

    def starter(index: int, replica: EngineConfig) -> AsyncLLM:
        return AsyncLLM(replica, transport="thread", engine_factory=_DecodeThatDies if index == 1 else None)

    replicas = ReplicaSet.start(config, deployment, starter)
    try:
        assert [r.role for r in replicas.replicas] == ["prefill", "decode", "decode"]
        assert run_all(replicas, token_lists) == expected
        assert not replicas.replicas[1].is_alive and replicas.replicas[1].num_moved_away >= 1
        assert replicas.health()["status"] == "degraded"
        assert_idle(replicas)  # the prefill replica freed every block at export, sent or not
    finally:
        replicas.shutdown()


def test_seeded_sampling_continues_where_the_prefill_replica_left_it(llama_dir) -> None:
    """The request's generator state travels with its KV: the decode replica draws what one
    engine would have drawn next."""
    token_lists = prompts(3, 25, seed=29)
    seeded = SamplingParams(temperature=0.9, top_p=0.95, seed=1234, max_tokens=10, ignore_eos=True)
    expected = colocated(llama_dir, token_lists, seeded)
    replicas = start(llama_dir, replica_roles="prefill=1,decode=1")
    try:
        assert run_all(replicas, token_lists, seeded) == expected
        assert disagg_stats(replicas)[1].handoffs_imported == 3
        assert_idle(replicas)
    finally:
        replicas.shutdown()


def test_short_uncached_prompts_are_prefilled_on_the_decode_replica(llama_dir) -> None:
    """--max-local-prefill-tokens: a prompt with few tokens not cached on its decode replica is
    prefilled there (no round trip through a prefill replica); a longer one is handed over."""
    short, long = prompts(1, 12, seed=37)[0], prompts(1, 40, seed=41)[0]
    expected = colocated(llama_dir, [short, long])
    replicas = start(llama_dir, replica_roles="prefill=1,decode=1", max_local_prefill_tokens=16)
    try:
        assert run_all(replicas, [short, long]) == expected
        prefill, decode = disagg_stats(replicas)
        assert prefill.handoffs_exported == 1 and decode.handoffs_imported == 1
        assert replicas.replicas[0].num_routed == 1 and replicas.replicas[1].num_routed == 2
        assert_idle(replicas)
    finally:
        replicas.shutdown()
