"""Triton attention kernels against the torch reference backend: decode (with and without
split-KV), prefill, chunked prefill over a cached prefix, mixed batches, GQA/MHA, sliding
windows, soft-capped scores, attention sinks, padded CUDA-graph rows; and Gemma 2 (soft-capped,
alternating windows) through the engine on both backends.

With a GPU the kernels run compiled, on CUDA tensors. Without one they run on CPU under Triton's
interpreter (TRITON_INTERPRET=1), which executes each program in numpy, so shapes are tiny. The
interpreter cannot multiply bfloat16 in `tl.dot` (triton-lang/triton#11584), so there 16-bit
coverage uses float16, which takes the same kernel path as bfloat16 on a GPU.
"""

from __future__ import annotations

import os
import random

import pytest
import torch

from pagoda.kernels.attention.backend import AttentionLayerSpec, BatchLayout
from pagoda.kernels.attention.torch_backend import TorchAttentionBackend
from triton_compile import compile_for_gpu
from triton_import import import_triton_module

DEVICE = torch.device("cuda" if torch.cuda.is_available() else "cpu")
INTERPRET = DEVICE.type == "cpu"


TritonAttentionBackend = import_triton_module(
    "pagoda.kernels.attention.triton_backend", interpret=INTERPRET
).TritonAttentionBackend


@pytest.fixture(autouse=True)
def interpreter(monkeypatch):
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")  # triton also reads it while running kernels


BLOCK_SIZE = 16


def make_case(
    requests: list[tuple[int, int]],
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    pad_rows: int = 0,
):
    """Random Q/K/V for requests given as (cached context, new tokens), their blocks scattered
    over a cache full of random values. `pad_rows` adds decode rows with slot -1 and seq_len 1
    after the real ones, as a CUDA-graph batch has."""
    rng = random.Random(seed)
    gen = torch.Generator().manual_seed(seed)
    blocks_needed = [-(-(c + q) // BLOCK_SIZE) for c, q in requests]
    num_blocks = sum(blocks_needed) + 3
    free = list(range(1, num_blocks))
    rng.shuffle(free)
    block_ids = [[free.pop() for _ in range(n)] for n in blocks_needed]

    slots, query_start_loc, tables = [], [0], []
    for (context, new), ids in zip(requests, block_ids):
        slots += [ids[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE for p in range(context, context + new)]
        query_start_loc.append(query_start_loc[-1] + new)
        tables.append(ids)
    context_lens = [c for c, _ in requests]
    query_lens = [q for _, q in requests]
    for _ in range(pad_rows):
        slots.append(-1)
        query_start_loc.append(query_start_loc[-1] + 1)
        tables.append([0])
        context_lens.append(0)
        query_lens.append(1)
    width = max(len(t) for t in tables)
    layout = BatchLayout(
        slot_mapping=torch.tensor(slots, dtype=torch.long),
        query_start_loc=torch.tensor(query_start_loc, dtype=torch.long),
        context_lens=torch.tensor(context_lens, dtype=torch.long),
        seq_lens=torch.tensor([c + q for c, q in zip(context_lens, query_lens)], dtype=torch.long),
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        block_size=BLOCK_SIZE,
        query_lens_host=query_lens,
        context_lens_host=context_lens,
    )
    for name in ("slot_mapping", "query_start_loc", "context_lens", "seq_lens", "block_tables"):
        setattr(layout, name, getattr(layout, name).to(DEVICE))

    num_tokens = len(slots)
    query = torch.randn(num_tokens, num_heads, head_dim, generator=gen).to(dtype)
    key = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(num_tokens, num_kv_heads, head_dim, generator=gen).to(dtype)
    cache_shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    key_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    value_cache = torch.randn(cache_shape, generator=gen).to(dtype)
    return layout, *(t.to(DEVICE) for t in (query, key, value, key_cache, value_cache))


def run_both(
    requests,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    window=None,
    dtype=torch.float32,
    backend=None,
    pad_rows=0,
    seed=0,
    softcap=None,
    sinks=None,
):
    layout, query, key, value, key_cache, value_cache = make_case(
        requests, num_heads, num_kv_heads, head_dim, dtype, seed, pad_rows
    )
    spec = AttentionLayerSpec(
        num_heads, num_kv_heads, head_dim, head_dim**-0.5, window, softcap, None if sinks is None else sinks.to(DEVICE)
    )
    backend = backend or TritonAttentionBackend()
    caches = (key_cache.clone(), value_cache.clone())
    got = backend.forward(query, key, value, *caches, backend.prepare(layout, {window}), spec)

    num_real = sum(q for _, q in requests)
    real_slots = layout.slot_mapping[:num_real]
    ref_caches = (key_cache.clone(), value_cache.clone())
    if pad_rows:  # the reference has no notion of skipped slots: give it the real rows only
        layout = make_case(requests, num_heads, num_kv_heads, head_dim, dtype, seed)[0]
    reference = TorchAttentionBackend()
    want = reference.forward(
        query[:num_real].float(),
        key[:num_real].float(),
        value[:num_real].float(),
        ref_caches[0].float(),
        ref_caches[1].float(),
        reference.prepare(layout, {window}),
        spec,
    )
    tolerance = {torch.float32: 1e-4, torch.float16: 2e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got[:num_real].float(), want, atol=tolerance, rtol=tolerance)
    # Exactly the new tokens' slots were written, with exactly their K/V.
    for cache, new, before in ((caches[0], key, key_cache), (caches[1], value, value_cache)):
        flat, flat_before = cache.view(-1, num_kv_heads, head_dim), before.view(-1, num_kv_heads, head_dim)
        assert torch.equal(flat[real_slots], new[:num_real])
        untouched = torch.ones(flat.shape[0], dtype=torch.bool, device=DEVICE)
        untouched[real_slots] = False
        assert torch.equal(flat[untouched], flat_before[untouched])
    return got


@pytest.mark.parametrize("head_dim", [32, 64, 128])
def test_decode_batch(head_dim):
    run_both([(40, 1), (7, 1), (100, 1), (0, 1)], head_dim=head_dim)


@pytest.mark.parametrize("splits", [2, 3])
def test_decode_split_kv(splits):
    backend = TritonAttentionBackend(decode_splits=splits, min_partition=16)
    run_both([(150, 1), (5, 1), (64, 1), (33, 1)], backend=backend)


def test_decode_split_count_from_lengths():
    backend = TritonAttentionBackend(min_partition=16)
    layout = make_case([(300, 1)], 4, 2, 32)[0]
    spec = AttentionLayerSpec(4, 2, 32, 1.0, None)
    metadata = backend.prepare(layout, {None})
    # On CPU the "GPU" has one SM: 2 programs wanted, 2 KV heads already give them.
    assert backend._num_splits(metadata, spec, torch.device("cpu")) == 1
    backend._num_sms[torch.device("cuda")] = 132
    assert backend._num_splits(metadata, spec, torch.device("cuda")) == 16  # capped by max_decode_splits
    window_spec = AttentionLayerSpec(4, 2, 32, 1.0, 32)
    assert backend._num_splits(metadata, window_spec, torch.device("cuda")) == 4  # (32 + 64) / 16 = 6, down to 4


def test_prefill_without_prefix():
    run_both([(0, 37), (0, 5), (0, 80)])


def test_chunked_prefill_with_cached_prefix():
    run_both([(48, 20), (13, 70), (100, 3)])


def test_mixed_prefill_and_decode():
    run_both([(30, 1), (0, 25), (77, 1), (16, 16), (5, 1)])


@pytest.mark.parametrize("num_heads,num_kv_heads", [(2, 2), (8, 2), (14, 2), (4, 1)])
def test_gqa_and_mha(num_heads, num_kv_heads):
    run_both([(20, 1), (0, 30), (40, 9)], num_heads=num_heads, num_kv_heads=num_kv_heads)
    run_both([(90, 1), (3, 1)], num_heads=num_heads, num_kv_heads=num_kv_heads)


@pytest.mark.parametrize("window", [1, 8, 40])
def test_sliding_window(window):
    run_both([(60, 30), (0, 50), (130, 1)], window=window)
    backend = TritonAttentionBackend(decode_splits=3, min_partition=16)
    run_both([(130, 1), (10, 1), (65, 1)], window=window, backend=backend)


@pytest.mark.parametrize("dtype", [torch.float16] + ([] if INTERPRET else [torch.bfloat16]))
def test_16_bit(dtype):
    run_both([(40, 12), (0, 20), (70, 1)], head_dim=64, dtype=dtype)
    backend = TritonAttentionBackend(decode_splits=2, min_partition=16)
    run_both([(90, 1), (3, 1)], head_dim=64, dtype=dtype, backend=backend)


def test_non_power_of_two_head_dim():
    run_both([(20, 1), (0, 19), (33, 4)], head_dim=48)


def test_padded_rows_write_nothing():
    got = run_both([(40, 1), (3, 1)], pad_rows=3)
    assert torch.isfinite(got).all()
    backend = TritonAttentionBackend(decode_splits=4, min_partition=16)
    got = run_both([(70, 1)], pad_rows=2, backend=backend)
    assert torch.isfinite(got).all()


@pytest.mark.parametrize("window", [None, 8])
def test_soft_capped_scores(window):
    # A cap low enough to bend most scores (they reach about +-3 here).
    run_both([(60, 30), (0, 50), (130, 1), (7, 1)], window=window, softcap=1.5)
    backend = TritonAttentionBackend(decode_splits=3, min_partition=16)
    run_both([(130, 1), (10, 1), (65, 1)], window=window, softcap=1.5, backend=backend)


@pytest.mark.parametrize("window", [None, 8])
def test_attention_sinks(window):
    # Sinks from far below to far above the scores, so some heads give the sink most of the weight.
    sinks = torch.tensor([-20.0, 0.0, 1.5, 6.0])
    run_both([(60, 30), (0, 50), (130, 1), (7, 1)], window=window, sinks=sinks)
    backend = TritonAttentionBackend(decode_splits=3, min_partition=16)
    run_both([(130, 1), (10, 1), (65, 1)], window=window, sinks=sinks, backend=backend)
    run_both([(40, 12), (70, 1)], head_dim=64, dtype=torch.float16, sinks=sinks, softcap=2.0)


def test_sdpa_prefill_path_matches():
    # A lone prompt from position 0 goes to SDPA in 16-bit dtypes; the result must not change.
    kernels_only = run_both([(0, 40)], dtype=torch.float16, backend=TritonAttentionBackend(sdpa_min_tokens=None))
    with_sdpa = run_both([(0, 40)], dtype=torch.float16, backend=TritonAttentionBackend(sdpa_min_tokens=16))
    torch.testing.assert_close(kernels_only, with_sdpa, atol=2e-3, rtol=2e-3)


# ---- quantized KV caches (--kv-cache-dtype): uint8 entries, the torch backend's layout ----

QUANTIZED_KV = ("int8", "fp8_e4m3", "fp8_e5m2", "fp8")


def run_quantized(
    requests,
    kv_name,
    num_heads=4,
    num_kv_heads=2,
    head_dim=32,
    window=None,
    dtype=torch.float32,
    backend_options=None,
    seed=0,
    magnitudes=1.0,
):
    """The Triton backend against the torch backend reading and writing the same quantized cache:
    the new K/V must be encoded to the same bytes, and attention must agree."""
    from pagoda.quant.kv_cache_dtype import make_kv_cache_format

    layout, query, key, value, key_cache, value_cache = make_case(
        requests, num_heads, num_kv_heads, head_dim, dtype, seed
    )
    # K/V of the given size; queries scaled the other way, so softmax stays as peaked.
    query, key, value = query / magnitudes, key * magnitudes, value * magnitudes
    kv_format = make_kv_cache_format(kv_name, dtype)
    reference_format = make_kv_cache_format(kv_name, torch.float32)
    # A cache full of other requests' entries, encoded like the engine would encode them.
    caches = tuple(reference_format.encode(cache.float().cpu()).to(DEVICE) for cache in (key_cache, value_cache))
    spec = AttentionLayerSpec(num_heads, num_kv_heads, head_dim, head_dim**-0.5, window)
    backend = TritonAttentionBackend(kv_format=kv_format, **(backend_options or {}))
    got_caches = tuple(c.clone() for c in caches)
    got = backend.forward(query, key, value, *got_caches, backend.prepare(layout, {window}), spec)

    reference = TorchAttentionBackend(reference_format)
    want_caches = tuple(c.clone() for c in caches)
    want = reference.forward(
        query.float(), key.float(), value.float(), *want_caches, reference.prepare(layout, {window}), spec
    )
    for written, expected in zip(got_caches, want_caches):
        assert torch.equal(written, expected)  # bit for bit, scales included
    tolerance = {torch.float32: 1e-4, torch.float16: 3e-3, torch.bfloat16: 2e-2}[dtype]
    torch.testing.assert_close(got.float(), want, atol=tolerance * magnitudes, rtol=tolerance)
    return got


@pytest.mark.parametrize("kv_name", QUANTIZED_KV)
def test_quantized_kv_decode_prefill_and_mixed(kv_name):
    run_quantized([(40, 1), (7, 1), (100, 1), (0, 1)], kv_name)
    run_quantized([(48, 20), (0, 37), (30, 1), (16, 16)], kv_name, num_heads=8, num_kv_heads=2)
    run_quantized([(150, 1), (5, 1), (64, 1)], kv_name, backend_options=dict(decode_splits=3, min_partition=16))


@pytest.mark.parametrize("kv_name", ["int8", "fp8"])
def test_quantized_kv_16_bit_window_and_head_dims(kv_name):
    run_quantized([(40, 12), (0, 20), (70, 1)], kv_name, head_dim=64, dtype=torch.float16)
    run_quantized([(60, 30), (130, 1)], kv_name, window=8)
    run_quantized([(20, 1), (0, 19), (33, 4)], kv_name, head_dim=48, num_heads=2, num_kv_heads=1)


@pytest.mark.parametrize("kv_name", QUANTIZED_KV)
def test_quantized_kv_encoding_over_magnitudes(kv_name):
    # Tiny values (fp8 subnormals under the per-tensor scale), large ones (clipped at +-448), and
    # rounding that carries into the exponent: still the torch encoder's bytes.
    for magnitudes in (1e-3, 30.0, 1000.0):
        run_quantized([(10, 9), (3, 1)], kv_name, magnitudes=magnitudes, seed=3)


def test_quantized_kv_skips_sdpa_prefill():
    # A lone prompt must attend over the stored (quantized) K/V like every later step does.
    from pagoda.quant.kv_cache_dtype import make_kv_cache_format

    backend = TritonAttentionBackend(kv_format=make_kv_cache_format("int8", torch.float16), sdpa_min_tokens=16)
    assert backend.sdpa_min_tokens is None
    run_quantized([(0, 40)], "int8", dtype=torch.float16, backend_options=dict(sdpa_min_tokens=16))


# The interpreter checks what the kernels compute, not that they compile: this lowers every
# kernel variant the launchers produce to a GPU binary (Triton's bundled ptxas; no GPU needed).
COMPILE_FOR_GPU = r"""
import torch
from triton_compile import arch_and_dtype, compiling
from pagoda.kernels.triton import paged_attention as tk
from pagoda.kernels.triton.kv_codec import KVCacheEncoding
from pagoda.quant.kv_cache_dtype import make_kv_cache_format

dtype = arch_and_dtype()[1]

for name in ("_write_kv_kernel", "_prefill_attention_kernel", "_decode_attention_kernel", "_reduce_splits_kernel"):
    setattr(tk, name, compiling(getattr(tk, name)))
shapes = ((128, 32, 8, None, 3, 8), (64, 14, 2, 4096, 3, 8), (80, 8, 8, None, 3, 8),
          (128, 8, 1, None, 1, 1))  # the last: one request with a one-block table (ints equal to 1)
# Every KV cache dtype on the first two shapes (the quantized variants are separate kernels).
variants = [(shape, "auto") for shape in shapes]
variants += [(shape, name) for shape in shapes[:2] for name in ("int8", "fp8_e4m3", "fp8_e5m2", "fp8")]
for (head_dim, heads, kv_heads, window, num_reqs, width), kv_name in variants:
    kv_format = make_kv_cache_format(kv_name, dtype)
    kv = KVCacheEncoding.of(kv_format)
    query = torch.empty(10, heads, head_dim, dtype=dtype)
    key = torch.empty(10, kv_heads, head_dim, dtype=dtype)
    cache = torch.empty(100, 16, kv_heads, kv_format.entry_size(head_dim), dtype=kv_format.storage_dtype)
    tables = torch.zeros(num_reqs, width, dtype=torch.int32)
    lens = torch.zeros(num_reqs, dtype=torch.long)
    tk.write_kv_cache(key, key, cache, cache, torch.zeros(10, dtype=torch.long), kv)
    for max_query_len in (1, 100):
        tk.prefill_attention(torch.empty_like(query), query, cache, cache, tables,
                             torch.zeros(num_reqs + 1, dtype=torch.long), lens, 0.1, window, max_query_len, kv)
    for splits, min_partition in ((1, 256), (5, 1)):
        tk.decode_attention(torch.empty_like(query[:num_reqs]), query[:num_reqs], cache, cache, tables, lens, 0.1,
                            window, splits, min_partition, kv)
    if kv_name == "auto":  # soft-capping and sinks: their own kernel variants
        sinks = torch.zeros(heads)
        tk.prefill_attention(torch.empty_like(query), query, cache, cache, tables,
                             torch.zeros(num_reqs + 1, dtype=torch.long), lens, 0.1, window, 100, kv,
                             softcap=30.0, sinks=sinks)
        for splits in (1, 5):
            tk.decode_attention(torch.empty_like(query[:num_reqs]), query[:num_reqs], cache, cache, tables, lens,
                                0.1, window, splits, 1, kv, softcap=30.0, sinks=sinks)
"""


@pytest.mark.skipif(not os.environ.get("PAGODA_TRITON_COMPILE"), reason="set PAGODA_TRITON_COMPILE=1 (about a minute)")
@pytest.mark.parametrize("arch,dtype", [(90, "bfloat16"), (80, "float16")])
def test_kernels_compile_for_gpu(arch, dtype):
    result = compile_for_gpu(COMPILE_FOR_GPU, arch, dtype)
    assert result.returncode == 0, result.stderr[-4000:]


# ---- a model through the engine --------------------------------------------------------------


@pytest.mark.parametrize("architecture", ["gemma2", "gpt_oss"])
def test_model_on_triton_matches_the_torch_backend(tmp_path, architecture: str):
    """Gemma 2's soft-capped attention and alternating 24-token windows, gpt-oss's sinks and
    sliding/full layers; prompts past the window, decoding, prefix-cache hits and chunked
    prefill: the Triton backend's logprobs equal the torch backend's within the parity tolerance
    of tests/model/test_gemma_phi3.py."""
    from engine_helpers import prompts_for
    from model_factory import build_model
    from pagoda import LLM, SamplingParams

    directory = build_model(tmp_path / architecture, architecture)
    prompts = prompts_for(256, (30, 9), shared_length=12, seed=1)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, logprobs=0)
    settings = dict(block_size=4, max_num_batched_tokens=16, enable_prefix_caching=True)

    def generate(backend_name: str) -> list[tuple[list[int], list[float]]]:
        if DEVICE.type == "cuda":
            llm = LLM(model=str(directory), attention_backend=backend_name, dtype="float32", **settings)
        else:  # the engine takes Triton on CUDA only: the interpreted backend goes in after startup
            llm = LLM(model=str(directory), **settings)
            if backend_name == "triton":
                llm.engine.core.runner.backend = TritonAttentionBackend()
        results = []
        for _ in range(2):  # the second round reads the first one's cached prefix blocks
            for output in llm.generate(prompts, params):
                completion = output.outputs[0]
                results.append(
                    (
                        completion.token_ids,
                        [completion.logprobs[i][t].logprob for i, t in enumerate(completion.token_ids)],
                    )
                )
        return results

    for (tokens, logprobs), (want_tokens, want_logprobs) in zip(generate("triton"), generate("torch"), strict=True):
        assert tokens == want_tokens
        assert max(abs(a - b) for a, b in zip(logprobs, want_logprobs)) < 2e-5
