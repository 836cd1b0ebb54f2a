"""Helpers of the engine tests that other test packages share (tests/engine, tests/quant):
fixed prompts with shared prefixes, a greedy run, and the check that an engine is idle."""

from __future__ import annotations

import torch

from pagoda import LLM, SamplingParams


def prompts_for(
    vocab_size: int, lengths=(5, 23, 70, 41, 9, 100, 33, 64), *, shared_length: int = 32, seed: int = 7
) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    shared = torch.randint(5, vocab_size, (shared_length,), generator=generator).tolist()
    prompts = []
    for i, n in enumerate(lengths):
        tail = torch.randint(5, vocab_size, (n,), generator=generator).tolist()
        prompts.append(shared + tail if i % 2 else tail)  # every other prompt shares the prefix
    return prompts


def run(directory, prompts, params=None, **engine_args):
    llm = LLM(model=str(directory), **engine_args)
    params = params or SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    outputs = llm.generate(prompts, params)
    return [o.outputs[0].token_ids for o in outputs], llm


def assert_idle(llm: LLM) -> None:
    core = llm.engine.core
    assert not core.has_unfinished_requests()
    assert core.kv_cache.num_held_blocks() == 0
    assert all(block.ref_cnt == 0 for block in core.kv_cache.pool.blocks)
    assert core.requests == {}
    slots = core.kv_cache.state_slots  # a hybrid model's state cache
    assert slots is None or slots.num_held == 0
    # A vision-language model's encoder cache: nothing pinned by a step, within its bound.
    cache = core.scheduler.encoder_cache
    assert cache is None or (not cache.in_use and cache.num_tokens <= cache.capacity_tokens)


def teacher_forced_agreement(model, sequences: list[list[int]], prompt_lens: list[int]) -> float:
    """Fraction of generated positions where `model`'s argmax is the reference's next token, fed
    the reference's own sequence (robust to one early divergence, unlike free-running agreement)."""
    llm = LLM(model=str(model), kv_cache_memory="32MiB")
    outputs = llm.generate(sequences, SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0))
    hits = total = 0
    for output, sequence, start in zip(outputs, sequences, prompt_lens):
        for position in range(start, len(sequence)):
            hits += output.prompt_logprobs[position][sequence[position]].rank == 1
            total += 1
    return hits / total
