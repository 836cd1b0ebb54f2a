"""Triton kernels for attention over the paged KV cache, and the launchers that size them.

Cache layout: [num_blocks, block_size, num_kv_heads, head_dim]; request r's token at position p
lives in block `block_tables[r, p // block_size]`, row `p % block_size`. Kernels look the
physical block up per key token, so a key tile may span several cache blocks and the tile
size is independent of the cache's block size.

Three kernels plus a reduction:
- `_write_kv_kernel`: one program per new token, copies its K/V rows to its slot; slot -1 is
  skipped (padded rows of a CUDA-graph batch).
- `_prefill_attention_kernel`: flash-attention over any mix of requests (prefill, chunked
  prefill over a cached prefix, decodes). One program owns BLOCK_Q query tokens of one request
  and all query heads of one KV head (the GQA group), so each K/V tile is loaded once for the
  whole group. Programs find their request by binary search over query_start_loc, which keeps
  the launch free of host-side index tensors.
- `_decode_attention_kernel` (+ `_reduce_splits_kernel`): one query token per request;
  the context is cut into `num_splits` partitions (flash-decoding) so that a few long
  sequences still fill the GPU, and a second kernel merges the partial softmaxes.

Softmax runs in base 2 (`exp2`, with log2(e) folded into the scale) and accumulates in fp32.
Two constexpr-guarded options: SOFTCAP > 0 caps the scores (cap * tanh(score / cap), Gemma 2)
before masking, and HAS_SINKS adds a per-query-head logit to each softmax's denominator only
(attention sinks, gpt-oss), merged when the output is normalized.

Quantized caches (--kv-cache-dtype, the KV_QUANT constexpr; layouts in pagoda.quant.kv_cache_dtype)
are uint8: the write kernel quantizes each new [head_dim] vector (kv_codec), and the
attention tiles decode keys and values to the query's dtype right after loading them. A key's
scale multiplies its column of scores after the dot (one multiply per score, not per element);
a value's scale multiplies its row of the value tile before the dot.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from pagoda.kernels.triton.kv_codec import MODEL_DTYPE, PER_TOKEN_SCALE, KVCacheEncoding, decode_bytes, encode_vectors

LOG2E = 1.4426950408889634

# Key tile of the attention kernels (tokens); also what a decode split is rounded to.
BLOCK_N = 64
# Rows (query tokens x heads of one KV group) of a prefill program; tl.dot needs >= 16.
PREFILL_BLOCK_M = 64
MIN_BLOCK_M = 16


# ---- kernels --------------------------------------------------------------------------------


@triton.jit
def _write_kv_kernel(
    key_ptr,
    value_ptr,
    key_cache_ptr,
    value_cache_ptr,
    slot_mapping_ptr,
    stride_key_token,
    stride_key_head,
    stride_value_token,
    stride_value_head,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    key_scale,
    value_scale,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEADS_PAD: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    KV_QUANT: tl.constexpr,
    KV_TYPE: tl.constexpr,
    LARGEST: tl.constexpr,
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block = slot // BLOCK_SIZE
    row = slot % BLOCK_SIZE
    heads = tl.arange(0, HEADS_PAD)
    dims = tl.arange(0, HEAD_DIM_PAD)
    mask = (heads[:, None] < NUM_KV_HEADS) & (dims[None, :] < HEAD_DIM)

    key = tl.load(key_ptr + token * stride_key_token + heads[:, None] * stride_key_head + dims[None, :], mask=mask)
    key_dst = key_cache_ptr + block * stride_kc_block + row * stride_kc_slot + heads * stride_kc_head
    _store_vectors(key_dst, key, key_scale, heads < NUM_KV_HEADS, dims, mask, HEAD_DIM, KV_QUANT, KV_TYPE, LARGEST)

    value = tl.load(
        value_ptr + token * stride_value_token + heads[:, None] * stride_value_head + dims[None, :], mask=mask
    )
    value_dst = value_cache_ptr + block * stride_vc_block + row * stride_vc_slot + heads * stride_vc_head
    _store_vectors(
        value_dst, value, value_scale, heads < NUM_KV_HEADS, dims, mask, HEAD_DIM, KV_QUANT, KV_TYPE, LARGEST
    )


@triton.jit
def _store_vectors(
    dst,
    x,
    tensor_scale,
    head_valid,
    dims,
    mask,
    HEAD_DIM: tl.constexpr,
    KV_QUANT: tl.constexpr,
    KV_TYPE: tl.constexpr,
    LARGEST: tl.constexpr,
):
    """x [heads, dims] -> the cache entries starting at dst [heads], encoded as KV_QUANT says.
    Divisions are IEEE-rounded (div_rn) to write what KVCacheFormat.encode writes."""
    if KV_QUANT == 0:
        tl.store(dst[:, None] + dims[None, :], x, mask=mask)
    else:
        x = x.to(tl.float32)
        if KV_QUANT == 1:
            amax = tl.max(tl.where(mask, tl.abs(x), 0.0), 1)
            scale = tl.math.div_rn(tl.maximum(amax, 1e-12), tl.full(amax.shape, LARGEST, tl.float32))
            scaled = tl.math.div_rn(x, scale[:, None] + tl.zeros_like(x))
            tl.store((dst + HEAD_DIM).to(tl.pointer_type(tl.float32)), scale, mask=head_valid)
        else:
            scaled = tl.math.div_rn(x, tl.full(x.shape, tensor_scale, tl.float32))
        tl.store(dst[:, None] + dims[None, :], encode_vectors(scaled, KV_TYPE, LARGEST), mask=mask)


@triton.jit
def _attend_tile(
    q,
    m_i,
    l_i,
    acc,
    key_start,
    kv_end,
    query_pos,
    key_cache_ptr,
    value_cache_ptr,
    block_table_ptr,
    kv_head,
    dims,
    dim_valid,
    qk_scale,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    key_scale,
    value_scale,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    KV_QUANT: tl.constexpr,
    KV_TYPE: tl.constexpr,
    SOFTCAP: tl.constexpr,
):
    """One online-softmax step over keys [key_start, key_start + BLOCK_N) (masked to < kv_end
    and to each row's causal / sliding-window range). Scores are in base-2 units."""
    keys = key_start + tl.arange(0, BLOCK_N)
    key_valid = keys < kv_end
    blocks = tl.load(block_table_ptr + keys // BLOCK_SIZE, mask=key_valid, other=0).to(tl.int64)
    rows = keys % BLOCK_SIZE
    k_offsets = blocks * stride_kc_block + rows * stride_kc_slot + kv_head * stride_kc_head
    if KV_QUANT == 0:
        k = tl.load(
            key_cache_ptr + k_offsets[None, :] + dims[:, None], mask=key_valid[None, :] & dim_valid[:, None], other=0.0
        )  # [D, N]
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale  # [M, N] fp32
    else:
        k = decode_bytes(
            tl.load(
                key_cache_ptr + k_offsets[None, :] + dims[:, None],
                mask=key_valid[None, :] & dim_valid[:, None],
                other=0,
            ),
            KV_TYPE,
        ).to(q.dtype)
        scores = tl.dot(q, k, input_precision=DOT_PRECISION) * qk_scale
        if KV_QUANT == 1:
            scores = (
                scores
                * tl.load(
                    (key_cache_ptr + k_offsets + HEAD_DIM).to(tl.pointer_type(tl.float32)), mask=key_valid, other=0.0
                )[None, :]
            )
        else:
            scores = scores * key_scale

    if SOFTCAP > 0:
        # cap * tanh(s / cap) with s and the cap both in base-2 units; tanh from exp2, which
        # saturates to +-1 where exp2 over- or underflows.
        cap = SOFTCAP * 1.4426950408889634
        scores = cap * (1.0 - 2.0 / (tl.exp2(scores * (2.0 * 1.4426950408889634 / cap)) + 1.0))
    visible = key_valid[None, :] & (keys[None, :] <= query_pos[:, None])
    if SLIDING_WINDOW > 0:
        visible = visible & (keys[None, :] > query_pos[:, None] - SLIDING_WINDOW)
    scores = tl.where(visible, scores, float("-inf"))

    m_new = tl.maximum(m_i, tl.max(scores, 1))
    # A row with nothing visible yet keeps m = -inf; subtract 0 instead to avoid inf - inf.
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    p = tl.exp2(scores - m_safe[:, None])
    alpha = tl.exp2(m_i - m_safe)
    l_i = l_i * alpha + tl.sum(p, 1)

    v_offsets = blocks * stride_vc_block + rows * stride_vc_slot + kv_head * stride_vc_head
    if KV_QUANT == 0:
        v = tl.load(
            value_cache_ptr + v_offsets[:, None] + dims[None, :],
            mask=key_valid[:, None] & dim_valid[None, :],
            other=0.0,
        )  # [N, D]
    else:
        v = decode_bytes(
            tl.load(
                value_cache_ptr + v_offsets[:, None] + dims[None, :],
                mask=key_valid[:, None] & dim_valid[None, :],
                other=0,
            ),
            KV_TYPE,
        ).to(tl.float32)
        if KV_QUANT == 1:
            v_scales = tl.load(
                (value_cache_ptr + v_offsets + HEAD_DIM).to(tl.pointer_type(tl.float32)), mask=key_valid, other=0.0
            )
            v = (v * v_scales[:, None]).to(q.dtype)
        else:
            v = (v * value_scale).to(q.dtype)
    acc = acc * alpha[:, None] + tl.dot(p.to(v.dtype), v, input_precision=DOT_PRECISION)
    return m_new, l_i, acc


@triton.jit
def _normalize(acc, m_i, l_i, sinks_ptr, head, row_valid, HAS_SINKS: tl.constexpr):
    """acc / the softmax denominator, which a head's sink (natural-log units) joins."""
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head, mask=row_valid, other=0.0).to(tl.float32) * 1.4426950408889634
        m_new = tl.maximum(m_i, sink)
        alpha = tl.exp2(m_i - m_new)  # m_i = -inf (nothing visible): 0
        l_i = l_i * alpha + tl.exp2(sink - m_new)
        acc = acc * alpha[:, None]
    l_safe = tl.where(l_i == 0.0, 1.0, l_i)
    return acc / l_safe[:, None]


@triton.jit
def _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q: tl.constexpr):
    """The request owning grid row `q_block`: request i's rows start at
    query_start_loc[i] // BLOCK_Q + i, which leaves room for ceil(len_i / BLOCK_Q) of them."""
    lo = 0
    hi = num_reqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_row = tl.load(query_start_loc_ptr + mid) // BLOCK_Q + mid
        if first_row <= q_block:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _prefill_attention_kernel(
    out_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    query_start_loc_ptr,
    seq_lens_ptr,
    sinks_ptr,
    qk_scale,
    num_reqs,
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    stride_bt,
    key_scale,
    value_scale,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_Q: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
    KV_TYPE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    q_block = tl.program_id(0)
    kv_head = tl.program_id(1)
    req = _find_request(query_start_loc_ptr, q_block, num_reqs, BLOCK_Q)
    q_start = tl.load(query_start_loc_ptr + req)
    query_len = tl.load(query_start_loc_ptr + req + 1) - q_start
    local_block = q_block - (q_start // BLOCK_Q + req)
    if local_block * BLOCK_Q >= query_len:
        return
    seq_len = tl.load(seq_lens_ptr + req)
    context_len = seq_len - query_len

    # Row r is query token r // QUERIES_PER_KV of this block, head r % QUERIES_PER_KV of the group.
    offs_m = tl.arange(0, BLOCK_M)
    q_index = local_block * BLOCK_Q + offs_m // QUERIES_PER_KV
    head = kv_head * QUERIES_PER_KV + offs_m % QUERIES_PER_KV
    row_valid = (offs_m < BLOCK_Q * QUERIES_PER_KV) & (q_index < query_len)
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    token = q_start + q_index
    q = tl.load(
        query_ptr + token[:, None] * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    query_pos = context_len + q_index

    # Keys this block can see: up to its last query (causal); from its first query's window.
    kv_end = context_len + tl.minimum((local_block + 1) * BLOCK_Q, query_len)
    kv_start = 0
    if SLIDING_WINDOW > 0:
        kv_start = tl.maximum(context_len + local_block * BLOCK_Q - SLIDING_WINDOW + 1, 0)
        kv_start = (kv_start // BLOCK_N) * BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    block_table = block_tables_ptr + req.to(tl.int64) * stride_bt
    for key_start in range(kv_start, kv_end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q,
            m_i,
            l_i,
            acc,
            key_start,
            kv_end,
            query_pos,
            key_cache_ptr,
            value_cache_ptr,
            block_table,
            kv_head,
            dims,
            dim_valid,
            qk_scale,
            stride_kc_block,
            stride_kc_slot,
            stride_kc_head,
            stride_vc_block,
            stride_vc_slot,
            stride_vc_head,
            key_scale,
            value_scale,
            BLOCK_SIZE,
            BLOCK_N,
            SLIDING_WINDOW,
            DOT_PRECISION,
            HEAD_DIM,
            KV_QUANT,
            KV_TYPE,
            SOFTCAP,
        )

    out = _normalize(acc, m_i, l_i, sinks_ptr, head, row_valid, HAS_SINKS)
    tl.store(
        out_ptr + token[:, None] * stride_o_token + head[:, None] * stride_o_head + dims[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=row_valid[:, None] & dim_valid[None, :],
    )


@triton.jit
def _decode_attention_kernel(
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    query_ptr,
    key_cache_ptr,
    value_cache_ptr,
    block_tables_ptr,
    seq_lens_ptr,
    sinks_ptr,
    qk_scale,
    min_partition,
    stride_q_token,
    stride_q_head,
    stride_o_token,
    stride_o_head,
    stride_kc_block,
    stride_kc_slot,
    stride_kc_head,
    stride_vc_block,
    stride_vc_slot,
    stride_vc_head,
    stride_bt,
    key_scale,
    value_scale,
    NUM_HEADS: tl.constexpr,
    QUERIES_PER_KV: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    SLIDING_WINDOW: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    DOT_PRECISION: tl.constexpr,
    KV_QUANT: tl.constexpr,
    KV_TYPE: tl.constexpr,
    SOFTCAP: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    req = tl.program_id(0)
    kv_head = tl.program_id(1)
    split = tl.program_id(2)
    seq_len = tl.load(seq_lens_ptr + req)

    offs_m = tl.arange(0, BLOCK_M)
    head = kv_head * QUERIES_PER_KV + offs_m
    row_valid = offs_m < QUERIES_PER_KV
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    q = tl.load(
        query_ptr + req * stride_q_token + head[:, None] * stride_q_head + dims[None, :],
        mask=row_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    query_pos = tl.zeros([BLOCK_M], dtype=tl.int64) + seq_len - 1

    # The visible range [lo, seq_len) is cut into partitions of a whole number of tiles computed
    # here from the device-side length, so the split count can stay fixed (CUDA graphs) while
    # lengths change; partitions past the end are empty and contribute nothing.
    lo = 0
    if SLIDING_WINDOW > 0:
        lo = tl.maximum(seq_len - SLIDING_WINDOW, 0)
        lo = (lo // BLOCK_N) * BLOCK_N
    per_split = tl.cdiv(tl.cdiv(seq_len - lo, NUM_SPLITS), BLOCK_N) * BLOCK_N
    per_split = tl.maximum(per_split, min_partition)
    start = lo + split * per_split
    end = tl.minimum(start + per_split, seq_len)

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, HEAD_DIM_PAD], dtype=tl.float32)
    block_table = block_tables_ptr + req.to(tl.int64) * stride_bt
    for key_start in range(start, end, BLOCK_N):
        m_i, l_i, acc = _attend_tile(
            q,
            m_i,
            l_i,
            acc,
            key_start,
            end,
            query_pos,
            key_cache_ptr,
            value_cache_ptr,
            block_table,
            kv_head,
            dims,
            dim_valid,
            qk_scale,
            stride_kc_block,
            stride_kc_slot,
            stride_kc_head,
            stride_vc_block,
            stride_vc_slot,
            stride_vc_head,
            key_scale,
            value_scale,
            BLOCK_SIZE,
            BLOCK_N,
            SLIDING_WINDOW,
            DOT_PRECISION,
            HEAD_DIM,
            KV_QUANT,
            KV_TYPE,
            SOFTCAP,
        )

    if NUM_SPLITS == 1:
        out = _normalize(acc, m_i, l_i, sinks_ptr, head, row_valid, HAS_SINKS)
        tl.store(
            out_ptr + req * stride_o_token + head[:, None] * stride_o_head + dims[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=row_valid[:, None] & dim_valid[None, :],
        )
    else:
        # Partials are laid out [req, head, split] (+ [head_dim] for the accumulator).
        part = (req * NUM_HEADS + head) * NUM_SPLITS + split
        tl.store(partial_max_ptr + part, m_i, mask=row_valid)
        tl.store(partial_sum_ptr + part, l_i, mask=row_valid)
        tl.store(
            partial_out_ptr + part[:, None] * HEAD_DIM + dims[None, :],
            acc,
            mask=row_valid[:, None] & dim_valid[None, :],
        )


@triton.jit
def _reduce_splits_kernel(
    out_ptr,
    partial_out_ptr,
    partial_max_ptr,
    partial_sum_ptr,
    sinks_ptr,
    stride_o_token,
    stride_o_head,
    NUM_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    HEAD_DIM_PAD: tl.constexpr,
    NUM_SPLITS: tl.constexpr,
    SPLITS_PAD: tl.constexpr,
    HAS_SINKS: tl.constexpr,
):
    req = tl.program_id(0)
    head = tl.program_id(1)
    splits = tl.arange(0, SPLITS_PAD)
    split_valid = splits < NUM_SPLITS
    dims = tl.arange(0, HEAD_DIM_PAD)
    dim_valid = dims < HEAD_DIM
    part = (req * NUM_HEADS + head) * NUM_SPLITS + splits

    m = tl.load(partial_max_ptr + part, mask=split_valid, other=float("-inf"))
    s = tl.load(partial_sum_ptr + part, mask=split_valid, other=0.0)
    m_max = tl.max(m, 0)
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + head).to(tl.float32) * 1.4426950408889634
        m_max = tl.maximum(m_max, sink)
    m_safe = tl.where(m_max == float("-inf"), 0.0, m_max)
    weight = tl.exp2(m - m_safe)  # empty partitions: exp2(-inf) = 0
    total = tl.sum(weight * s, 0)
    if HAS_SINKS:
        total += tl.exp2(sink - m_safe)
    acc = tl.load(
        partial_out_ptr + part[:, None] * HEAD_DIM + dims[None, :],
        mask=split_valid[:, None] & dim_valid[None, :],
        other=0.0,
    )
    out = tl.sum(weight[:, None] * acc, 0) / tl.where(total == 0.0, 1.0, total)
    tl.store(
        out_ptr + req * stride_o_token + head * stride_o_head + dims, out.to(out_ptr.dtype.element_ty), mask=dim_valid
    )


# ---- launchers ------------------------------------------------------------------------------


def _check_cache(key_cache: torch.Tensor, value_cache: torch.Tensor, head_dim: int, kv: KVCacheEncoding) -> None:
    if key_cache.stride(-1) != 1 or value_cache.stride(-1) != 1:
        raise ValueError("KV cache rows must be contiguous in head_dim")
    if kv.mode == PER_TOKEN_SCALE and head_dim % 4:
        # Each entry's float32 scale sits head_dim bytes in: it must be 4-byte aligned.
        raise ValueError(f"quantized KV cache with per-token scales needs head_dim divisible by 4, got {head_dim}")
    if kv.mode != MODEL_DTYPE and key_cache.dtype != torch.uint8:
        raise ValueError(f"a quantized KV cache is uint8, got {key_cache.dtype}")


def _rows_contiguous(x: torch.Tensor) -> torch.Tensor:
    return x if x.stride(-1) == 1 else x.contiguous()


def write_kv_cache(
    key: torch.Tensor,
    value: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    kv: KVCacheEncoding = KVCacheEncoding(),
) -> None:
    """key/value [T, KVH, D] -> the caches at `slot_mapping` [T] (entries < 0 are skipped),
    encoded as `kv` says."""
    num_tokens, num_kv_heads, head_dim = key.shape
    if num_tokens == 0:
        return
    _check_cache(key_cache, value_cache, head_dim, kv)
    key, value = _rows_contiguous(key), _rows_contiguous(value)
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        key_cache,
        value_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        kv.key_scale,
        kv.value_scale,
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        HEADS_PAD=triton.next_power_of_2(num_kv_heads),
        HEAD_DIM_PAD=triton.next_power_of_2(head_dim),
        BLOCK_SIZE=key_cache.shape[1],
        KV_QUANT=kv.mode,
        KV_TYPE=kv.element,
        LARGEST=kv.largest,
    )


def _dot_precision(dtype: torch.dtype) -> str | None:
    # fp32 models get fp32 dots (torch's own matmul default); tf32 would cost ~3 decimal digits.
    # None: the target's default, which is what 16-bit operands use anyway.
    return "ieee" if dtype == torch.float32 else None


def _num_stages(dtype: torch.dtype) -> int:
    # fp32 K/V tiles are twice as large: three pipeline stages need ~115 KB of shared memory
    # for head_dim 128 (sm_80), more than consumer GPUs have.
    return 1 if dtype == torch.float32 else 3


def _sinks_arg(sinks: torch.Tensor | None, placeholder: torch.Tensor) -> torch.Tensor:
    """The sinks as the kernels read them (float32, contiguous), or any tensor where HAS_SINKS is off."""
    return placeholder if sinks is None else sinks.to(torch.float32).contiguous()


def _head_dim_pad(head_dim: int) -> int:
    return max(triton.next_power_of_2(head_dim), 16)


def prefill_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    query_start_loc: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    max_query_len: int,
    kv: KVCacheEncoding = KVCacheEncoding(),
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """Causal attention of every query token over its request's cached context (which already
    holds this step's K/V). query/out [T, H, D]; requests delimited by query_start_loc.
    softcap: scores (after `scale`) become softcap * tanh(score / softcap); sinks [H]: a logit
    per query head that joins each softmax's denominator."""
    num_tokens, num_heads, head_dim = query.shape
    num_reqs = seq_lens.shape[0]
    num_kv_heads = key_cache.shape[2]
    queries_per_kv = num_heads // num_kv_heads
    # Short queries (decodes, spec-decode verification) waste most rows of a 64-row block.
    target_m = PREFILL_BLOCK_M if max_query_len * queries_per_kv > MIN_BLOCK_M else MIN_BLOCK_M
    block_m = max(target_m, triton.next_power_of_2(queries_per_kv))
    block_q = block_m // queries_per_kv
    grid = (num_tokens // block_q + num_reqs, num_kv_heads)
    _check_cache(key_cache, value_cache, head_dim, kv)
    query = _rows_contiguous(query)
    _prefill_attention_kernel[grid](
        out,
        query,
        key_cache,
        value_cache,
        block_tables,
        query_start_loc,
        seq_lens,
        _sinks_arg(sinks, out),
        scale * LOG2E,
        num_reqs,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        kv.key_scale,
        kv.value_scale,
        QUERIES_PER_KV=queries_per_kv,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=_head_dim_pad(head_dim),
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_Q=block_q,
        BLOCK_N=BLOCK_N,
        SLIDING_WINDOW=sliding_window or 0,
        DOT_PRECISION=_dot_precision(query.dtype),
        KV_QUANT=kv.mode,
        KV_TYPE=kv.element,
        SOFTCAP=float(softcap or 0.0),
        HAS_SINKS=sinks is not None,
        num_warps=8 if head_dim > 128 else 4,
        num_stages=_num_stages(query.dtype),
    )


def decode_attention(
    out: torch.Tensor,
    query: torch.Tensor,
    key_cache: torch.Tensor,
    value_cache: torch.Tensor,
    block_tables: torch.Tensor,
    seq_lens: torch.Tensor,
    scale: float,
    sliding_window: int | None,
    num_splits: int,
    min_partition: int,
    kv: KVCacheEncoding = KVCacheEncoding(),
    *,
    softcap: float | None = None,
    sinks: torch.Tensor | None = None,
) -> None:
    """One query token per request (token i belongs to request i). query/out [R, H, D].
    With num_splits > 1 each request's context is split across that many programs per KV head
    and merged by a second kernel; partitions are at least `min_partition` tokens long.
    softcap and sinks as for prefill_attention."""
    num_reqs, num_heads, head_dim = query.shape
    num_kv_heads = key_cache.shape[2]
    queries_per_kv = num_heads // num_kv_heads
    _check_cache(key_cache, value_cache, head_dim, kv)
    query = _rows_contiguous(query)
    if num_splits > 1:
        partial_out = torch.empty((num_reqs, num_heads, num_splits, head_dim), dtype=torch.float32, device=query.device)
        partial_max = torch.empty((num_reqs, num_heads, num_splits), dtype=torch.float32, device=query.device)
        partial_sum = torch.empty_like(partial_max)
    else:
        partial_out = partial_max = partial_sum = out  # unused
    head_dim_pad = _head_dim_pad(head_dim)
    _decode_attention_kernel[(num_reqs, num_kv_heads, num_splits)](
        out,
        partial_out,
        partial_max,
        partial_sum,
        query,
        key_cache,
        value_cache,
        block_tables,
        seq_lens,
        _sinks_arg(sinks, out),
        scale * LOG2E,
        min_partition,
        query.stride(0),
        query.stride(1),
        out.stride(0),
        out.stride(1),
        key_cache.stride(0),
        key_cache.stride(1),
        key_cache.stride(2),
        value_cache.stride(0),
        value_cache.stride(1),
        value_cache.stride(2),
        block_tables.stride(0),
        kv.key_scale,
        kv.value_scale,
        NUM_HEADS=num_heads,
        QUERIES_PER_KV=queries_per_kv,
        HEAD_DIM=head_dim,
        HEAD_DIM_PAD=head_dim_pad,
        BLOCK_SIZE=key_cache.shape[1],
        BLOCK_M=max(MIN_BLOCK_M, triton.next_power_of_2(queries_per_kv)),
        BLOCK_N=BLOCK_N,
        SLIDING_WINDOW=sliding_window or 0,
        NUM_SPLITS=num_splits,
        DOT_PRECISION=_dot_precision(query.dtype),
        KV_QUANT=kv.mode,
        KV_TYPE=kv.element,
        SOFTCAP=float(softcap or 0.0),
        HAS_SINKS=sinks is not None,
        num_warps=4,
        num_stages=_num_stages(query.dtype),
    )
    if num_splits > 1:
        _reduce_splits_kernel[(num_reqs, num_heads)](
            out,
            partial_out,
            partial_max,
            partial_sum,
            _sinks_arg(sinks, out),
            out.stride(0),
            out.stride(1),
            NUM_HEADS=num_heads,
            HEAD_DIM=head_dim,
            HEAD_DIM_PAD=head_dim_pad,
            NUM_SPLITS=num_splits,
            SPLITS_PAD=triton.next_power_of_2(num_splits),
            HAS_SINKS=sinks is not None,
            num_warps=4,
        )
