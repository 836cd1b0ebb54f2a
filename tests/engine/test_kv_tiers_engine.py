"""KV tiers in the engine: host offload of evicted prefix blocks and swap preemption must not
change greedy outputs, and every tier is idle (nothing referenced, counts consistent) after."""

from __future__ import annotations

import json

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.config import EngineConfig
from pagoda.engine.engine_core import EngineCore
from pagoda.engine.engine_request import EngineRequest
from pagoda.request import RequestStatus

BLOCK = 16
GREEDY = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)


def block_bytes(model_dir) -> int:
    config = json.loads((model_dir / "config.json").read_text())
    head_dim = config.get("head_dim") or config["hidden_size"] // config["num_attention_heads"]
    return 2 * config["num_hidden_layers"] * BLOCK * config["num_key_value_heads"] * head_dim * 4


def distinct_prompts(count: int, length: int, seed: int = 3, vocab: int = 300) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (length + 7 * i,), generator=generator).tolist() for i in range(count)]


def greedy(llm: LLM, prompts, params=GREEDY):
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


def assert_tiers_idle(core: EngineCore) -> None:
    kv = core.kv_cache
    assert not core.has_unfinished_requests()
    assert kv.num_held_blocks() == 0 and all(b.ref_cnt == 0 for b in kv.pool.blocks)
    assert kv.num_swapped == 0
    if core.kv_tiers is not None:
        host = core.kv_tiers.host
        assert host.num_private == 0 and not host.pinned
        # Every used host block is a cached entry, each at its own location.
        locations = [e.location for e in host.cached.values()]
        assert len(set(locations)) == len(locations) == host.num_used
        assert set(locations).isdisjoint(host.free_ids)
        core.kv_tiers.transfer.wait_all()


def test_host_offload_serves_evicted_prefixes_without_changing_outputs(llama_dir):
    # 8 prompts of 3-6 blocks against a 12-block device pool: the second round's prefixes
    # were evicted from the device long ago, so hits must come back from the host tier.
    prompts = distinct_prompts(8, 50)
    common = dict(model=str(llama_dir), num_kv_blocks=12, max_num_seqs=2, max_num_batched_tokens=64)
    baseline = LLM(**common)
    expected = [greedy(baseline, prompts)]
    second = baseline.generate(prompts, GREEDY, use_tqdm=False)
    expected.append([o.outputs[0].token_ids for o in second])
    full_hits = [(len(p) - 1) // BLOCK * BLOCK for p in prompts]
    assert sum(o.num_cached_tokens for o in second) < sum(full_hits) // 2  # device pool too small

    llm = LLM(**common, kv_offload_memory=str(64 * block_bytes(llama_dir)))
    first = greedy(llm, prompts)
    outputs = llm.generate(prompts, GREEDY, use_tqdm=False)
    assert [first, [o.outputs[0].token_ids for o in outputs]] == expected
    assert [o.num_cached_tokens for o in outputs] == full_hits  # every full prompt block came back
    stats = llm.engine.get_stats()
    assert stats.kv_tiers.hits["host"] > 0
    assert stats.kv_tiers.transfer_bytes["device_to_host"] > 0
    assert stats.kv_tiers.transfer_bytes["host_to_device"] > 0
    assert stats.prefix_cache_hits == sum(stats.kv_tiers.hits.values())
    assert_tiers_idle(llm.engine.core)


def test_host_tier_lru_keeps_the_most_recent_blocks(llama_dir):
    prompts = distinct_prompts(6, 40)
    llm = LLM(model=str(llama_dir), num_kv_blocks=8, max_num_seqs=1, kv_offload_memory=str(6 * block_bytes(llama_dir)))
    greedy(llm, prompts)
    host = llm.engine.core.kv_tiers.host
    assert host.num_used == 6  # full, and its LRU dropped the oldest prefixes
    outputs = llm.generate(prompts[-1:], GREEDY, use_tqdm=False)
    assert outputs[0].num_cached_tokens > 0  # the latest prompt is still held
    assert_tiers_idle(llm.engine.core)


@pytest.mark.parametrize("mode", ["swap", "auto"])
def test_swap_preemption_matches_recompute(llama_dir, mode):
    # 6 requests growing to 7-9 blocks each in a 10-block pool: requests are preempted over and
    # over; swap brings their KV back from the host instead of recomputing it.
    prompts = distinct_prompts(6, 60, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    common = dict(
        model=str(llama_dir),
        num_kv_blocks=10,
        max_num_batched_tokens=64,
        kv_offload_memory=str(64 * block_bytes(llama_dir)),
    )
    recompute = LLM(**common, preemption_mode="recompute")
    expected = greedy(recompute, prompts, params)
    assert recompute.engine.core.scheduler.num_preemptions_by_mode["recompute"] > 0

    llm = LLM(**common, preemption_mode=mode)
    if mode == "auto":  # priced so that copying always wins here
        llm.engine.core.kv_tiers.policy.forward_s_per_token = 1.0
    outputs = llm.generate(prompts, params, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    by_mode = llm.engine.get_stats().kv_tiers.preemptions
    assert by_mode["swap"] > 0
    # Every request but the FCFS head (never a victim) was swapped out and back.
    assert all(o.metrics.num_preemptions > 0 for o in outputs[1:])
    assert_tiers_idle(llm.engine.core)


def test_auto_recomputes_short_contexts_and_full_host_falls_back(llama_dir):
    from pagoda.core.kv_tiers import PreemptionPolicy

    policy = PreemptionPolicy("auto", prior_forward_s_per_token=1e-4, prior_copy_s_per_block=1e-5)
    assert policy.choose(8, 1) == "recompute"
    assert policy.choose(4096, 256) == "swap"

    # A host tier of 2 blocks holds no preempted request of 3+ blocks: those recompute.
    prompts = distinct_prompts(6, 60, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    common = dict(model=str(llama_dir), num_kv_blocks=14, max_num_batched_tokens=64)
    expected = greedy(LLM(**common), prompts, params)
    llm = LLM(**common, kv_offload_memory=str(2 * block_bytes(llama_dir)), preemption_mode="swap")
    assert greedy(llm, prompts, params) == expected
    by_mode = llm.engine.get_stats().kv_tiers.preemptions
    assert by_mode["recompute"] > 0
    assert_tiers_idle(llm.engine.core)


def test_aborts_while_swapped_and_during_swap_in_leave_every_tier_idle(llama_dir):
    config = EngineConfig(
        model=str(llama_dir),
        num_kv_blocks=10,
        max_num_seqs=10,
        max_num_batched_tokens=64,
        kv_offload_memory=str(64 * block_bytes(llama_dir)),
        preemption_mode="swap",
    )
    core = EngineCore(config)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    for i, prompt in enumerate(distinct_prompts(6, 60, seed=11)):
        core.add_request(EngineRequest(f"r{i}", prompt, params))
    aborted_swapped = aborted_swapping_in = False
    swapped_before: set[str] = set()
    while core.has_unfinished_requests():
        core.step()
        kv = core.kv_cache
        swapped = {rid for rid, samples in core.requests.items() if kv.is_swapped(samples[0])}
        # Swapped out before this step, running now: its swap-in was this step's first copy.
        swapped_in = [rid for rid in swapped_before - swapped if core.requests[rid][0].status == RequestStatus.RUNNING]
        if swapped_in and not aborted_swapping_in:
            core.abort_request(swapped_in[:1])
            aborted_swapping_in = True
        elif swapped and aborted_swapping_in and not aborted_swapped:
            core.abort_request(sorted(swapped)[:1])  # its KV sits in the host tier
            swapped.discard(sorted(swapped)[0])
            aborted_swapped = True
        swapped_before = swapped
        for rid in [rid for rid, samples in core.requests.items() if all(s.is_finished for s in samples)]:
            core.release(rid)
    assert aborted_swapped and aborted_swapping_in
    assert_tiers_idle(core)
    core.close()


def test_swap_needs_a_host_tier():
    with pytest.raises(ValueError, match="kv_offload_memory"):
        EngineConfig(preemption_mode="swap")
    with pytest.raises(ValueError, match="kv_offload_memory"):
        EngineConfig(kv_offload_disk="/tmp/x")
    with pytest.raises(ValueError, match="kv_offload_memory must be a positive size"):
        EngineConfig(kv_offload_memory="lots")
    with pytest.raises(ValueError, match="kv_offload_disk_size must be a positive size"):
        EngineConfig(kv_offload_memory="1GiB", kv_offload_disk="/tmp/x", kv_offload_disk_size="0")


def test_draft_model_kv_moves_with_the_target_kv(llama_dir):
    """With a draft model its KV shares the block ids: offload and swap must carry both. A
    draft equal to the target accepts every token only if its restored KV is right."""
    prompts = distinct_prompts(6, 60, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    expected = greedy(LLM(model=str(llama_dir)), prompts, params)
    llm = LLM(
        model=str(llama_dir),
        num_kv_blocks=10,
        max_num_batched_tokens=64,
        speculative="draft",
        draft_model=str(llama_dir),
        kv_offload_memory=str(128 * block_bytes(llama_dir)),
        preemption_mode="swap",
    )
    assert greedy(llm, prompts, params) == expected
    assert greedy(llm, prompts[:2], params) == expected[:2]
    stats = llm.engine.get_stats()
    assert stats.kv_tiers.preemptions["swap"] > 0 and stats.kv_tiers.hits["host"] > 0
    assert stats.spec_decode.num_drafts > 0
    assert stats.spec_decode.num_accepted_tokens == stats.spec_decode.num_draft_tokens
    assert_tiers_idle(llm.engine.core)


def test_host_tier_bookkeeping_records_copies_in_order():
    from pagoda.core.kv_tiers import DiskTier, HostTier, TransferPlan

    plan = TransferPlan()
    disk = DiskTier(2, b"fp")
    host = HostTier(2, disk)
    host.bind(plan)
    a, b, c = (bytes([i]) * 16 for i in (1, 2, 3))
    assert host.offer(a, (1,), plan) is not None and host.offer(b, (2,), plan) is not None
    assert host.offer(a, (1,), plan) is None  # already held: only its LRU position moves
    host.offer(c, (3,), plan)  # evicts b (least recent) to disk
    assert [op.kind for op in plan.ops] == ["spill"] and plan.ops[0].dst[0][1] == b
    assert host.lookup(b, (9,), plan) is None  # same hash, other tokens: a collision, not a hit
    entry = host.lookup(b, (2,), plan)  # fetched back from disk into a host block
    assert entry is not None and entry.tier == "disk"
    ops = plan.take()  # consecutive copies of one kind form one bulk op: a was spilled to make room
    assert [op.kind for op in ops] == ["spill", "fetch"] and [f[1] for f in ops[0].dst] == [b, a]
    assert host.allocate_private(3) is None and host.num_private == 0  # never partially
    ids = host.allocate_private(2)
    assert ids is not None and host.num_used == 2 and not host.cached
    host.free_private(ids)
    assert host.num_used == 0 and len(disk) == 2


def test_a_host_block_reused_within_a_step_splits_the_bulk_copy():
    from pagoda.core.kv_tiers import HostTier, TransferPlan

    plan = TransferPlan()
    host = HostTier(1)
    host.bind(plan)
    for device_id, block_hash in enumerate((b"a" * 16, b"b" * 16)):
        plan.add("store", device_id, host.offer(block_hash, (device_id,), plan))
    assert [(op.kind, op.src, op.dst) for op in plan.take()] == [("store", [0], [0]), ("store", [1], [0])]
