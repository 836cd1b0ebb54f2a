"""Triton kernels for the quantized weight formats on CUDA: w8a16 and w4a16 matmuls.

Weight-only: activations stay 16-bit; the weight tile is dequantized in registers right after it
is loaded and multiplied with `tl.dot` (fp32 accumulation), so the weight crosses memory once,
in its quantized size. One program owns a [BLOCK_M, BLOCK_N] tile of the output and walks K.

- int8 (per output channel): qweight int8 [N, K'] (K' >= K, padded columns ignored), scales [N];
  out = (x @ q^T) * scale, the scale applied once to the accumulator.
- int4 (group-wise, tinygemm's convention w = (q - 8) * scale + zero): qweight uint8 [N, K / 2]
  packed in chunks of PACK_K = 32 inputs: byte j of a chunk holds input j in its low nibble and
  input j + 16 in its high nibble. A chunk's two halves are then two plain [16, BLOCK_N] tiles
  (no interleaving shuffles in the kernel). scales_and_zeros [K / group, N, 2] (tinygemm's
  layout, the CPU path's too). Group sizes (32/64/128) are multiples of PACK_K, so a chunk never
  straddles two groups.

Tested against float references under TRITON_INTERPRET=1 and compiled for sm_80 / sm_90 in
tests/kernels/test_triton_weight_kernels.py; not yet run on a GPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

PACK_K = 32
HALF_K = PACK_K // 2


@triton.jit
def _int8_matmul_kernel(
    x_ptr,
    w_ptr,
    scales_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_valid = rows < M
    col_valid = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k = k0 + ks
        k_valid = k < K
        x = tl.load(
            x_ptr + rows[:, None].to(tl.int64) * stride_xm + k[None, :],
            mask=row_valid[:, None] & k_valid[None, :],
            other=0.0,
        )
        w = tl.load(
            w_ptr + cols[None, :].to(tl.int64) * stride_wn + k[:, None],
            mask=col_valid[None, :] & k_valid[:, None],
            other=0,
        )  # [BLOCK_K, BLOCK_N]
        acc += tl.dot(x, w.to(x.dtype))
    scales = tl.load(scales_ptr + cols, mask=col_valid, other=0.0).to(tl.float32)
    out = acc * scales[None, :]
    tl.store(
        out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & col_valid[None, :],
    )


@triton.jit
def _int4_matmul_kernel(
    x_ptr,
    w_ptr,
    sz_ptr,
    out_ptr,
    M,
    N,
    K,
    stride_xm,
    stride_wn,
    stride_om,
    GROUP_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    HALF_K: tl.constexpr,
):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    rows = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    half = tl.arange(0, HALF_K)
    row_valid = rows < M
    col_valid = cols < N
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, K, 2 * HALF_K):  # one packed chunk of 2 * HALF_K inputs per step
        packed = tl.load(
            w_ptr + cols[None, :].to(tl.int64) * stride_wn + (k0 // 2 + half)[:, None], mask=col_valid[None, :], other=0
        )  # [HALF_K, BLOCK_N] uint8
        group = k0 // GROUP_SIZE
        scale = tl.load(sz_ptr + (group * N + cols) * 2, mask=col_valid, other=0.0).to(tl.float32)
        zero = tl.load(sz_ptr + (group * N + cols) * 2 + 1, mask=col_valid, other=0.0).to(tl.float32)
        x_row = x_ptr + rows[:, None].to(tl.int64) * stride_xm
        x_low = tl.load(x_row + (k0 + half)[None, :], mask=row_valid[:, None], other=0.0)
        x_high = tl.load(x_row + (k0 + HALF_K + half)[None, :], mask=row_valid[:, None], other=0.0)
        w_low = ((packed & 0xF).to(tl.float32) - 8.0) * scale[None, :] + zero[None, :]
        w_high = ((packed >> 4).to(tl.float32) - 8.0) * scale[None, :] + zero[None, :]
        acc += tl.dot(x_low, w_low.to(x_low.dtype))
        acc += tl.dot(x_high, w_high.to(x_high.dtype))
    tl.store(
        out_ptr + rows[:, None].to(tl.int64) * stride_om + cols[None, :],
        acc.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & col_valid[None, :],
    )


def _block_m(rows: int) -> int:
    # tl.dot needs 16 rows at least; decode batches are a few rows, prefill chunks many.
    return 16 if rows <= 16 else 32 if rows <= 32 else 64


def int8_matmul(x: torch.Tensor, qweight: torch.Tensor, scales: torch.Tensor, in_features: int) -> torch.Tensor:
    """x [M, K] (16-bit) @ dequantized int8 weight^T -> [M, N] in x's dtype."""
    num_rows, num_out = x.shape[0], qweight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(num_rows, num_out, dtype=x.dtype, device=x.device)
    block_m, block_n = _block_m(num_rows), 64
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(num_out, block_n))
    _int8_matmul_kernel[grid](
        x,
        qweight,
        scales,
        out,
        num_rows,
        num_out,
        in_features,
        x.stride(0),
        qweight.stride(0),
        out.stride(0),
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_K=64,
        num_warps=4,
        num_stages=3,
    )
    return out


def int4_matmul(
    x: torch.Tensor, qweight: torch.Tensor, scales_and_zeros: torch.Tensor, group_size: int
) -> torch.Tensor:
    """x [M, K] (16-bit) @ dequantized int4 weight^T -> [M, N]; qweight from `pack_int4`."""
    num_rows, in_features = x.shape
    num_out = qweight.shape[0]
    x = x if x.stride(-1) == 1 else x.contiguous()
    out = torch.empty(num_rows, num_out, dtype=x.dtype, device=x.device)
    block_m, block_n = _block_m(num_rows), 64
    grid = (triton.cdiv(num_rows, block_m), triton.cdiv(num_out, block_n))
    _int4_matmul_kernel[grid](
        x,
        qweight,
        scales_and_zeros,
        out,
        num_rows,
        num_out,
        in_features,
        x.stride(0),
        qweight.stride(0),
        out.stride(0),
        GROUP_SIZE=group_size,
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        HALF_K=HALF_K,
        num_warps=4,
        num_stages=3,
    )
    return out


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """int4 codes [N, K] in 0..15 (K a multiple of PACK_K) -> uint8 [N, K / 2] in the kernel's
    chunk layout: per chunk of 32 inputs, byte j = code j | code (j + 16) << 4."""
    num_out, in_features = codes.shape
    if in_features % PACK_K:
        raise ValueError(f"int4 packing needs an input dimension divisible by {PACK_K}, got {in_features}")
    chunks = codes.to(torch.uint8).reshape(num_out, in_features // PACK_K, 2, HALF_K)
    return (chunks[:, :, 0] | (chunks[:, :, 1] << 4)).reshape(num_out, in_features // 2).contiguous()
