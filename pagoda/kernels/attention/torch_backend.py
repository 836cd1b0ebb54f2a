"""Reference attention over the paged KV cache in plain PyTorch (the CPU path).

Requests with one new token (decodes) are sorted by context length and attended in padded
SDPA calls of up to DECODE_GROUP_SIZE requests, a longer context starting a new group where it
would pad the group by more than DECODE_GROUP_MAX_PADDING, so short contexts are not padded to
the longest one in the batch; requests with several (prefill chunks, with or without a cached prefix) one at a time.
Each request's
context is gathered whole blocks at a time (`index_select` on the block dimension copies
block-sized rows, cheaper on CPU than gathering token by token), and the gather
indices and masks are built once per step and shared by every layer.

With pagoda's native kernels (pagoda.native), requests of up to NATIVE_MAX_QUERY_TOKENS new
tokens (decodes, speculative verification, short first chunks) are attended instead by the
native paged attention, which reads K/V in place through the block tables (no gather, no
padding, quantized entries widened in registers), all of them in one call per layer; longer
prefill chunks keep the SDPA path.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from pagoda.kernels.attention.backend import AttentionBackend, AttentionLayerSpec, BatchLayout
from pagoda.kernels.attention.latent import (
    LatentProjection,
    absorbed_attention,
    expanded_attention,
    expanded_decode,
)
from pagoda.native import NativeKernels
from pagoda.quant.kv_cache_dtype import KVCacheFormat

DECODE_GROUP_SIZE = 16
# A decode group is padded to its longest context: a row that would add more than this many
# padded (row, token) pairs to its group starts a new one (one long context among short ones,
# e.g. a 1500-token request decoding beside chat streams, would otherwise make every short
# row attend over 1500 padded positions; another SDPA call costs less).
DECODE_GROUP_MAX_PADDING = 2048

# Torch's CPU flash-attention kernel is several times slower in bfloat16 than in float32 for a
# decode's single query row, enough to cancel what the bf16 projections gain, so on CPU
# half-precision decode attention upcasts the gathered K/V and computes in float32, the output
# cast back (benchmarks/results/bf16.json; lever `bf16-decode-upcast` in benchmarks/levers.py).
HALF_DTYPES = (torch.bfloat16, torch.float16)

# Requests with at most this many new tokens go through the native kernel when it is on: it walks
# the context once per KV head for all their query rows, where SDPA would first gather it.
NATIVE_MAX_QUERY_TOKENS = 16
# How the native kernel names a quantized cache's stored element type.
NATIVE_KV_ELEMENTS = {torch.int8: "int8", torch.float8_e4m3fn: "fp8_e4m3", torch.float8_e5m2: "fp8_e5m2"}


@dataclass
class DecodeGroup:
    token_index: torch.Tensor  # [B] rows of the flattened batch
    block_index: torch.Tensor  # [B * max_blocks] each request's blocks, padded with block 0
    length: int  # max_blocks * block_size: the padded context length L
    masks: dict[int | None, torch.Tensor]  # window -> [B, 1, 1, L] bool


@dataclass
class PrefillRequest:
    start: int
    end: int
    block_index: torch.Tensor  # [blocks] the request's blocks
    length: int  # context + new tokens
    masks: dict[int | None, torch.Tensor | None]  # window -> [q, L] bool; None: plain causal


@dataclass
class NativeRequests:
    """The requests the native kernel attends (in place, through their block tables)."""

    query_starts: torch.Tensor  # [R] int64: first row of each in the flattened batch
    query_lens: torch.Tensor  # [R] int64
    seq_lens: torch.Tensor  # [R] int64: context + new tokens
    block_tables: torch.Tensor  # [R, max_blocks] int32


@dataclass
class TorchAttentionMetadata:
    slot_mapping: torch.Tensor
    decodes: list[DecodeGroup] = field(default_factory=list)
    prefills: list[PrefillRequest] = field(default_factory=list)
    # One decode group holding every row of the batch in order (always so at concurrency 1):
    # its queries are the batch as is, and its output is the layer's, with no gather or scatter.
    whole_batch_decode: bool = False
    native: NativeRequests | None = None


def visibility_mask(
    query_positions: torch.Tensor,
    key_positions: torch.Tensor,
    window: int | None,
    spans: list[tuple[int, int]] | None = None,
) -> torch.Tensor:
    """Causal (and sliding-window) visibility: query at p sees key at j if j <= p and,
    with a window w, j > p - w (the convention transformers uses). `spans`: position ranges
    whose tokens also see each other's later tokens (Gemma 3's images; the window still applies,
    as transformers composes them)."""
    q = query_positions.unsqueeze(-1)
    k = key_positions.unsqueeze(-2)
    visible = k <= q
    for start, end in spans or ():
        visible |= (q >= start) & (q < end) & (k >= start) & (k < end)
    if window is not None:
        visible &= k > q - window
    return visible


class TorchAttentionBackend(AttentionBackend):
    name = "torch"
    supports_latent = True

    def __init__(self, kv_format: KVCacheFormat | None = None, native: NativeKernels | None = None) -> None:
        # None: caches hold the model dtype. A quantized format stores encoded entries
        # (pagoda.quant.kv_cache_dtype) that are decoded after the block gather.
        self.kv_format = kv_format if kv_format is not None and kv_format.quantized else None
        self.upcast_half_decode = True  # float32 decode attention for half-precision models on CPU
        self.native = native  # the native CPU kernels: decode-sized requests attend in place
        # Latent attention decodes with the absorbed projections (False: K/V expanded per step,
        # the slower form kept as the reference: tests, benchmarks/mla_decode.py).
        self.absorb_latent_decode = True

    def check_layers(self, specs: list[AttentionLayerSpec], model_name: str) -> None:
        super().check_layers(specs, model_name)
        if any(spec.latent for spec in specs):
            self.native = None  # the native paged kernel reads K/V heads, not latents: SDPA paths only

    def prepare(self, layout: BatchLayout, sliding_windows: set[int | None]) -> TorchAttentionMetadata:
        if self.native is None or layout.slot_mapping.device.type != "cpu":
            return self._prepare_gathers(layout, sliding_windows, range(layout.num_reqs))
        query_lens = layout.query_lens_host
        spans = layout.bidirectional or [[]] * layout.num_reqs  # requests with spans go through SDPA
        rows = [i for i, n in enumerate(query_lens) if 0 < n <= NATIVE_MAX_QUERY_TOKENS and not spans[i]]
        longer = [i for i, n in enumerate(query_lens) if n > NATIVE_MAX_QUERY_TOKENS or (n > 0 and spans[i])]
        metadata = self._prepare_gathers(layout, sliding_windows, longer)
        if not rows:
            return metadata
        if len(rows) == layout.num_reqs:  # the whole batch, as laid out
            metadata.native = NativeRequests(
                layout.query_start_loc[:-1], torch.tensor(query_lens), layout.seq_lens, layout.block_tables
            )
        else:
            index = torch.tensor(rows)
            metadata.native = NativeRequests(
                layout.query_start_loc[index],
                torch.tensor([query_lens[i] for i in rows]),
                layout.seq_lens[index],
                layout.block_tables[index],
            )
        return metadata

    def _prepare_gathers(
        self, layout: BatchLayout, sliding_windows: set[int | None], requests: range | list[int]
    ) -> TorchAttentionMetadata:
        """The gathers, masks and decode groups of the requests attended through SDPA."""
        device = layout.slot_mapping.device
        query_lens = layout.query_lens_host
        context_lens = layout.context_lens_host
        starts = layout.query_start_loc.tolist()

        spans = layout.bidirectional or [[]] * layout.num_reqs
        decode_rows = sorted(
            (i for i in requests if query_lens[i] == 1 and not spans[i]), key=lambda i: context_lens[i]
        )
        decodes = [
            self._decode_group(layout, rows, sliding_windows) for rows in decode_groups(decode_rows, context_lens)
        ]
        prefills = []
        for i in requests:
            n = query_lens[i]
            if n < 1 or (n == 1 and not spans[i]):
                continue
            total = context_lens[i] + n
            query_positions = torch.arange(context_lens[i], total, device=device)
            key_positions = torch.arange(total, device=device)
            masks: dict[int | None, torch.Tensor | None] = {}
            for window in sliding_windows:
                if window is None and context_lens[i] == 0 and not spans[i]:
                    masks[window] = None
                else:
                    masks[window] = visibility_mask(query_positions, key_positions, window, spans[i])
            num_blocks = -(-total // layout.block_size)
            prefills.append(
                PrefillRequest(
                    start=starts[i],
                    end=starts[i] + n,
                    block_index=layout.block_tables[i, :num_blocks].long(),
                    length=total,
                    masks=masks,
                )
            )
        whole_batch = not prefills and decode_rows == list(range(len(query_lens)))
        return TorchAttentionMetadata(layout.slot_mapping, decodes, prefills, whole_batch and len(decodes) == 1)

    @staticmethod
    def _decode_group(layout: BatchLayout, decode_rows: list[int], sliding_windows: set[int | None]) -> DecodeGroup:
        device = layout.slot_mapping.device
        context_lens = layout.context_lens_host
        rows = torch.tensor(decode_rows, device=device)
        seq_lens = layout.seq_lens[rows]
        num_blocks = -(-max(context_lens[i] + 1 for i in decode_rows) // layout.block_size)
        length = num_blocks * layout.block_size
        key_positions = torch.arange(length, device=device)
        query_positions = (seq_lens - 1).unsqueeze(-1)
        masks = {}
        for window in sliding_windows:
            visible = visibility_mask(query_positions, key_positions, window)  # [B, 1, L]
            masks[window] = visible.unsqueeze(1)
        return DecodeGroup(
            token_index=layout.query_start_loc[rows],
            block_index=layout.block_tables[rows, :num_blocks].reshape(-1).long(),
            length=length,
            masks=masks,
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
        assert isinstance(metadata, TorchAttentionMetadata)
        num_kv_heads = spec.num_kv_heads
        entry = key_cache.shape[-1]  # head_dim, or more for a quantized format's entries
        kv_format = self.kv_format
        load = kv_format.decode if kv_format is not None else (lambda entries: entries)
        flat_keys = key_cache.view(-1, num_kv_heads, entry)
        flat_values = value_cache.view(-1, num_kv_heads, entry)
        flat_keys.index_copy_(0, metadata.slot_mapping, key if kv_format is None else kv_format.encode(key))
        flat_values.index_copy_(0, metadata.slot_mapping, value if kv_format is None else kv_format.encode(value))

        if metadata.whole_batch_decode:
            return self._decode(query.unsqueeze(2), metadata.decodes[0], key_cache, value_cache, spec).squeeze(2)
        output = (
            self._native(query, key_cache, value_cache, metadata.native, spec)
            if metadata.native is not None
            else torch.empty_like(query)
        )
        for decode in metadata.decodes:
            output[decode.token_index] = self._decode(
                query[decode.token_index].unsqueeze(2), decode, key_cache, value_cache, spec
            ).squeeze(2)
        for prefill in metadata.prefills:
            q = query[prefill.start : prefill.end].transpose(0, 1).unsqueeze(0)  # [1, H, q, D]
            k = load(key_cache.index_select(0, prefill.block_index).view(-1, num_kv_heads, entry)[: prefill.length])
            v = load(value_cache.index_select(0, prefill.block_index).view(-1, num_kv_heads, entry)[: prefill.length])
            k = k.transpose(0, 1).unsqueeze(0)  # [1, KVH, L, D]
            v = v.transpose(0, 1).unsqueeze(0)
            out = attend(q, k, v, prefill.masks[spec.sliding_window], spec)
            output[prefill.start : prefill.end] = out.squeeze(0).transpose(0, 1)
        return output

    def forward_latent(
        self,
        q_nope: torch.Tensor,
        q_rope: torch.Tensor,
        latent: torch.Tensor,
        rope_key: torch.Tensor,
        latent_cache: torch.Tensor,
        rope_cache: torch.Tensor,
        metadata: object,
        spec: AttentionLayerSpec,
        projection: LatentProjection,
    ) -> torch.Tensor:
        """Decodes absorbed (one batched computation per decode group), prefill chunks expanded
        over their whole context's latents (pagoda.kernels.attention.latent)."""
        assert isinstance(metadata, TorchAttentionMetadata) and metadata.native is None
        kv_format = self.kv_format
        load = kv_format.decode if kv_format is not None else (lambda entries: entries)
        latent_entry, rope_entry = latent_cache.shape[-1], rope_cache.shape[-1]
        flat_latents, flat_rope = latent_cache.view(-1, latent_entry), rope_cache.view(-1, rope_entry)
        flat_latents.index_copy_(0, metadata.slot_mapping, latent if kv_format is None else kv_format.encode(latent))
        flat_rope.index_copy_(0, metadata.slot_mapping, rope_key if kv_format is None else kv_format.encode(rope_key))
        output = q_nope.new_empty(q_nope.shape[0], projection.num_heads, projection.v_dim)
        decode_attention = absorbed_attention if self.absorb_latent_decode else expanded_decode
        for decode in metadata.decodes:
            rows = decode.token_index
            batch = rows.shape[0]
            latents = load(latent_cache.index_select(0, decode.block_index).view(batch, decode.length, latent_entry))
            rope_keys = load(rope_cache.index_select(0, decode.block_index).view(batch, decode.length, rope_entry))
            mask = decode.masks[spec.sliding_window].view(batch, decode.length)
            output[rows] = decode_attention(
                q_nope[rows], q_rope[rows], latents, rope_keys, projection, spec.scale, mask
            )
        for prefill in metadata.prefills:
            span = slice(prefill.start, prefill.end)
            latents = load(latent_cache.index_select(0, prefill.block_index).view(-1, latent_entry)[: prefill.length])
            rope_keys = load(rope_cache.index_select(0, prefill.block_index).view(-1, rope_entry)[: prefill.length])
            output[span] = expanded_attention(
                q_nope[span],
                q_rope[span],
                latents,
                rope_keys,
                projection,
                spec.scale,
                prefill.masks[spec.sliding_window],
            )
        return output

    def _native(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        requests: NativeRequests,
        spec: AttentionLayerSpec,
    ) -> torch.Tensor:
        """The native kernel's output for its requests' rows (in float32, cast back to the model
        dtype); the other rows are left for the SDPA path to fill."""
        assert self.native is not None
        kv_format = self.kv_format
        element, per_token, tensor_scale = "", False, 1.0  # float caches: read as their dtype
        if kv_format is not None:
            element = NATIVE_KV_ELEMENTS[kv_format.element_dtype]
            per_token, tensor_scale = kv_format.scale_per_token, kv_format.tensor_scale
        out = self.native.paged_attention(
            query.float(),
            key_cache,
            value_cache,
            requests.block_tables,
            requests.query_starts,
            requests.query_lens,
            requests.seq_lens,
            spec.scale,
            spec.sliding_window,
            spec.logit_softcap,
            spec.sinks,
            element,
            per_token,
            tensor_scale,
        )
        return out.to(query.dtype)

    def _decode(
        self,
        q: torch.Tensor,
        decode: DecodeGroup,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        spec: AttentionLayerSpec,
    ) -> torch.Tensor:
        """q [B, H, 1, D] of one decode group -> its attention output [B, H, 1, D]."""
        load = self.kv_format.decode if self.kv_format is not None else (lambda entries: entries)
        shape = (q.shape[0], decode.length, spec.num_kv_heads, key_cache.shape[-1])
        k = load(key_cache.index_select(0, decode.block_index).view(shape))  # [B, L, KVH, D]
        v = load(value_cache.index_select(0, decode.block_index).view(shape))
        upcast = self.upcast_half_decode and q.device.type == "cpu" and q.dtype in HALF_DTYPES
        if upcast:
            k, v = k.float(), v.float()
        out = attend(
            q.float() if upcast else q, k.transpose(1, 2), v.transpose(1, 2), decode.masks[spec.sliding_window], spec
        )
        return out.to(q.dtype) if upcast else out


def attend(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, spec: AttentionLayerSpec
) -> torch.Tensor:
    """q [B, H, q, D] over k/v [B, KVH, L, D]; mask: bool, broadcast to [B, H, q, L], or None for
    causal attention over keys starting at the first query's position."""
    gqa = spec.num_heads != spec.num_kv_heads
    cap = spec.logit_softcap
    if cap is None and spec.sinks is None:
        return F.scaled_dot_product_attention(
            q, k, v, attn_mask=mask, is_causal=mask is None, scale=spec.scale, enable_gqa=gqa
        )
    # SDPA has neither soft-caps nor sinks: scores, cap, mask and softmax in transformers' order.
    if gqa:
        k = k.repeat_interleave(spec.num_heads // spec.num_kv_heads, dim=1)
        v = v.repeat_interleave(spec.num_heads // spec.num_kv_heads, dim=1)
    scores = torch.matmul(q, k.transpose(-1, -2)) * spec.scale
    if cap is not None:
        scores = torch.tanh(scores / cap) * cap
    if mask is None:
        num_queries, num_keys = q.shape[-2], k.shape[-2]
        mask = torch.ones(num_queries, num_keys, dtype=torch.bool, device=q.device).tril(num_keys - num_queries)
    scores = scores.masked_fill(~mask, float("-inf"))
    if spec.sinks is None:
        return torch.matmul(torch.softmax(scores, dim=-1, dtype=torch.float32).to(q.dtype), v)
    # The sink is one more column of the softmax, dropped after it.
    sinks = spec.sinks.to(scores.dtype).reshape(1, -1, 1, 1).expand(scores.shape[0], -1, scores.shape[2], 1)
    scores = torch.cat([scores, sinks], dim=-1)
    scores = scores - scores.max(dim=-1, keepdim=True).values
    probs = torch.softmax(scores, dim=-1, dtype=torch.float32)[..., :-1]
    return torch.matmul(probs.to(q.dtype), v)


def decode_groups(
    rows: list[int],
    context_lens: list[int],
    max_size: int = DECODE_GROUP_SIZE,
    max_padding: int = DECODE_GROUP_MAX_PADDING,
) -> list[list[int]]:
    """Split decode rows, sorted by context length, into groups of at most `max_size`, starting
    a new group where the next (longer) row would pad the group's rows by more than
    `max_padding` (row, token) pairs in all."""
    groups: list[list[int]] = []
    for row in rows:
        group = groups[-1] if groups else None
        if (
            group is None
            or len(group) >= max_size
            or len(group) * (context_lens[row] - context_lens[group[-1]]) > max_padding
        ):
            groups.append([row])
        else:
            group.append(row)
    return groups
