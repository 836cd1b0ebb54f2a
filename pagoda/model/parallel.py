"""Tensor parallelism inside the model: the rank's group and how each layer is split.

One `TensorParallelGroup` per model (world size 1 when there is no parallelism). The model code
asks it for shards and passes them to its layers; it never looks at the rank itself:

- `LinearShard`: which rows (output features, per fused part) and which columns (input
  features) of a checkpoint's weight this rank holds. Column-parallel layers (q/k/v, gate/up,
  LM head) split the rows, row-parallel ones (o, down) split the columns and all-reduce their
  output. The loaders narrow checkpoint tensors with `take`.
- `AttentionHeads`: the rank's query heads and KV heads. KV heads are split like the query
  heads, or replicated when there are fewer KV heads than ranks (each rank keeps the one KV
  head its query heads read). Each rank's KV cache holds only its KV heads.
- `ExpertPlacement`: a MoE block's experts on this rank. Without expert parallelism every rank
  holds every expert, each split like a dense MLP; with it (`expert_parallel`) each rank holds
  whole experts, a contiguous 1/N of them. Either way each rank's MoE output is a partial sum
  over the tokens it was given (all of them: attention leaves the hidden states replicated), and
  one all-reduce combines it, the row-parallel layer's collective.
- Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the
  vocabulary (padded to a multiple of the world size); embeddings are all-reduced (other ranks
  contribute zeros), logits all-gathered so the sampler sees the whole vocabulary.

The collectives run on a standalone torch.distributed backend (ProcessGroupGloo on CPU,
ProcessGroupNCCL on CUDA) built by pagoda.executor, so no process-global default group exists.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.quant.weight_formats import GGUFBlocks

if TYPE_CHECKING:
    from pagoda.kernels import Kernels

# Parameters with one value per output row (no input columns to split).
VECTOR_PARAMS = ("bias", "sinks")


@dataclass(frozen=True)
class Slice:
    """Elements [start, start + size) of one dimension."""

    start: int
    size: int


@dataclass(frozen=True)
class LinearShard:
    """This rank's piece of a Linear's full weight [sum(parts), in_features].

    `parts` are the full sizes of the fused output parts (q, k, v; gate, up; or one part);
    `rows[i]` is the rank's slice of part i (may run past the part's end for a padded vocabulary:
    those rows stay zero); `columns` is the rank's slice of the input features. `reduce`: the
    layer's output is a partial sum, all-reduced in the layer (row parallel)."""

    parts: tuple[int, ...]
    rows: tuple[Slice, ...]
    in_features: int
    columns: Slice
    reduce: bool = False

    @classmethod
    def whole(cls, in_features: int, out_features: int) -> LinearShard:
        """No parallelism: every row and column."""
        return cls((out_features,), (Slice(0, out_features),), in_features, Slice(0, in_features))

    @property
    def local_out(self) -> int:
        return sum(s.size for s in self.rows)

    @property
    def local_in(self) -> int:
        return self.columns.size

    @property
    def is_split(self) -> bool:
        return self.local_out != sum(self.parts) or self.local_in != self.in_features

    def row_offset(self, part: int | None) -> int:
        """Where fused part `part` (None: the whole parameter) starts in the local rows."""
        return 0 if part is None else sum(s.size for s in self.rows[:part])

    def full_shape(self, part: int | None, param: str) -> tuple[int, ...]:
        """Shape the checkpoint tensor of `param` ("weight", or a vector: "bias", attention
        "sinks") has, for one fused part (None: the whole parameter)."""
        rows = sum(self.parts) if part is None else self.parts[part]
        return (rows,) if param in VECTOR_PARAMS else (rows, self.in_features)

    def take(self, tensor: torch.Tensor, part: int | None, param: str) -> tuple[int, torch.Tensor]:
        """(row offset in the local parameter, this rank's piece of the checkpoint tensor of
        `param` ("weight" or "bias") for one fused part, None: the whole parameter)."""
        offset, piece = self._take_rows(tensor, part)
        if param not in VECTOR_PARAMS:
            piece = piece[:, self.columns.start : self.columns.start + self.columns.size]
        return offset, piece

    def take_int4(
        self,
        codes: torch.Tensor,
        scales: torch.Tensor,
        zeros: torch.Tensor | None,
        part: int | None,
        group_size: int,
        layer_name: str,
    ) -> tuple[int, tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]]:
        """The rank's piece of int4 codes [rows, K] with scales/zeros [rows, K / group]."""
        if self.columns.start % group_size or self.columns.size % group_size:
            raise ValueError(
                f"{layer_name}: its int4 groups of {group_size} do not divide this rank's input "
                f"slice of {self.columns.size} columns; use a smaller tensor_parallel_size"
            )
        offset, codes = self.take(codes, part, "weight")
        groups = slice(self.columns.start // group_size, (self.columns.start + self.columns.size) // group_size)
        scales = self._take_rows(scales, part)[1][:, groups]
        zeros = None if zeros is None else self._take_rows(zeros, part)[1][:, groups]
        return offset, (codes, scales, zeros)

    def _take_rows(self, tensor: torch.Tensor, part: int | None) -> tuple[int, torch.Tensor]:
        if part is not None:
            row = self.rows[part]
            stop = min(row.start + row.size, self.parts[part])
            return sum(s.size for s in self.rows[:part]), tensor[row.start : stop]
        pieces, base = [], 0
        for full, row in zip(self.parts, self.rows):
            stop = min(row.start + row.size, full)
            pieces.append(tensor[base + row.start : base + stop])
            base += full
        return 0, pieces[0] if len(pieces) == 1 else torch.cat(pieces)


@dataclass(frozen=True)
class AttentionHeads:
    """The rank's attention heads: counts, and its rows of the q and k/v projections."""

    num_heads: int
    num_kv_heads: int
    head_dim: int
    q_rows: Slice
    kv_rows: Slice


@dataclass(frozen=True)
class ExpertPlacement:
    """The experts of a MoE block this rank holds, and the group their weights are split over
    (a one-rank group: each expert whole)."""

    experts: Slice
    weight_group: TensorParallelGroup

    def holds(self, expert: int) -> bool:
        return self.experts.start <= expert < self.experts.start + self.experts.size


class TensorParallelGroup:
    """A rank's place among `world_size` tensor-parallel ranks, and its collectives.

    `backend` is a torch.distributed backend object (ProcessGroupGloo / ProcessGroupNCCL) or None
    for world size 1. `expert_parallel`: MoE experts are placed whole on ranks instead of split."""

    def __init__(self, rank: int = 0, world_size: int = 1, backend: Any = None, expert_parallel: bool = False) -> None:
        if world_size > 1 and backend is None:
            raise ValueError("a tensor-parallel group of more than one rank needs a torch.distributed backend")
        self.rank = rank
        self.world_size = world_size
        self.backend = backend
        self.expert_parallel = expert_parallel

    # ---- collectives ---------------------------------------------------------------------------

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size > 1:
            self.backend.allreduce([x]).wait()
        return x

    def all_gather_last_dim(self, x: torch.Tensor) -> torch.Tensor:
        if self.world_size == 1:
            return x
        x = x.contiguous()
        parts = [torch.empty_like(x) for _ in range(self.world_size)]
        self.backend.allgather([parts], [x]).wait()
        return torch.cat(parts, dim=-1)

    # ---- shards --------------------------------------------------------------------------------

    def split(self, total: int, what: str) -> Slice:
        if total % self.world_size:
            raise ValueError(f"{what} ({total}) is not divisible by tensor_parallel_size ({self.world_size})")
        size = total // self.world_size
        return Slice(self.rank * size, size)

    def column(self, in_features: int, *parts: int, what: str = "output features") -> LinearShard:
        """Output rows split evenly, part by part (gate and up each split in N)."""
        rows = tuple(self.split(p, what) for p in parts)
        return LinearShard(tuple(parts), rows, in_features, Slice(0, in_features))

    def row(self, in_features: int, out_features: int, what: str = "input features") -> LinearShard:
        """Input columns split evenly; the partial outputs are all-reduced."""
        return LinearShard(
            (out_features,),
            (Slice(0, out_features),),
            in_features,
            self.split(in_features, what),
            reduce=self.world_size > 1,
        )

    def attention_heads(self, num_heads: int, num_kv_heads: int, head_dim: int) -> AttentionHeads:
        heads = self.split(num_heads, "num_attention_heads")
        if num_kv_heads >= self.world_size:
            kv = self.split(num_kv_heads, "num_key_value_heads")
        else:  # fewer KV heads than ranks: each rank keeps the one its query heads use
            if self.world_size % num_kv_heads:
                raise ValueError(
                    f"tensor_parallel_size ({self.world_size}) must be a multiple of "
                    f"num_key_value_heads ({num_kv_heads}) when it is larger"
                )
            kv = Slice(self.rank * num_kv_heads // self.world_size, 1)
        return AttentionHeads(
            heads.size,
            kv.size,
            head_dim,
            Slice(heads.start * head_dim, heads.size * head_dim),
            Slice(kv.start * head_dim, kv.size * head_dim),
        )

    def qkv(
        self, in_features: int, heads: AttentionHeads, num_heads: int, num_kv_heads: int, q_width: int = 1
    ) -> LinearShard:
        """q_width 2: q_proj gives each head its query then its gate (an output gate), rows
        that split by head like the queries alone."""
        q, kv = q_width * num_heads * heads.head_dim, num_kv_heads * heads.head_dim
        q_rows = Slice(q_width * heads.q_rows.start, q_width * heads.q_rows.size)
        return LinearShard((q, kv, kv), (q_rows, heads.kv_rows, heads.kv_rows), in_features, Slice(0, in_features))

    def vocab(self, vocab_size: int, hidden_size: int) -> LinearShard:
        """The rank's rows of the vocabulary, padded up to a multiple of the world size."""
        size = -(-vocab_size // self.world_size)
        return LinearShard((vocab_size,), (Slice(self.rank * size, size),), hidden_size, Slice(0, hidden_size))

    def experts(self, num_experts: int) -> ExpertPlacement:
        if not self.expert_parallel or self.world_size == 1:
            return ExpertPlacement(Slice(0, num_experts), self)
        if num_experts % self.world_size:
            raise ValueError(
                f"expert parallelism: the number of experts ({num_experts}) is not divisible by "
                f"tensor_parallel_size ({self.world_size})"
            )
        return ExpertPlacement(self.split(num_experts, "the number of experts"), TensorParallelGroup())

    def gather_logits(self, logits: torch.Tensor, vocab_size: int) -> torch.Tensor:
        """Local vocabulary logits [T, V / N] -> the whole vocabulary [T, V] on every rank."""
        return self.all_gather_last_dim(logits)[..., :vocab_size]


class VocabParallelEmbedding(nn.Module):
    """nn.Embedding over the rank's slice of the vocabulary; ids of other ranks embed to zero and
    the all-reduce fills them in. Parameter `weight` [local vocab, hidden] like nn.Embedding's.

    A GGUF file's quantized embedding is held as the file stores it (`hold_blocks`, one rank):
    rows are dequantized on lookup and a tied LM head multiplies its blocks (`as_head`), both
    through `kernels.linear`; `weight` is then a meta tensor naming the shape."""

    def __init__(
        self,
        vocab_size: int,
        hidden_size: int,
        dtype: torch.dtype,
        device: torch.device,
        group: TensorParallelGroup,
        kernels: Kernels | None = None,
    ) -> None:
        super().__init__()
        self.group = group
        self.kernels = kernels
        self.shard = group.vocab(vocab_size, hidden_size)
        weight = torch.empty(self.shard.local_out, hidden_size, dtype=dtype, device=device)
        # The padding rows past the vocabulary are never loaded: zeros (the rest is, so it is not
        # written twice: a weight update stages a fresh model each time).
        rows = self.shard.rows[0]
        weight[max(0, min(rows.size, vocab_size - rows.start)) :].zero_()
        self.weight = nn.Parameter(weight, requires_grad=False)
        # The GGUF type of the blocks held in the buffer `gguf_embedding` (hold_blocks), else None.
        self.gguf_type: str | None = None

    def hold_blocks(self, blocks: GGUFBlocks) -> None:
        """Keep the embedding as GGUF blocks (the whole vocabulary, one rank) instead of `weight`."""
        if self.group.world_size != 1 or self.kernels is None or blocks.shape != tuple(self.weight.shape):
            raise ValueError(f"a GGUF embedding of shape {blocks.shape} is held whole, by one rank with kernels")
        self.gguf_type = blocks.type_name
        self.register_buffer("gguf_embedding", blocks.data, persistent=False)
        dtype = self.weight.dtype
        self.weight = nn.Parameter(torch.empty(blocks.shape, dtype=dtype, device="meta"), requires_grad=False)

    def gguf_blocks(self) -> GGUFBlocks | None:
        """The GGUF blocks held (read from the buffer each time, so sleep mode's drop and adopt of
        buffers reach them), or None."""
        if self.gguf_type is None:
            return None
        data = self.gguf_embedding
        assert isinstance(data, torch.Tensor), "hold_blocks registers the buffer"
        return GGUFBlocks(self.gguf_type, data)

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        blocks = self.gguf_blocks()
        if blocks is not None:
            assert self.kernels is not None, "hold_blocks takes the kernels"
            values = self.kernels.linear.gguf_rows(blocks, input_ids.reshape(-1))
            return values.to(self.weight.dtype).reshape(*input_ids.shape, values.shape[-1])
        if self.group.world_size == 1:
            return F.embedding(input_ids, self.weight)
        rows = self.shard.rows[0]
        local = input_ids - rows.start
        outside = (local < 0) | (local >= rows.size)
        embedded = F.embedding(local.masked_fill(outside, 0), self.weight)
        embedded.masked_fill_(outside.unsqueeze(-1), 0)
        return self.group.all_reduce(embedded)

    def as_head(self, hidden: torch.Tensor) -> torch.Tensor:
        """hidden @ embedding^T: the logits of a tied LM head (this rank's vocabulary slice)."""
        blocks = self.gguf_blocks()
        if blocks is not None:
            assert self.kernels is not None, "hold_blocks takes the kernels"
            return self.kernels.linear.gguf_product(blocks, hidden).to(hidden.dtype)
        return F.linear(hidden, self.weight)
