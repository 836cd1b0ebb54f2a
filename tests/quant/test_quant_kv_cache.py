"""Quantized KV cache (--kv-cache-dtype int8/fp8): encoding accuracy, pool size, agreement
with the full-precision cache, and the output-neutral features staying neutral within a dtype."""

from __future__ import annotations

import pytest
import torch

from engine_helpers import assert_idle, prompts_for, run
from pagoda import LLM, SamplingParams
from pagoda.quant.kv_cache_dtype import KVCacheFormat, make_kv_cache_format
from pagoda.quant.storage_bytes import kv_cache_bytes_per_token

QUANTIZED = ("int8", "fp8_e4m3", "fp8_e5m2")


@pytest.mark.parametrize("name,limit", [("int8", 0.5 / 127), ("fp8_e4m3", 1 / 16), ("fp8_e5m2", 1 / 8)])
def test_encode_decode_error_is_bounded_per_token_and_head(name: str, limit: float) -> None:
    fmt = make_kv_cache_format(name, torch.float32)
    values = torch.randn(37, 4, 64) * torch.logspace(-3, 2, 37)[:, None, None]  # magnitudes vary by token
    entries = fmt.encode(values)
    assert entries.dtype == torch.uint8 and entries.shape == (37, 4, 68)
    decoded = fmt.decode(entries)
    # Relative to each vector's own max (the per token-head scale): small tokens stay accurate.
    error = (decoded - values).abs() / values.abs().amax(dim=-1, keepdim=True)
    assert float(error.max()) <= limit * 1.01
    assert fmt.decode(fmt.encode(torch.zeros(2, 64))).abs().max() == 0


def test_fp8_per_tensor_scale_format() -> None:
    # vLLM's fp8 KV: e4m3 with a fixed scale of 1.0, no bytes per vector beyond the elements.
    fmt = make_kv_cache_format("fp8", torch.float32)
    assert not fmt.scale_per_token and fmt.entry_size(64) == 64
    values = torch.randn(37, 4, 64) * 3
    entries = fmt.encode(values)
    assert entries.dtype == torch.uint8 and entries.shape == (37, 4, 64)
    assert torch.equal(fmt.decode(entries), values.to(torch.float8_e4m3fn).float())
    error = (fmt.decode(entries) - values).abs() / values.abs()
    assert float(error[values.abs() > 2**-6].max()) <= 1 / 16  # 3 mantissa bits in the normal range
    # Out of range: clipped to the largest value, never inf or nan.
    assert fmt.decode(fmt.encode(torch.tensor([1e4, -1e4]))).tolist() == [448.0, -448.0]
    assert kv_cache_bytes_per_token(24, 16, 64, "fp8", 4) == 2 * 24 * 16 * 64


def test_bytes_per_token_and_pool_size(llama_dir) -> None:
    # 2 (k, v) x layers x kv heads x (head_dim bytes + a 4-byte scale).
    assert kv_cache_bytes_per_token(24, 16, 64, "int8", 4) == 2 * 24 * 16 * 68
    assert kv_cache_bytes_per_token(24, 16, 64, "auto", 4) == 2 * 24 * 16 * 64 * 4
    assert kv_cache_bytes_per_token(24, 16, 128, "fp8_e4m3", 2) == 2 * 24 * 16 * 132
    with pytest.raises(ValueError, match="kv_cache_dtype 'int4' is not supported; choose one of auto, int8"):
        make_kv_cache_format("int4", torch.float32)
    blocks = {}
    for dtype in ("auto", "int8"):
        llm = LLM(model=str(llama_dir), kv_cache_dtype=dtype, kv_cache_memory="4MiB")
        blocks[dtype] = llm.engine.core.num_blocks
        key_cache = llm.engine.core.runner.kv_caches[0][0]
        assert key_cache.dtype == (torch.float32 if dtype == "auto" else torch.uint8)
    # head_dim 16 in the tiny model: 64 bytes -> 20 bytes per head and token.
    assert blocks["int8"] == pytest.approx(blocks["auto"] * 64 / 20, rel=0.01)


def test_greedy_agreement_with_full_cache_on_bundled_model() -> None:
    """Observed on four 48-token prompts: int8 192/192 tokens, fp8_e4m3 151/192, fp8_e5m2
    153/192 (fp8 keeps 3 or 2 mantissa bits). Asserted loosely, with per-dtype logprob deltas."""
    prompts = ["def fibonacci(n):", "class Config:\n    def __init__(self", "import os\nimport sys\n"]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=0)
    tokens, logprobs = {}, {}
    for dtype in ("auto",) + QUANTIZED:
        llm = LLM(kv_cache_dtype=dtype, kv_cache_memory="32MiB")
        outputs = llm.generate(prompts, params)
        tokens[dtype] = [o.outputs[0].token_ids for o in outputs]
        logprobs[dtype] = [next(iter(o.outputs[0].logprobs[0].values())).logprob for o in outputs]
    total = sum(len(t) for t in tokens["auto"])
    for dtype, limit, delta in (("int8", 0.9, 0.02), ("fp8_e4m3", 0.5, 0.2), ("fp8_e5m2", 0.5, 0.4)):
        agree = sum(a == b for x, y in zip(tokens["auto"], tokens[dtype]) for a, b in zip(x, y))
        assert agree >= limit * total, (dtype, agree, total)
        # First generated token's logprob (same context for every dtype).
        assert max(abs(a - b) for a, b in zip(logprobs["auto"], logprobs[dtype])) < delta


def test_fp8_pool_is_four_times_fp32(llama_dir) -> None:
    blocks = {
        dtype: LLM(model=str(llama_dir), kv_cache_dtype=dtype, kv_cache_memory="4MiB").engine.core.num_blocks
        for dtype in ("auto", "fp8")
    }
    assert blocks["fp8"] == pytest.approx(4 * blocks["auto"], rel=0.01)


def test_fp8_greedy_agreement_with_full_cache_on_bundled_model() -> None:
    """Observed on three prompts x 24 tokens: fp8 (per-tensor scale 1.0) agrees on 72/72 tokens with
    the full-precision cache; first-token logprob deltas below 0.01."""
    prompts = ["def fibonacci(n):", "class Config:\n    def __init__(self", "import os\nimport sys\n"]
    params = SamplingParams(temperature=0, max_tokens=24, logprobs=0)
    results = {}
    for dtype in ("auto", "fp8"):
        outputs = LLM(kv_cache_dtype=dtype, kv_cache_memory="32MiB").generate(prompts, params)
        results[dtype] = (
            [o.outputs[0].token_ids for o in outputs],
            [next(iter(o.outputs[0].logprobs[0].values())).logprob for o in outputs],
        )
    total = sum(len(t) for t in results["auto"][0])
    agree = sum(a == b for x, y in zip(results["auto"][0], results["fp8"][0]) for a, b in zip(x, y))
    assert agree >= 0.5 * total, (agree, total)
    assert max(abs(a - b) for a, b in zip(results["auto"][1], results["fp8"][1])) < 0.2


@pytest.mark.parametrize("dtype", ["int8", "fp8_e4m3", "fp8"])
def test_output_neutral_features_within_a_quantized_dtype(llama_dir, dtype: str) -> None:
    prompts = prompts_for(300)
    params = SamplingParams(temperature=0.0, max_tokens=24, ignore_eos=True)
    reference, _ = run(
        llama_dir,
        prompts,
        params,
        kv_cache_dtype=dtype,
        max_num_batched_tokens=4096,
        enable_prefix_caching=False,
        num_kv_blocks=512,
    )
    # Chunked prefill with prefix caching: the second round is served from cached blocks.
    llm = LLM(model=str(llama_dir), kv_cache_dtype=dtype, max_num_batched_tokens=16, num_kv_blocks=512)
    for _ in range(2):
        outputs = llm.generate(prompts, params)
        assert [o.outputs[0].token_ids for o in outputs] == reference
    assert llm.engine.get_stats().prefix_cache_hits > 0
    assert_idle(llm)
    # Preemption: 16 blocks force requests out and back in.
    tight, llm = run(llama_dir, prompts, params, kv_cache_dtype=dtype, num_kv_blocks=16, enable_prefix_caching=False)
    assert llm.engine.get_stats().num_preemptions > 0
    assert tight == reference
    # Speculative decoding (prompt lookup) keeps greedy outputs.
    speculative, _ = run(llama_dir, prompts, params, kv_cache_dtype=dtype, speculative="ngram", num_kv_blocks=512)
    assert speculative == reference


def test_backend_selection_with_quantized_kv() -> None:
    # Both backends read quantized caches (Triton's kernels: tests/kernels/test_triton_attention.py);
    # on CPU, auto stays the torch backend, which decodes the format.
    from pagoda.kernels.attention import select_backend

    backend = select_backend("auto", torch.device("cpu"), KVCacheFormat("int8", torch.float32))
    assert backend.name == "torch" and backend.kv_format == KVCacheFormat("int8", torch.float32)
    with pytest.raises(ValueError, match="attention_backend=triton needs"):
        select_backend("triton", torch.device("cpu"), KVCacheFormat("fp8", torch.float32))


def test_quantized_kv_swaps_through_the_host_tier_unchanged(llama_dir) -> None:
    # Quantized entries (values + scales, uint8) go to the host tier and back bit for bit: swap
    # preemption gives the greedy tokens of recompute within the int8 KV dtype.
    from pagoda.config import EngineConfig
    from pagoda.kv_transfer.tiers import model_fingerprint

    generator = torch.Generator().manual_seed(11)
    prompts = [torch.randint(5, 300, (60 + 7 * i,), generator=generator).tolist() for i in range(6)]
    params = SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True)
    common = dict(
        model=str(llama_dir),
        num_kv_blocks=10,
        max_num_batched_tokens=64,
        kv_cache_dtype="int8",
        kv_offload_memory="1MiB",
    )
    expected = [o.outputs[0].token_ids for o in LLM(**common, preemption_mode="recompute").generate(prompts, params)]
    llm = LLM(**common, preemption_mode="swap")
    outputs = llm.generate(prompts, params)
    assert [o.outputs[0].token_ids for o in outputs] == expected
    assert llm.engine.get_stats().kv_tiers.preemptions["swap"] > 0
    assert llm.engine.core.kv_tiers.transfer.host_caches[0].dtype == torch.uint8
    assert_idle(llm)
    # Persisted disk blocks of one KV dtype (or weight format) are never read by another.
    fingerprints = {
        model_fingerprint(EngineConfig(model=str(llama_dir), **knobs), "float32")
        for knobs in ({}, {"kv_cache_dtype": "int8"}, {"quantization": "int8"})
    }
    assert len(fingerprints) == 3
