"""Engine features that must not change results, and the KV-block bookkeeping behind them."""

from __future__ import annotations

import torch

from engine_helpers import assert_idle, prompts_for, run
from pagoda import LLM, SamplingParams
from pagoda.config import EngineConfig
from pagoda.engine.engine_request import EngineRequest
from pagoda.engine.llm_engine import LLMEngine
from pagoda.outputs import OutputAccumulator


def test_prefix_caching_does_not_change_outputs(llama_dir):
    prompts = prompts_for(300)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    results = {}
    for caching in (True, False):
        llm = LLM(model=str(llama_dir), enable_prefix_caching=caching, max_num_batched_tokens=64)
        # Requests admitted together cannot share blocks not yet computed; a second round can.
        rounds = [llm.generate(prompts, params), llm.generate(prompts, params)]
        results[caching] = [[o.outputs[0].token_ids for o in outputs] for outputs in rounds]
        hits = llm.engine.get_stats().prefix_cache_hits
        assert (hits > 0) == caching
        assert_idle(llm)
    assert results[True] == results[False]
    assert results[True][0] == results[True][1]


def test_token_budget_does_not_change_outputs(llama_dir):
    prompts = prompts_for(300)
    unlimited, _ = run(llama_dir, prompts, max_num_batched_tokens=4096)
    chunked, llm = run(llama_dir, prompts, max_num_batched_tokens=16)
    assert chunked == unlimited
    assert_idle(llm)


def test_preemption_does_not_change_outputs(llama_dir):
    prompts = prompts_for(300)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    roomy, _ = run(llama_dir, prompts, params, num_kv_blocks=512)
    # 16 blocks of 16 tokens: the longest request alone needs 12 of them.
    tight, llm = run(llama_dir, prompts, params, num_kv_blocks=16, enable_prefix_caching=False)
    assert llm.engine.get_stats().num_preemptions > 0
    assert tight == roomy
    assert_idle(llm)


def test_preemption_with_prefix_cache_and_priority_policy(llama_dir):
    prompts = prompts_for(300)
    params = SamplingParams(temperature=0.0, max_tokens=48, ignore_eos=True)
    roomy, _ = run(llama_dir, prompts, params, num_kv_blocks=512)
    tight, llm = run(
        llama_dir, prompts, params, num_kv_blocks=16, scheduling_policy="priority", max_num_batched_tokens=32
    )
    assert llm.engine.get_stats().num_preemptions > 0
    assert tight == roomy
    assert_idle(llm)


def test_batching_does_not_change_outputs(llama_dir):
    prompts = prompts_for(300)
    batched, _ = run(llama_dir, prompts)
    one_by_one = [run(llama_dir, [p])[0][0] for p in prompts[:3]]
    assert batched[:3] == one_by_one


def test_seeded_samples_are_reproducible_and_share_prompt_blocks(llama_dir):
    params = SamplingParams(n=4, temperature=0.8, seed=1234, max_tokens=20, ignore_eos=True)
    prompt = list(range(5, 5 + 40))  # 40 tokens: 2 full blocks + a partial one

    engine = LLMEngine(EngineConfig(model=str(llama_dir)))
    engine.add_request(EngineRequest("r", prompt, params))
    deltas = []  # step() returns what each request gained: collect it all
    while engine.core.requests["r"][0].pending_forks:
        deltas.extend(engine.step().deltas)
    samples = engine.core.requests["r"]
    pool = engine.core.kv_cache.pool
    shared_full_blocks = samples[0].block_ids[:2]
    for sample in samples:
        assert sample.block_ids[:2] == shared_full_blocks  # shared, not copied
    assert all(pool.blocks[b].ref_cnt == 4 for b in shared_full_blocks)
    while engine.has_unfinished_requests():
        deltas.extend(engine.step().deltas)
    outputs = OutputAccumulator()
    final = [outputs.add(delta) for delta in deltas][-1]
    first = [c.token_ids for c in final.outputs]
    assert engine.core.kv_cache.num_held_blocks() == 0

    second = LLM(model=str(llama_dir)).generate([prompt], params)[0]
    assert [c.token_ids for c in second.outputs] == first
    assert len({tuple(t) for t in first}) > 1  # the samples differ from each other


def test_seeded_request_is_independent_of_batch(llama_dir):
    seeded = SamplingParams(temperature=1.0, seed=99, max_tokens=16, ignore_eos=True)
    other = SamplingParams(temperature=1.0, max_tokens=16, ignore_eos=True)
    prompt = [5, 6, 7, 8, 9]
    llm = LLM(model=str(llama_dir))
    alone = llm.generate([prompt], seeded)[0].outputs[0].token_ids
    crowd = llm.generate([[11, 12], prompt, [40] * 30], [other, seeded, other])
    assert crowd[1].outputs[0].token_ids == alone


def test_shared_prefix_is_served_from_cache_and_salt_isolates(llama_dir):
    generator = torch.Generator().manual_seed(3)
    prefix = torch.randint(5, 300, (200,), generator=generator).tolist()
    params = SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True)
    llm = LLM(model=str(llama_dir))
    first = llm.generate([prefix + [10, 11, 12]], params)[0]
    assert first.num_cached_tokens == 0
    second = llm.generate([prefix + [20, 21, 22, 23]], params)[0]
    assert second.num_cached_tokens >= 192
    stats = llm.engine.get_stats()
    assert stats.prefix_cache_hits >= 192
    salted = llm.generate([prefix + [20, 21, 22, 23]], params, cache_salt="tenant-b")[0]
    assert salted.num_cached_tokens == 0
    assert salted.outputs[0].token_ids == second.outputs[0].token_ids
    assert_idle(llm)


def test_idle_after_aborts_in_prefill_and_decode(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), max_num_batched_tokens=16))
    params = SamplingParams(temperature=0.0, max_tokens=50, ignore_eos=True)
    engine.add_request(EngineRequest("decoding", [5, 6, 7], params))
    engine.add_request(EngineRequest("prefilling", list(range(5, 105)), params))  # 100 tokens: 7 steps of prefill
    engine.add_request(EngineRequest("waiting", list(range(5, 200)), params))
    engine.step()
    engine.step()
    decoding = engine.core.requests["decoding"][0]
    assert decoding.num_output_tokens > 0
    prefilling = engine.core.requests["prefilling"][0]
    assert 0 < prefilling.num_computed_tokens < prefilling.num_prompt_tokens
    engine.abort_request(["prefilling", "decoding", "waiting", "unknown"])
    outputs = engine.step().deltas
    assert {o.request_id for o in outputs} == {"prefilling", "decoding", "waiting"}
    assert all(o.finished and o.outputs[0].finish_reason == "abort" for o in outputs)
    assert engine.core.kv_cache.num_held_blocks() == 0
    assert not engine.has_unfinished_requests()


def test_idle_after_n_samples_aborted_mid_decode(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir)))
    engine.add_request(
        EngineRequest("r", list(range(5, 45)), SamplingParams(n=3, temperature=1.0, max_tokens=30, ignore_eos=True))
    )
    for _ in range(6):
        engine.step()
    engine.abort_request(["r"])
    engine.step()
    assert engine.core.kv_cache.num_held_blocks() == 0
    assert engine.core.requests == {}


def test_chunked_prefill_never_stalls_running_decodes(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), max_num_batched_tokens=32))
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    engine.add_request(EngineRequest("short", [5, 6, 7], params))
    engine.step()
    engine.add_request(EngineRequest("long", list(range(5, 305)), params))  # 300 tokens: ~10 chunks
    short = engine.core.requests["short"][0]
    long = engine.core.requests["long"][0]
    while long.num_computed_tokens < long.num_prompt_tokens:
        before = short.num_output_tokens
        engine.step()
        assert short.num_output_tokens == before + 1  # a decode every step
    while engine.has_unfinished_requests():
        engine.step()


def test_priority_policy_runs_urgent_requests_first(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), max_num_seqs=1, scheduling_policy="priority"))
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.add_request(EngineRequest("low-a", [5, 6, 7], params, priority=5))
    engine.add_request(EngineRequest("low-b", [8, 9, 10], params, priority=5))
    engine.step()
    engine.add_request(EngineRequest("urgent", [11, 12], params, priority=0))  # the one slot is taken: low-a gives way
    finish_order = []
    while engine.has_unfinished_requests():
        finish_order.extend(o.request_id for o in engine.step().deltas if o.finished)
    assert finish_order[0] == "urgent"
    assert engine.get_stats().num_preemptions == 1
    assert engine.core.kv_cache.num_held_blocks() == 0


def test_fcfs_policy_never_preempts_for_new_arrivals(llama_dir):
    engine = LLMEngine(EngineConfig(model=str(llama_dir), max_num_seqs=1))
    params = SamplingParams(temperature=0.0, max_tokens=30, ignore_eos=True)
    engine.add_request(EngineRequest("a", [5, 6, 7], params))
    engine.add_request(EngineRequest("b", [8, 9, 10], params))
    engine.step()
    engine.add_request(EngineRequest("late", [11, 12], params, priority=-10))
    finish_order = []
    while engine.has_unfinished_requests():
        finish_order.extend(o.request_id for o in engine.step().deltas if o.finished)
    assert finish_order[-1] == "late" and engine.get_stats().num_preemptions == 0
