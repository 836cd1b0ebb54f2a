"""CUDA-only paths that the kernel tests do not reach: the grammar bitmask unpacked on the
device, and the engine's host KV tier (pinned host memory, copies on a side stream) under swap
preemption and prefix offload, against the same engine recomputing instead.

Skipped without a GPU. PAGODA_GPU_TESTS_DEVICE=cpu runs them on the CPU (where the bitmask is
unpacked by numpy and the tier copies are synchronous), so their own logic is checked without
one: benchmarks/gpu_check.sh --dry-run does that."""

from __future__ import annotations

import os

import pytest
import torch

from pagoda import LLM, SamplingParams
from pagoda.kernels.bitmask import allocate_bitmask, apply_bitmask

DEVICE = "cuda" if torch.cuda.is_available() else os.environ.get("PAGODA_GPU_TESTS_DEVICE")
pytestmark = pytest.mark.skipif(DEVICE is None, reason="needs a GPU (or PAGODA_GPU_TESTS_DEVICE=cpu)")


def random_bitmask(rows: int, vocab: int, generator: torch.Generator) -> torch.Tensor:
    words = (vocab + 31) // 32
    return torch.randint(-(2**31), 2**31 - 1, (rows, words), generator=generator, dtype=torch.int64).to(torch.int32)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_bitmask_on_the_device_matches_the_cpu(dtype):
    generator = torch.Generator().manual_seed(0)
    vocab = 1000  # not a multiple of 32
    logits = torch.randn(6, vocab + 60, generator=generator).to(dtype)  # wider than the mask's words
    bitmask = random_bitmask(4, vocab, generator)
    rows = torch.tensor([0, 2, 3, 5])
    expected = logits.clone()
    apply_bitmask(expected, bitmask, rows)
    got = logits.to(DEVICE)
    apply_bitmask(got, bitmask, rows.to(DEVICE))
    assert torch.equal(got.cpu(), expected)
    everything = logits.to(DEVICE)
    apply_bitmask(everything, allocate_bitmask(6, vocab))
    assert torch.equal(everything[:, :vocab].cpu(), logits[:, :vocab])
    assert torch.isinf(everything[:, 1024:]).all()  # past the mask's 32 words: not in the tokenizer


def distinct_prompts(count: int, length: int, seed: int, vocab: int = 300) -> list[list[int]]:
    generator = torch.Generator().manual_seed(seed)
    return [torch.randint(5, vocab, (length + 7 * i,), generator=generator).tolist() for i in range(count)]


def greedy(llm: LLM, prompts: list[list[int]], params: SamplingParams) -> list[list[int]]:
    return [o.outputs[0].token_ids for o in llm.generate(prompts, params, use_tqdm=False)]


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
def test_swap_preemption_through_the_host_tier_matches_recompute(llama_dir, kv_cache_dtype):
    # 6 requests growing to 7-9 blocks each in a 10-block pool: preempted over and over; swap
    # brings their KV back from (pinned) host memory instead of recomputing it.
    prompts = distinct_prompts(6, 60, seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    common = dict(
        model=str(llama_dir),
        device=DEVICE,
        dtype="float32",
        num_kv_blocks=10,
        max_num_batched_tokens=64,
        kv_cache_dtype=kv_cache_dtype,
        kv_offload_memory="16MiB",
    )
    recompute = LLM(**common, preemption_mode="recompute")
    expected = greedy(recompute, prompts, params)
    assert recompute.engine.core.scheduler.num_preemptions_by_mode["recompute"] > 0
    del recompute

    llm = LLM(**common, preemption_mode="swap")
    assert greedy(llm, prompts, params) == expected
    stats = llm.engine.get_stats().kv_tiers
    assert stats.preemptions["swap"] > 0
    assert stats.transfer_bytes["device_to_host"] > 0 and stats.transfer_bytes["host_to_device"] > 0
    transfer = llm.engine.core.kv_tiers.transfer
    transfer.wait_all()
    assert all(host.is_pinned() == (DEVICE == "cuda") for host in transfer.host_caches)  # async copies


def test_host_offload_serves_evicted_prefixes_unchanged(llama_dir):
    # 8 prompts of 3-6 blocks against a 12-block device pool: the second round's prefixes were
    # evicted from the device long ago and come back from the host tier.
    prompts = distinct_prompts(8, 50, seed=3)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    common = dict(
        model=str(llama_dir),
        device=DEVICE,
        dtype="float32",
        num_kv_blocks=12,
        max_num_seqs=2,
        max_num_batched_tokens=64,
    )
    baseline = LLM(**common)
    expected = greedy(baseline, prompts, params) + greedy(baseline, prompts, params)
    del baseline

    llm = LLM(**common, kv_offload_memory="16MiB")
    assert greedy(llm, prompts, params) + greedy(llm, prompts, params) == expected
    stats = llm.engine.get_stats().kv_tiers
    assert stats.hits["host"] > 0
    assert stats.transfer_bytes["device_to_host"] > 0 and stats.transfer_bytes["host_to_device"] > 0
    llm.engine.core.kv_tiers.transfer.wait_all()


@pytest.mark.parametrize("kv_name", ["int8", "fp8_e4m3", "fp8_e5m2", "fp8"])
def test_kv_encoding_on_the_device_writes_the_cpu_bytes(kv_name):
    # The first H200 run found CUDA's torch encoder writing other bytes than the CPU's and the
    # Triton kernels': it divided by a Python scalar as a multiplication by its reciprocal. Every
    # backend must read the cache another wrote (tiers, swap, a prefill/decode handoff).
    from pagoda.quant.kv_cache_dtype import KVCacheFormat

    values = torch.randn(64, 4, 32, generator=torch.Generator().manual_seed(1)) * 3.0
    kv_format = KVCacheFormat(kv_name, torch.float32)
    assert torch.equal(kv_format.encode(values.to(DEVICE)).cpu(), kv_format.encode(values))
