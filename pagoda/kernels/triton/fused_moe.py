"""The Triton fused-MoE kernel for CUDA: one grouped GEMM over expert-sorted blocks of rows.

A MoE step arrives as (token, expert) pairs sorted by expert (pagoda.model.moe.route), each
expert owning a contiguous segment of them. `align_blocks` (torch, on the device) cuts every
segment into blocks of BLOCK_M rows, the last one of each padded, and records for each block row
the pair it holds (`num_pairs` for padding) and for each block its expert. Experts the step did
not hit own no block, so a launch's work scales with the active experts, not the held ones. The
grid is sized from the pair and expert counts alone (at most pairs / BLOCK_M + E blocks; the
surplus ones exit at once), so nothing waits on the host and CUDA graphs capture the layer.
A rank that holds only some experts (tensor or expert parallelism) gets zero rows for the pairs
of the others, which the combine then adds as nothing.

`_grouped_expert_kernel`: one program per (block, BLOCK_N output features) computes
out[pair] = A[row of pair] @ W[expert]^T for its block's pairs, walking K in BLOCK_K steps with
fp32 accumulation; constexpr options then apply int8 per-channel scales (qweight [E, N, K'] and
scales [E, N]: weight-only, the tile dequantized in registers after its load), add the expert's
bias and multiply each row by its routing weight before the store. A's row is the pair's token
(GATHER_A: the gate/up product reads the hidden states in place, no gathered copy) or the pair
itself (the down product reads the activations, which are already in pair order). Output rows
stay in pair order, or (SCATTER_OUT) go to given rows: the down product puts each token's k
rows side by side, so one sum over them combines the experts in a fixed order.

`grouped_experts` runs a layer's experts in two launches (gate/up, then down) with the gated
activation between them in torch: it is elementwise on [pairs, I] and covers gpt-oss's clamped
SwiGLU with no kernel variant of its own.

Tested against the torch reference under TRITON_INTERPRET=1 and compiled for sm_80 / sm_90 in
tests/kernels/test_triton_moe.py.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

BLOCK_N = 64
BLOCK_K = 64


@dataclass(frozen=True)
class BlockAlignment:
    """Expert-sorted pairs cut into blocks of `block_m` rows, each block one expert's. Sized
    from the pair and expert counts alone (never the step's segment lengths), so building and
    launching it needs no host sync and a CUDA graph can capture it."""

    block_m: int
    block_rows: torch.Tensor  # int32 [max_blocks * block_m]: the pair in each block row, num_pairs for padding
    block_expert: torch.Tensor  # int32 [max_blocks]: the expert of each block, -1 past the last one
    num_pairs: int


def pick_block_m(num_pairs: int, num_experts: int) -> int:
    """Rows per block, from the mean pairs per expert: decode steps give each hit expert a few
    rows (16: tl.dot's least), prefill chunks many."""
    mean = num_pairs / max(min(num_experts, num_pairs), 1)
    return 16 if mean <= 16 else 32 if mean <= 32 else 64


def align_blocks(counts: torch.Tensor, num_pairs: int, block_m: int) -> BlockAlignment:
    """Blocks for `num_pairs` pairs whose segment lengths per expert are `counts` [E] (on the
    device). Each expert's partial last block is padded, so there are at most
    num_pairs / block_m + E blocks: the grid has that many and the ones past the last real
    block carry expert -1 (the kernel leaves them at once)."""
    device = counts.device
    num_experts = counts.shape[0]
    max_blocks = num_pairs // block_m + num_experts
    counts = counts.to(torch.int64)
    blocks = (counts + block_m - 1) // block_m
    block_end = torch.cumsum(blocks, 0)  # one past each expert's last block
    block = torch.arange(max_blocks, device=device)
    expert = torch.searchsorted(block_end, block, right=True)  # E past the last real block
    real = expert < num_experts
    expert = expert.clamp(max=num_experts - 1)
    segment_start = torch.cumsum(counts, 0) - counts  # each expert's first pair
    within = (block - (block_end - blocks)[expert])[:, None] * block_m + torch.arange(block_m, device=device)
    valid = real[:, None] & (within < counts[expert][:, None])
    pair = torch.where(valid, segment_start[expert][:, None] + within, num_pairs)
    block_expert = torch.where(real, expert, -1)
    return BlockAlignment(block_m, pair.reshape(-1).to(torch.int32), block_expert.to(torch.int32), num_pairs)


@triton.jit
def _grouped_expert_kernel(
    a_ptr,
    a_row_ptr,
    w_ptr,
    scales_ptr,
    bias_ptr,
    route_weight_ptr,
    out_ptr,
    out_row_ptr,
    block_rows_ptr,
    block_expert_ptr,
    num_pairs,
    N,
    K,
    first_expert,
    held_experts,
    stride_am,
    stride_we,
    stride_wn,
    stride_se,
    stride_be,
    stride_om,
    GATHER_A: tl.constexpr,
    SCATTER_OUT: tl.constexpr,
    HAS_SCALES: tl.constexpr,
    HAS_BIAS: tl.constexpr,
    MUL_ROUTE_WEIGHT: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
):
    block = tl.program_id(0)
    pid_n = tl.program_id(1)
    expert = tl.load(block_expert_ptr + block)
    if expert < 0:  # past the last real block
        return
    pairs = tl.load(block_rows_ptr + block * BLOCK_M + tl.arange(0, BLOCK_M))
    pair_valid = pairs < num_pairs
    # An expert this rank does not hold contributes zero rows: no K steps, no bias.
    local = (expert - first_expert).to(tl.int64)
    held = (local >= 0) & (local < held_experts)
    local = tl.where(held, local, 0)
    if GATHER_A:
        a_rows = tl.load(a_row_ptr + pairs, mask=pair_valid, other=0)
    else:
        a_rows = pairs
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    col_valid = cols < N
    ks = tl.arange(0, BLOCK_K)
    a_base = a_ptr + a_rows[:, None].to(tl.int64) * stride_am
    w_base = w_ptr + local * stride_we + cols[None, :].to(tl.int64) * stride_wn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, tl.where(held, K, 0), BLOCK_K):
        k = k0 + ks
        k_valid = k < K
        a = tl.load(a_base + k[None, :], mask=pair_valid[:, None] & k_valid[None, :], other=0.0)
        w = tl.load(w_base + k[:, None], mask=col_valid[None, :] & k_valid[:, None], other=0)  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(a, w.to(a.dtype), input_precision=DOT_PRECISION)
    if HAS_SCALES:
        scales = tl.load(scales_ptr + local * stride_se + cols, mask=col_valid, other=0.0).to(tl.float32)
        acc = acc * scales[None, :]
    if HAS_BIAS:
        bias = tl.load(bias_ptr + local * stride_be + cols, mask=col_valid, other=0.0).to(tl.float32)
        acc = acc + tl.where(held, bias, 0.0)[None, :]
    if MUL_ROUTE_WEIGHT:
        route_weight = tl.load(route_weight_ptr + pairs, mask=pair_valid, other=0.0).to(tl.float32)
        acc = acc * route_weight[:, None]
    if SCATTER_OUT:
        out_rows = tl.load(out_row_ptr + pairs, mask=pair_valid, other=0)
    else:
        out_rows = pairs
    tl.store(
        out_ptr + out_rows[:, None].to(tl.int64) * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=pair_valid[:, None] & col_valid[None, :],
    )


def grouped_linear(
    a: torch.Tensor,
    weight: torch.Tensor,
    blocks: BlockAlignment,
    *,
    a_rows: torch.Tensor | None = None,
    out_rows: torch.Tensor | None = None,
    scales: torch.Tensor | None = None,
    bias: torch.Tensor | None = None,
    route_weights: torch.Tensor | None = None,
    in_features: int | None = None,
    first_expert: int = 0,
) -> torch.Tensor:
    """out [num_pairs, N] in a's dtype: row out_rows[p] (or p) = A[a_rows[p] (or p)] @
    W[expert of p]^T (* scales[expert]) (+ bias[expert]) (* route_weights[p]); zero for a pair
    whose expert is not among the held ones, first_expert .. first_expert + E - 1.

    weight [E, N, K] (16/32-bit, or int8 with `scales` [E, N]; K may be padded beyond
    `in_features`), bias [E, N], route_weights float32 [num_pairs]."""
    held_experts, num_out = weight.shape[0], weight.shape[1]
    in_features = in_features or a.shape[1]
    a = a if a.stride(-1) == 1 else a.contiguous()
    out = torch.empty(blocks.num_pairs, num_out, dtype=a.dtype, device=a.device)
    if blocks.num_pairs == 0:
        return out
    # Unused pointers get a tensor of the right kind: the kernel never reads them (constexpr off).
    grid = (blocks.block_expert.shape[0], triton.cdiv(num_out, BLOCK_N))
    _grouped_expert_kernel[grid](
        a,
        a_rows if a_rows is not None else blocks.block_rows,
        weight,
        scales if scales is not None else weight,
        bias if bias is not None else weight,
        route_weights if route_weights is not None else weight,
        out,
        out_rows if out_rows is not None else blocks.block_rows,
        blocks.block_rows,
        blocks.block_expert,
        blocks.num_pairs,
        num_out,
        in_features,
        first_expert,
        held_experts,
        a.stride(0),
        weight.stride(0),
        weight.stride(1),
        scales.stride(0) if scales is not None else 0,
        bias.stride(0) if bias is not None else 0,
        out.stride(0),
        GATHER_A=a_rows is not None,
        SCATTER_OUT=out_rows is not None,
        HAS_SCALES=scales is not None,
        HAS_BIAS=bias is not None,
        MUL_ROUTE_WEIGHT=route_weights is not None,
        BLOCK_M=blocks.block_m,
        BLOCK_N=BLOCK_N,
        BLOCK_K=BLOCK_K,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 else None,  # fp32 models: no tf32 rounding
        num_warps=4,
        num_stages=3,
    )
    return out


@dataclass(frozen=True)
class ExpertWeights:
    """A layer's held experts stacked: [E, 2I, H] gate/up (gate rows first) and [E, H, I] down,
    with their biases [E, 2I] / [E, H] and, for int8 ones, per-row scales [E, 2I] / [E, H]."""

    gate_up: torch.Tensor
    down: torch.Tensor
    gate_up_bias: torch.Tensor | None = None
    down_bias: torch.Tensor | None = None
    gate_up_scales: torch.Tensor | None = None
    down_scales: torch.Tensor | None = None
    hidden_size: int | None = None  # the true H and I where int8 rows are padded
    intermediate_size: int | None = None


def grouped_experts(
    hidden: torch.Tensor,
    token_index: torch.Tensor,
    route_weights: torch.Tensor,
    counts: torch.Tensor,
    weights: ExpertWeights,
    gated: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
    first_expert: int = 0,
) -> torch.Tensor:
    """sum_k route_weight * expert(token) for every token, [T, H]: pair p is token token_index[p]
    (each token has the same number k of pairs) through expert e (the segment of `counts` [E]
    it falls in); zero terms where e is not among the held experts (`weights` holds
    first_expert onwards)."""
    num_pairs, num_tokens = token_index.shape[0], hidden.shape[0]
    blocks = align_blocks(counts, num_pairs, pick_block_m(num_pairs, counts.shape[0]))
    gate_up = grouped_linear(
        hidden,
        weights.gate_up,
        blocks,
        a_rows=token_index,
        scales=weights.gate_up_scales,
        bias=weights.gate_up_bias,
        in_features=weights.hidden_size,
        first_expert=first_expert,
    )
    gate, up = gate_up.split(gate_up.shape[1] // 2, dim=-1)
    # The down product writes each token's k rows next to each other (in expert order, as the
    # pairs are sorted) and one sum combines them: the same order every run, no atomics.
    by_token = torch.argsort(token_index, stable=True)
    slot = torch.empty_like(by_token).scatter_(0, by_token, torch.arange(num_pairs, device=by_token.device))
    down = grouped_linear(
        gated(gate, up),
        weights.down,
        blocks,
        out_rows=slot,
        scales=weights.down_scales,
        bias=weights.down_bias,
        route_weights=route_weights,
        in_features=weights.intermediate_size,
        first_expert=first_expert,
    )
    return down.view(num_tokens, num_pairs // max(num_tokens, 1), down.shape[1]).sum(dim=1)
