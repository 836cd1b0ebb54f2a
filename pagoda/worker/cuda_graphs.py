"""CUDA graphs for decode-only steps.

A decode step of a small model launches hundreds of kernels that each run for microseconds,
so the host's launch overhead, not the GPU, sets the pace. The runner captures the model's
forward once per batch size bucket (1, 2, 4, 8, 16, 24, 32, ... up to max_num_seqs) over
static input buffers, and a step with only decodes copies its inputs into the buffers and
replays the smallest bucket that holds it.

Padded rows (between the real batch and the bucket) have slot -1, so the cache write skips
them, and a context of one token in block 0, so attention reads a single finite value; their
outputs are ignored.

The attention backend must produce metadata that stays valid when the buffers' contents
change (only the batch size may be baked in); backends declare it with
`supports_cuda_graphs = True`. The capture-time metadata is prepared for a context of
`max_model_len`, so any split of the context it chooses is valid for every real length.
"""

from __future__ import annotations

import bisect
from dataclasses import dataclass

import torch

from pagoda.kernels.attention import AttentionBackend, BatchLayout
from pagoda.model.decoder import DecoderModel, ForwardContext


def decode_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then every multiple of 8 from 16, ending with max_num_seqs itself."""
    sizes = [1, 2, 4, 8, *range(16, max_num_seqs, 8)]
    return [s for s in sizes if s < max_num_seqs] + [max_num_seqs]


def bucket_for(num_reqs: int, batch_sizes: list[int]) -> int | None:
    """The smallest captured batch size >= num_reqs, or None if it is too large."""
    index = bisect.bisect_left(batch_sizes, num_reqs)
    return batch_sizes[index] if index < len(batch_sizes) else None


def supports_cuda_graphs(backend: AttentionBackend) -> bool:
    return bool(getattr(backend, "supports_cuda_graphs", False))


@dataclass
class DecodeInputs:
    """Static buffers a graph reads, sized for the largest bucket; a step fills a prefix."""

    input_ids: torch.Tensor  # [B]
    positions: torch.Tensor  # [B]
    slot_mapping: torch.Tensor  # [B]
    query_start_loc: torch.Tensor  # [B + 1]: 0, 1, 2, ... (one token per request) and never changes
    context_lens: torch.Tensor  # [B]
    seq_lens: torch.Tensor  # [B]
    block_tables: torch.Tensor  # [B, max_blocks_per_seq] int32

    @classmethod
    def allocate(cls, max_batch_size: int, max_blocks_per_seq: int, device: torch.device) -> DecodeInputs:
        def longs(fill: int) -> torch.Tensor:
            return torch.full((max_batch_size,), fill, dtype=torch.long, device=device)

        return cls(
            input_ids=longs(0),
            positions=longs(0),
            slot_mapping=longs(-1),
            query_start_loc=torch.arange(max_batch_size + 1, dtype=torch.long, device=device),
            context_lens=longs(0),
            seq_lens=longs(1),
            block_tables=torch.zeros((max_batch_size, max_blocks_per_seq), dtype=torch.int32, device=device),
        )

    def load(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: BatchLayout, batch_size: int) -> None:
        """Copy a decode-only batch into rows [0, n) and pad rows [n, batch_size).
        Block-table columns past the batch's width keep stale entries: kernels read only the
        blocks below each row's seq_len."""
        n = layout.num_reqs
        self.input_ids[:n].copy_(input_ids, non_blocking=True)
        self.positions[:n].copy_(positions, non_blocking=True)
        self.slot_mapping[:n].copy_(layout.slot_mapping, non_blocking=True)
        self.context_lens[:n].copy_(layout.context_lens, non_blocking=True)
        self.seq_lens[:n].copy_(layout.seq_lens, non_blocking=True)
        self.block_tables[:n, : layout.block_tables.shape[1]].copy_(layout.block_tables, non_blocking=True)
        if batch_size > n:
            self.input_ids[n:batch_size].zero_()
            self.positions[n:batch_size].zero_()
            self.slot_mapping[n:batch_size].fill_(-1)
            self.context_lens[n:batch_size].zero_()
            self.seq_lens[n:batch_size].fill_(1)
            self.block_tables[n:batch_size].zero_()

    def layout(self, batch_size: int, block_size: int, max_model_len: int) -> BatchLayout:
        """The layout over the first batch_size rows. Its host lengths claim the longest
        possible contexts: whatever a backend plans from them holds for any real batch."""
        return BatchLayout(
            slot_mapping=self.slot_mapping[:batch_size],
            query_start_loc=self.query_start_loc[: batch_size + 1],
            context_lens=self.context_lens[:batch_size],
            seq_lens=self.seq_lens[:batch_size],
            block_tables=self.block_tables[:batch_size],
            block_size=block_size,
            query_lens_host=[1] * batch_size,
            context_lens_host=[max_model_len - 1] * batch_size,
        )


class DecodeGraphRunner:
    """Captures `model` per decode bucket; `run` replays. `run_eager` executes the same padded
    forward without a graph (for checking the padding on any device)."""

    def __init__(
        self,
        model: DecoderModel,
        backend: AttentionBackend,
        kv_caches: list[tuple[torch.Tensor, torch.Tensor] | None],
        sliding_windows: set[int | None],
        max_num_seqs: int,
        max_model_len: int,
        block_size: int,
        device: torch.device,
    ) -> None:
        if not supports_cuda_graphs(backend):
            raise ValueError(f"attention backend {backend.name!r} cannot be captured in CUDA graphs")
        self.model = model
        self.backend = backend
        self.kv_caches = kv_caches
        self.sliding_windows = sliding_windows
        self.block_size = block_size
        self.max_model_len = max_model_len
        self.batch_sizes = decode_batch_sizes(max_num_seqs)
        self.max_blocks_per_seq = -(-max_model_len // block_size)
        self.inputs = DecodeInputs.allocate(self.batch_sizes[-1], self.max_blocks_per_seq, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}

    def fits(self, layout: BatchLayout) -> bool:
        return (
            max(layout.query_lens_host) == 1
            and layout.num_reqs <= self.batch_sizes[-1]
            and layout.block_tables.shape[1] <= self.max_blocks_per_seq
        )

    def _forward(self, batch_size: int) -> torch.Tensor:
        layout = self.inputs.layout(batch_size, self.block_size, self.max_model_len)
        metadata = self.backend.prepare(layout, self.sliding_windows)
        context = ForwardContext(self.backend, [metadata] * len(self.kv_caches), self.kv_caches)
        return self.model(self.inputs.input_ids[:batch_size], self.inputs.positions[:batch_size], context)

    @torch.inference_mode()
    def capture(self) -> None:
        """Capture every bucket, largest first so the smaller graphs reuse its memory pool.
        The buffers hold padding rows only (slot -1), so capturing writes nothing to the cache.
        Called again after the KV caches' or weights' storage was reallocated (a wake from
        sleep): a graph replays the addresses it was captured with."""
        self.graphs.clear()
        self.outputs.clear()
        pool = None
        for batch_size in reversed(self.batch_sizes):
            self._forward(batch_size)  # compile the kernels and settle the allocator outside the graph
            torch.cuda.synchronize()
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=pool):
                self.outputs[batch_size] = self._forward(batch_size)
            pool = graph.pool()
            self.graphs[batch_size] = graph
        torch.cuda.synchronize()

    def run(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        """Hidden states [num_reqs, hidden] of a batch that `fits`. The tensor is the graph's
        output buffer: read it before the next run."""
        batch_size = bucket_for(layout.num_reqs, self.batch_sizes)
        assert batch_size is not None and batch_size in self.graphs
        self.inputs.load(input_ids, positions, layout, batch_size)
        self.graphs[batch_size].replay()
        return self.outputs[batch_size][: layout.num_reqs]

    @torch.inference_mode()
    def run_eager(self, input_ids: torch.Tensor, positions: torch.Tensor, layout: BatchLayout) -> torch.Tensor:
        batch_size = bucket_for(layout.num_reqs, self.batch_sizes)
        assert batch_size is not None
        self.inputs.load(input_ids, positions, layout, batch_size)
        return self._forward(batch_size)[: layout.num_reqs]
