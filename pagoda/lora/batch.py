"""One step's mapping from tokens to adapter slots, built once per step and read by every
LoRA layer of the forward."""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagoda.kernels.lora_batch import LoRABatch

NO_SLOT = -1  # a token of a base-model request: its projections stay exactly the base's


def build_lora_batch(
    token_runs: Sequence[tuple[int, int]], slot_ranks: dict[int, int], device: torch.device
) -> LoRABatch | None:
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
    return LoRABatch(
        rows=torch.tensor(rows, dtype=torch.long, device=device),
        slots=torch.tensor(slots, dtype=torch.long, device=device),
        segments=segments,
        rank=max(slot_ranks[s] for s in rows_by_slot),
        num_tokens=offset,
    )


class LoRAStepState:
    """Holds the current step's LoRABatch for the layers of one model (one per LoRAManager,
    set by the model runner around each forward; None outside a forward or when no token of
    the step uses an adapter)."""

    def __init__(self) -> None:
        self.batch: LoRABatch | None = None
