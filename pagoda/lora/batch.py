"""One step's mapping from tokens to adapter slots, built once per step and read by every
LoRA layer of the forward."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

NO_SLOT = -1  # a token of a base-model request: its projections stay exactly the base's


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


def build_lora_batch(token_runs: Sequence[tuple[int, int]], slot_ranks: dict[int, int],
                     device: torch.device) -> LoRABatch | None:
    """`token_runs`: (slot or NO_SLOT, number of tokens) per request, in batch order.
    None when no token of the step uses an adapter (the layers then skip LoRA entirely)."""
    rows_by_slot: dict[int, list[int]] = {}
    offset = 0
    for slot, count in token_runs:
        if slot != NO_SLOT:
            rows_by_slot.setdefault(slot, []).extend(range(offset, offset + count))
        offset += count
    if not rows_by_slot:
        return None
    rows: list[int] = []
    slots: list[int] = []
    segments = []
    for slot in sorted(rows_by_slot):
        slot_rows = rows_by_slot[slot]
        segments.append((slot, len(rows), len(rows) + len(slot_rows)))
        rows.extend(slot_rows)
        slots.extend([slot] * len(slot_rows))
    return LoRABatch(rows=torch.tensor(rows, dtype=torch.long, device=device),
                     slots=torch.tensor(slots, dtype=torch.long, device=device),
                     segments=segments, rank=max(slot_ranks[s] for s in rows_by_slot), num_tokens=offset)


class LoRAStepState:
    """Holds the current step's LoRABatch for the layers of one model (one per LoRAManager,
    set by the model runner around each forward; None outside a forward or when no token of
    the step uses an adapter)."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None
