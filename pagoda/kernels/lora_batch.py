"""The operand of the LoRA delta: one step's tokens that use an adapter, grouped by slot
(built by pagoda.lora.batch once per step, read by every LoRA layer's delta)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class LoRABatch:
    """The tokens of a step that use an adapter, grouped by slot.

    `rows` are those tokens' positions in the batch, sorted by slot (a request's tokens are
    contiguous, so each slot's rows are a few runs); `segments` says which stretch of `rows`
    belongs to which slot, for the segment matmuls; `slots` is each row's slot, for the
    gathered formulation. `rank` is the largest rank among the step's adapters: the stacked
    weights are zero beyond an adapter's own rank, so a layer computes only `rank` columns.
    """

    rows: torch.Tensor  # [n] long
    slots: torch.Tensor  # [n] long
    segments: list[tuple[int, int, int]]  # (slot, start, end) into rows
    rank: int
    num_tokens: int  # of the whole batch, adapter or not
    # The GPU kernel's tile table, built on first use and shared by all layers of the step.
    kernel_tiles: dict[int, torch.Tensor] = field(default_factory=dict)

    @property
    def covers_all_tokens(self) -> bool:
        return self.rows.shape[0] == self.num_tokens
