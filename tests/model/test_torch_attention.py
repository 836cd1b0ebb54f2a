"""The CPU attention backend's half-precision decode: computed in float32 (torch's bf16 CPU
flash kernel is ~5x slower for a single query row), the output in the model's dtype."""

from __future__ import annotations

import pytest
import torch

from pagoda.kernels.attention.backend import AttentionLayerSpec, BatchLayout
from pagoda.kernels.attention.torch_backend import TorchAttentionBackend

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
        slot_mapping=torch.tensor(slots),
        query_start_loc=torch.arange(len(context_lens) + 1),
        context_lens=torch.tensor(context_lens),
        seq_lens=torch.tensor(context_lens) + 1,
        block_tables=torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32),
        block_size=BLOCK_SIZE,
        query_lens_host=[1] * len(context_lens),
        context_lens_host=list(context_lens),
    )
    n = len(context_lens)
    query, key, value = (
        torch.randn(n, h, head_dim, generator=gen).to(dtype) for h in (num_heads, num_kv_heads, num_kv_heads)
    )
    caches = [torch.randn(next_block, BLOCK_SIZE, num_kv_heads, head_dim, generator=gen).to(dtype) for _ in range(2)]
    return layout, query, key, value, caches


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision_decode_attends_in_float32(dtype):
    layout, query, key, value, (key_cache, value_cache) = decode_case([5, 40, 17, 63], 4, 2, 32, dtype)
    spec = AttentionLayerSpec(4, 2, 32, 32**-0.5, None)
    backend = TorchAttentionBackend()
    got = backend.forward(
        query, key, value, key_cache.clone(), value_cache.clone(), backend.prepare(layout, {None}), spec
    )
    assert got.dtype == dtype
    # The same bf16/fp16 values attended in float32 throughout, then rounded once.
    reference = TorchAttentionBackend()
    want = reference.forward(
        query.float(),
        key.float(),
        value.float(),
        key_cache.float(),
        value_cache.float(),
        reference.prepare(layout, {None}),
        spec,
    )
    assert torch.equal(got, want.to(dtype))

    backend.upcast_half_decode = False  # the kernel in half precision: close, not the same rounding path
    half = backend.forward(
        query, key, value, key_cache.clone(), value_cache.clone(), backend.prepare(layout, {None}), spec
    )
    torch.testing.assert_close(half.float(), want, atol=2e-2, rtol=2e-2)


def test_decode_groups_split_where_padding_would_be_large():
    from pagoda.kernels.attention.torch_backend import decode_groups

    lens = {0: 60, 1: 64, 2: 70, 3: 1500, 4: 66}
    rows = sorted(lens, key=lens.get)
    # One long context does not pad the short ones: it gets a group of its own.
    assert decode_groups(rows, lens, max_size=16, max_padding=2048) == [[0, 1, 4, 2], [3]]
    assert decode_groups(rows, lens, max_size=2, max_padding=2048) == [[0, 1], [4, 2], [3]]
    assert decode_groups(rows, lens, max_size=16, max_padding=10**9) == [rows]


def test_split_decode_groups_attend_exactly_as_one_padded_group(monkeypatch):
    """Grouping changes only which rows share an SDPA call: every row's output is the same."""
    import pagoda.kernels.attention.torch_backend as torch_backend

    layout, query, key, value, (key_cache, value_cache) = decode_case([5, 9, 700, 12, 650, 7], 4, 2, 32, torch.float32)
    spec = AttentionLayerSpec(4, 2, 32, 32**-0.5, None)
    backend = TorchAttentionBackend()
    metadata = backend.prepare(layout, {None})
    assert len(metadata.decodes) == 2
    split = backend.forward(query, key, value, key_cache.clone(), value_cache.clone(), metadata, spec)
    monkeypatch.setattr(torch_backend.decode_groups, "__defaults__", (16, 10**9))
    metadata = backend.prepare(layout, {None})
    assert len(metadata.decodes) == 1
    together = backend.forward(query, key, value, key_cache.clone(), value_cache.clone(), metadata, spec)
    assert torch.equal(split, together)
