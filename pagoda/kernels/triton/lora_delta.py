"""The batched LoRA delta on GPU: Punica's SGMV as two Triton kernels.

The step's adapter tokens are sorted by slot (LoRABatch.rows) and cut into tiles of BLOCK_M
tokens that never straddle two adapters; a tile table (slot, first row, end row) drives both
kernels, so one launch each serves every adapter in the step, whatever their mix:

- `_shrink_kernel`: one program per tile: `xa[tile] = x[rows[tile]] @ A[slot, :width]^T`,
  reducing over the input features in BLOCK_K chunks (fp32 accumulation).
- `_expand_kernel`: one program per (tile, BLOCK_N output columns): `y[rows[tile], cols] +=
  xa[tile] @ B_t[slot, :width, cols]`. Each row belongs to one tile, so the read-add-write
  needs no atomics, and rows of base-model tokens are never touched.

Tested on CPU under TRITON_INTERPRET=1 (tests/kernels/test_triton_lora.py, `make test-triton`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.lora_batch import LoRABatch

BLOCK_M = 16  # tokens per tile (tl.dot needs >= 16)
BLOCK_K = 32  # input features per shrink step
BLOCK_N = 64  # output features per expand program


@triton.jit
def _shrink_kernel(
    x_ptr,
    a_ptr,
    xa_ptr,
    rows_ptr,
    tiles_ptr,
    in_features,
    width,
    stride_x_row,
    stride_a_slot,
    stride_a_rank,
    stride_xa_row,
    WIDTH_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    slot = tl.load(tiles_ptr + tile * 3)
    start = tl.load(tiles_ptr + tile * 3 + 1)
    end = tl.load(tiles_ptr + tile * 3 + 2)
    offsets = start + tl.arange(0, BLOCK_M)
    row_valid = offsets < end
    rows = tl.load(rows_ptr + offsets, mask=row_valid, other=0)
    ranks = tl.arange(0, WIDTH_PAD)
    rank_valid = ranks < width
    acc = tl.zeros((BLOCK_M, WIDTH_PAD), dtype=tl.float32)
    for k0 in range(0, in_features, BLOCK_K):
        ks = k0 + tl.arange(0, BLOCK_K)
        k_valid = ks < in_features
        x = tl.load(
            x_ptr + rows[:, None] * stride_x_row + ks[None, :], mask=row_valid[:, None] & k_valid[None, :], other=0.0
        )
        a = tl.load(
            a_ptr + slot * stride_a_slot + ranks[None, :] * stride_a_rank + ks[:, None],
            mask=rank_valid[None, :] & k_valid[:, None],
            other=0.0,
        )  # A^T tile [K, W]
        acc += tl.dot(x, a, input_precision=DOT_PRECISION)
    tl.store(
        xa_ptr + offsets[:, None] * stride_xa_row + ranks[None, :], acc, mask=row_valid[:, None] & rank_valid[None, :]
    )


@triton.jit
def _expand_kernel(
    xa_ptr,
    b_ptr,
    y_ptr,
    rows_ptr,
    tiles_ptr,
    out_features,
    width,
    stride_xa_row,
    stride_b_slot,
    stride_b_rank,
    stride_y_row,
    WIDTH_PAD: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    tile = tl.program_id(0)
    col_block = tl.program_id(1)
    slot = tl.load(tiles_ptr + tile * 3)
    start = tl.load(tiles_ptr + tile * 3 + 1)
    end = tl.load(tiles_ptr + tile * 3 + 2)
    offsets = start + tl.arange(0, BLOCK_M)
    row_valid = offsets < end
    rows = tl.load(rows_ptr + offsets, mask=row_valid, other=0)
    ranks = tl.arange(0, WIDTH_PAD)
    rank_valid = ranks < width
    cols = col_block * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < out_features
    xa = tl.load(
        xa_ptr + offsets[:, None] * stride_xa_row + ranks[None, :],
        mask=row_valid[:, None] & rank_valid[None, :],
        other=0.0,
    )
    b = tl.load(
        b_ptr + slot * stride_b_slot + ranks[:, None] * stride_b_rank + cols[None, :],
        mask=rank_valid[:, None] & col_valid[None, :],
        other=0.0,
    )
    delta = tl.dot(xa.to(b.dtype), b, input_precision=DOT_PRECISION)
    mask = row_valid[:, None] & col_valid[None, :]
    y_tile = y_ptr + rows[:, None] * stride_y_row + cols[None, :]
    y = tl.load(y_tile, mask=mask, other=0.0)
    tl.store(y_tile, (y.to(tl.float32) + delta).to(y.dtype), mask=mask)


def tile_table(batch: LoRABatch) -> torch.Tensor:
    """[num_tiles, 3] int32 (slot, first row, end row) into batch.rows, BLOCK_M rows at most,
    built once per step and shared by every layer."""
    cached = batch.kernel_tiles.get(BLOCK_M)
    if cached is None:
        tiles = [
            (slot, begin, min(begin + BLOCK_M, end))
            for slot, start, end in batch.segments
            for begin in range(start, end, BLOCK_M)
        ]
        cached = torch.tensor(tiles, dtype=torch.int32, device=batch.rows.device)
        batch.kernel_tiles[BLOCK_M] = cached
    return cached


def add_lora_delta_triton(
    output: torch.Tensor, x: torch.Tensor, lora_a: torch.Tensor, lora_b_t: torch.Tensor, batch: LoRABatch, width: int
) -> torch.Tensor:
    """`output[t] += x[t] @ A[slot]^T @ B[slot]^T` for the adapter tokens of `batch`, in place."""
    tiles = tile_table(batch)
    num_rows = batch.rows.shape[0]
    x = x.contiguous()
    xa = torch.empty(num_rows, width, dtype=torch.float32, device=x.device)
    width_pad = max(16, triton.next_power_of_2(width))
    precision = "ieee" if x.dtype == torch.float32 else None  # fp32 models: no tf32 rounding
    _shrink_kernel[(tiles.shape[0],)](
        x,
        lora_a,
        xa,
        batch.rows,
        tiles,
        x.shape[1],
        width,
        x.stride(0),
        lora_a.stride(0),
        lora_a.stride(1),
        xa.stride(0),
        WIDTH_PAD=width_pad,
        BLOCK_M=BLOCK_M,
        BLOCK_K=BLOCK_K,
        DOT_PRECISION=precision,
    )
    out_features = output.shape[1]
    _expand_kernel[(tiles.shape[0], triton.cdiv(out_features, BLOCK_N))](
        xa,
        lora_b_t,
        output,
        batch.rows,
        tiles,
        out_features,
        width,
        xa.stride(0),
        lora_b_t.stride(0),
        lora_b_t.stride(1),
        output.stride(0),
        WIDTH_PAD=width_pad,
        BLOCK_M=BLOCK_M,
        BLOCK_N=BLOCK_N,
        DOT_PRECISION=precision,
    )
    return output
