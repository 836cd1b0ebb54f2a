"""LinearStateBatch: one step's view of the state cache of the linear-attention layers.

Each running sequence of a hybrid model holds a slot of the state cache (pagoda.core.state_slots
assigns it, pagoda.worker.state_cache allocates the tensors): per linear layer, its short
convolution's window [conv_dim, K - 1] and its recurrent state [Hv, Dk, Dv]. A layer reads the
slots of the step's requests, computes its tokens, and writes the slots back in place.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from functools import cached_property

import torch


@dataclass
class LinearStateBatch:
    conv_windows: list[torch.Tensor | None]  # per layer [num_slots, conv_dim, K - 1]; None: an attention layer
    recurrent: list[torch.Tensor | None]  # per layer [num_slots, Hv, Dk, Dv] float32
    slots: list[int]  # per request of the step, in batch order
    query_start_loc: list[int]  # [num_reqs + 1]: request i's tokens are rows [loc[i], loc[i + 1])
    # Per request: its first token is at position 0, so its state starts from zeros (a new or
    # recomputed sequence reuses a slot without clearing it).
    fresh: list[bool]
    # Per request: (tokens into its rows, snapshot slot) in order: the state after those tokens is
    # also saved into the snapshot slot (prefix caching, pagoda.core.state_snapshots).
    snapshots: list[list[tuple[int, int]]] = field(default_factory=list)
    _decoding_index: dict[torch.device, tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict, repr=False)

    @property
    def num_reqs(self) -> int:
        return len(self.slots)

    @cached_property
    def decoding(self) -> list[int]:
        """The requests computing one token after earlier ones, saving no snapshot: the
        single-step update serves them together; the others run the chunked form one by one."""
        loc = self.query_start_loc
        return [i for i in range(self.num_reqs) if loc[i + 1] - loc[i] == 1 and not self.fresh[i] and not self.saved(i)]

    @cached_property
    def chunked(self) -> list[int]:
        """The other requests, each run by the chunked form."""
        decoding = set(self.decoding)
        return [i for i in range(self.num_reqs) if i not in decoding]

    def decoding_index(self, device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
        """(their rows, their slots) as index tensors, built once per step and device."""
        cached = self._decoding_index.get(device)
        if cached is None:
            rows = torch.tensor([self.query_start_loc[i] for i in self.decoding], dtype=torch.long, device=device)
            slots = torch.tensor([self.slots[i] for i in self.decoding], dtype=torch.long, device=device)
            cached = self._decoding_index[device] = (rows, slots)
        return cached

    def saved(self, i: int) -> list[tuple[int, int]]:
        """Request i's snapshots to save this step."""
        return self.snapshots[i] if self.snapshots else []

    def pieces(self, i: int) -> list[tuple[slice, int | None]]:
        """Request i's rows, cut where a snapshot is saved: (rows, snapshot slot to copy the state
        into after them, or None)."""
        start, end = self.query_start_loc[i], self.query_start_loc[i + 1]
        pieces: list[tuple[slice, int | None]] = []
        for offset, slot in self.saved(i):
            pieces.append((slice(start, self.query_start_loc[i] + offset), slot))
            start = self.query_start_loc[i] + offset
        if start < end:
            pieces.append((slice(start, end), None))
        return pieces
