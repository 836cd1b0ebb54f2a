"""Reference attention over the paged KV cache in plain PyTorch (the CPU path).

Requests with one new token (decodes) are attended together in one padded SDPA call; requests
with several (prefill chunks, with or without a cached prefix) one at a time. Gather indices
and masks are built once per step and shared by every layer, since gathering is what costs
here (see MEASURED.md: only the slots in use are gathered).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagoda.model.attention.backend import AttentionBackend, AttentionLayerSpec, BatchLayout


@dataclass
class DecodeGroup:
    token_index: torch.Tensor  # [B] rows of the flattened batch
    slots: torch.Tensor  # [B, L] cache slots of each request's context, padded
    masks: dict[int | None, torch.Tensor]  # window -> [B, 1, 1, L] bool


@dataclass
class PrefillRequest:
    start: int
    end: int
    slots: torch.Tensor  # [context + new] cache slots
    masks: dict[int | None, torch.Tensor | None]  # window -> [q, L] bool; None: plain causal


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    decode: DecodeGroup | None
    prefills: list[PrefillRequest] = field(default_factory=list)


def context_slots(block_tables: torch.Tensor, rows: torch.Tensor | int, length: int,
                  block_size: int) -> torch.Tensor:
    """Cache slots of positions [0, length) for the given block-table rows."""
    positions = torch.arange(length, device=block_tables.device)
    blocks = block_tables[rows][..., positions // block_size].long()
    return blocks * block_size + positions % block_size


def visibility_mask(query_positions: torch.Tensor, key_positions: torch.Tensor,
                    window: int | None) -> torch.Tensor:
    """Causal (and sliding-window) visibility: query at p sees key at j if j <= p and,
    with a window w, j > p - w (the convention transformers uses)."""
    q = query_positions.unsqueeze(-1)
    k = key_positions.unsqueeze(-2)
    visible = k <= q
    if window is not None:
        visible &= k > q - window
    return visible


class TorchAttentionBackend(AttentionBackend):
    name = "torch"

    def prepare(self, layout: BatchLayout, sliding_windows: set[int | None]) -> TorchAttentionMetadata:
        device = layout.slot_mapping.device
        query_lens = layout.query_lens_host
        context_lens = layout.context_lens_host
        starts = layout.query_start_loc.tolist()

        decode_rows = [i for i, n in enumerate(query_lens) if n == 1]
        decode = None
        if decode_rows:
            rows = torch.tensor(decode_rows, device=device)
            seq_lens = layout.seq_lens[rows]
            length = int(max(context_lens[i] + 1 for i in decode_rows))
            key_positions = torch.arange(length, device=device)
            query_positions = (seq_lens - 1).unsqueeze(-1)
            masks = {}
            for window in sliding_windows:
                visible = visibility_mask(query_positions, key_positions, window)  # [B, 1, L]
                masks[window] = visible.unsqueeze(1)
            decode = DecodeGroup(
                token_index=layout.query_start_loc[rows],
                slots=context_slots(layout.block_tables, rows, length, layout.block_size),
                masks=masks,
            )

        prefills = []
        for i, n in enumerate(query_lens):
            if n <= 1:
                continue
            total = context_lens[i] + n
            query_positions = torch.arange(context_lens[i], total, device=device)
            key_positions = torch.arange(total, device=device)
            masks: dict[int | None, torch.Tensor | None] = {}
            for window in sliding_windows:
                if window is None and context_lens[i] == 0:
                    masks[window] = None
                else:
                    masks[window] = visibility_mask(query_positions, key_positions, window)
            prefills.append(PrefillRequest(
                start=starts[i], end=starts[i] + n,
                slots=context_slots(layout.block_tables, i, total, layout.block_size),
                masks=masks,
            ))
        return TorchAttentionMetadata(layout.slot_mapping, decode, prefills)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                key_cache: torch.Tensor, value_cache: torch.Tensor, metadata: object,
                spec: AttentionLayerSpec) -> torch.Tensor:
        assert isinstance(metadata, TorchAttentionMetadata)
        num_kv_heads, head_dim = spec.num_kv_heads, spec.head_dim
        flat_keys = key_cache.view(-1, num_kv_heads, head_dim)
        flat_values = value_cache.view(-1, num_kv_heads, head_dim)
        flat_keys.index_copy_(0, metadata.slot_mapping, key)
        flat_values.index_copy_(0, metadata.slot_mapping, value)

        gqa = spec.num_heads != num_kv_heads
        output = torch.empty_like(query)
        decode = metadata.decode
        if decode is not None:
            q = query[decode.token_index].unsqueeze(2)  # [B, H, 1, D]
            k = flat_keys[decode.slots].transpose(1, 2)  # [B, KVH, L, D]
            v = flat_values[decode.slots].transpose(1, 2)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=decode.masks[spec.sliding_window],
                                                 scale=spec.scale, enable_gqa=gqa)
            output[decode.token_index] = out.squeeze(2)
        for prefill in metadata.prefills:
            q = query[prefill.start:prefill.end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
            k = flat_keys[prefill.slots].transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
            v = flat_values[prefill.slots].transpose(0, 1).unsqueeze(0)
            mask = prefill.masks[spec.sliding_window]
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=mask is None,
                                                 scale=spec.scale, enable_gqa=gqa)
            output[prefill.start:prefill.end] = out.squeeze(0).transpose(0, 1)
        return output
