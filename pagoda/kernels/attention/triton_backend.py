"""Attention over the paged KV cache with Triton kernels (the GPU path).

`prepare` only does host arithmetic on the layout's host copies of the lengths: no device
tensors are built and nothing waits on the GPU, and the metadata points at the layout's own
tensors. That also makes it usable for CUDA graphs: a graph captured with metadata prepared
over static buffers replays correctly after the buffers are refilled (see
`pagoda/worker/cuda_graphs.py`).

Per layer, the kernels take the sliding window, attention-score soft-capping (Gemma 2) and
attention sinks (gpt-oss) from the layer's spec, as constexpr-guarded options.

Per step, one of three paths:
- decode-only batches: the split-KV decode kernel (flash-decoding) + its reduction;
- one request prefilling from position 0 in 16-bit dtypes: torch's SDPA (FlashAttention-2)
  on the new keys/values directly, for layers without a sliding window, soft-cap or sinks (not with a quantized
  KV cache: attention must read the stored, quantized values, as later steps and prefix-cache
  hits do, so that results do not depend on how a prompt was scheduled);
- everything else (chunked prefill over a cached prefix, mixed prefill + decode batches,
  sliding windows, speculative verification): the paged flash-attention kernel.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from pagoda.kernels.attention.backend import AttentionBackend, AttentionLayerSpec, BatchLayout
from pagoda.kernels.triton.kv_codec import MODEL_DTYPE, KVCacheEncoding
from pagoda.kernels.triton.paged_attention import BLOCK_N, decode_attention, prefill_attention, write_kv_cache
from pagoda.quant.kv_cache_dtype import KVCacheFormat


@dataclass
class TritonAttentionMetadata:
    slot_mapping: torch.Tensor
    query_start_loc: torch.Tensor
    seq_lens: torch.Tensor
    block_tables: torch.Tensor
    num_reqs: int
    max_query_len: int
    max_seq_len: int  # the longest context the kernels may meet (sizes the decode split)
    decode_only: bool
    sdpa_prefill: bool  # one request, no cached prefix: SDPA can attend over the new K/V alone


class TritonAttentionBackend(AttentionBackend):
    """`decode_splits` fixes the split count of the decode kernel (None: sized from the batch and
    the GPU). `min_partition` is the shortest context slice worth its own program.
    `sdpa_min_tokens` is the prompt length from which a lone prefill goes to SDPA (None: never).
    `kv_format`: how the caches store K/V (None or auto: the model dtype)."""

    name = "triton"
    supports_cuda_graphs = True  # metadata holds the layout's tensors and batch-size-only host values

    def __init__(
        self,
        decode_splits: int | None = None,
        max_decode_splits: int = 16,
        min_partition: int = 256,
        sdpa_min_tokens: int | None = 512,
        kv_format: KVCacheFormat | None = None,
    ) -> None:
        if decode_splits is not None and decode_splits < 1:
            raise ValueError(f"decode_splits must be >= 1, got {decode_splits}")
        if min_partition < 1:
            raise ValueError(f"min_partition must be >= 1, got {min_partition}")
        self.decode_splits = decode_splits
        self.max_decode_splits = max_decode_splits
        self.min_partition = min_partition
        self.kv = KVCacheEncoding.of(kv_format)
        self.sdpa_min_tokens = sdpa_min_tokens if self.kv.mode == MODEL_DTYPE else None
        self._num_sms: dict[torch.device, int] = {}

    def prepare(self, layout: BatchLayout, sliding_windows: set[int | None]) -> TritonAttentionMetadata:
        query_lens = layout.query_lens_host
        context_lens = layout.context_lens_host
        max_query_len = max(query_lens)
        sdpa_prefill = (
            self.sdpa_min_tokens is not None
            and layout.num_reqs == 1
            and context_lens[0] == 0
            and query_lens[0] >= self.sdpa_min_tokens
        )
        return TritonAttentionMetadata(
            slot_mapping=layout.slot_mapping,
            query_start_loc=layout.query_start_loc,
            seq_lens=layout.seq_lens,
            block_tables=layout.block_tables,
            num_reqs=layout.num_reqs,
            max_query_len=max_query_len,
            max_seq_len=max(c + q for c, q in zip(context_lens, query_lens)),
            decode_only=max_query_len == 1,
            sdpa_prefill=sdpa_prefill,
        )

    def forward(
        self,
        query: torch.Tensor,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        metadata: object,
        spec: AttentionLayerSpec,
    ) -> torch.Tensor:
        assert isinstance(metadata, TritonAttentionMetadata)
        write_kv_cache(key, value, key_cache, value_cache, metadata.slot_mapping, self.kv)
        if (
            metadata.sdpa_prefill
            and spec.sliding_window is None
            and spec.logit_softcap is None
            and spec.sinks is None
            and query.dtype != torch.float32
        ):
            return self._sdpa_prefill(query, key, value, spec)
        output = torch.empty_like(query)
        if metadata.decode_only:
            decode_attention(
                output,
                query,
                key_cache,
                value_cache,
                metadata.block_tables,
                metadata.seq_lens,
                spec.scale,
                spec.sliding_window,
                self._num_splits(metadata, spec, query.device),
                self.min_partition,
                self.kv,
                softcap=spec.logit_softcap,
                sinks=spec.sinks,
            )
        else:
            prefill_attention(
                output,
                query,
                key_cache,
                value_cache,
                metadata.block_tables,
                metadata.query_start_loc,
                metadata.seq_lens,
                spec.scale,
                spec.sliding_window,
                metadata.max_query_len,
                self.kv,
                softcap=spec.logit_softcap,
                sinks=spec.sinks,
            )
        return output

    @staticmethod
    def _sdpa_prefill(
        query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, spec: AttentionLayerSpec
    ) -> torch.Tensor:
        # A whole prompt with nothing cached needs no paging: the new K/V are the full context,
        # and FlashAttention-2 behind SDPA (causal, GQA, 16-bit only) is a kernel tuned for
        # exactly that, with a split of the diagonal tiles ours lacks. fp32 would fall back to
        # SDPA's math path, hence the dtype check. sdpa_min_tokens=None turns this off to compare.
        q = query.transpose(0, 1).unsqueeze(0)  # [1, H, T, D]
        k = key.transpose(0, 1).unsqueeze(0)
        v = value.transpose(0, 1).unsqueeze(0)
        out = F.scaled_dot_product_attention(
            q, k, v, is_causal=True, scale=spec.scale, enable_gqa=spec.num_heads != spec.num_kv_heads
        )
        return out.squeeze(0).transpose(0, 1).contiguous()

    def _num_splits(self, metadata: TritonAttentionMetadata, spec: AttentionLayerSpec, device: torch.device) -> int:
        """Enough programs to fill the GPU about twice, never a partition shorter than
        min_partition tokens of the longest context; a power of two, since each count is a
        separately compiled kernel."""
        if self.decode_splits is not None:
            return self.decode_splits
        context = metadata.max_seq_len
        if spec.sliding_window is not None:
            context = min(context, spec.sliding_window + BLOCK_N)
        useful = -(-context // self.min_partition)
        programs = metadata.num_reqs * spec.num_kv_heads
        wanted = -(-2 * self._sm_count(device) // programs)
        splits = max(1, min(wanted, useful, self.max_decode_splits))
        return 1 << (splits.bit_length() - 1)

    def _sm_count(self, device: torch.device) -> int:
        if device.type != "cuda":
            return 1
        if device not in self._num_sms:
            self._num_sms[device] = torch.cuda.get_device_properties(device).multi_processor_count
        return self._num_sms[device]
