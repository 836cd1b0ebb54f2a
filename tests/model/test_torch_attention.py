"""The CPU attention backend's half-precision decode: computed in float32 (torch's bf16 CPU
flash kernel is ~5x slower for a single query row), the output in the model's dtype."""

from __future__ import annotations

import pytest
import torch

from pagoda.model.attention.backend import AttentionLayerSpec, BatchLayout
from pagoda.model.attention.torch_backend import TorchAttentionBackend

BLOCK_SIZE = 16


def decode_case(context_lens: list[int], num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype):
    """One decode token per request, each request's blocks consecutive after block 0."""
    gen = torch.Generator().manual_seed(0)
    tables, slots, next_block = [], [], 1
    for context in context_lens:
        blocks = -(-(context + 1) // BLOCK_SIZE)
        tables.append(list(range(next_block, next_block + blocks)))
        slots.append(tables[-1][context // BLOCK_SIZE] * BLOCK_SIZE + context % BLOCK_SIZE)
        next_block += blocks
    width = max(len(t) for t in tables)
    layout = BatchLayout(
        slot_mapping=torch.tensor(slots), query_start_loc=torch.arange(len(context_lens) + 1),
        context_lens=torch.tensor(context_lens), seq_lens=torch.tensor(context_lens) + 1,
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        block_size=BLOCK_SIZE, query_lens_host=[1] * len(context_lens), context_lens_host=list(context_lens))
    n = len(context_lens)
    query, key, value = (torch.randn(n, h, head_dim, generator=gen).to(dtype)
                         for h in (num_heads, num_kv_heads, num_kv_heads))
    caches = [torch.randn(next_block, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2)]
    return layout, query, key, value, caches


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_decode_attends_in_float32(dtype):
    layout, query, key, value, (key_cache, value_cache) = decode_case([5, 40, 17, 63], 4, 2, 32, dtype)
    spec = AttentionLayerSpec(4, 2, 32, 32 ** -0.5, None)
    backend = TorchAttentionBackend()
    got = backend.forward(query, key, value, key_cache.clone(), value_cache.clone(),
                          backend.prepare(layout, {None}), spec)
    assert got.dtype == dtype
    # The same bf16/fp16 values attended in float32 throughout, then rounded once.
    reference = TorchAttentionBackend()
    want = reference.forward(query.float(), key.float(), value.float(), key_cache.float(), value_cache.float(),
                             reference.prepare(layout, {None}), spec)
    assert torch.equal(got, want.to(dtype))

    backend.upcast_half_decode = False  # the kernel in half precision: close, not the same rounding path
    half = backend.forward(query, key, value, key_cache.clone(), value_cache.clone(),
                           backend.prepare(layout, {None}), spec)
    torch.testing.assert_close(half.float(), want, atol=2e-2, rtol=2e-2)
