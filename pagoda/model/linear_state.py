"""LinearStateBatch: one step's view of the state cache of the linear-attention layers.

Each running sequence of a hybrid model holds a slot of the state cache (pagoda.core.state_slots
assigns it, pagoda.worker.state_cache allocates the tensors): per linear layer, its short
convolution's window [conv_dim, K - 1] and its recurrent state [Hv, Dk, Dv]. A layer reads the
slots of the step's requests, computes its tokens, and writes the slots back in place.
"""

from __future__ import annotations

from dataclasses import dataclass

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

    @property
    def num_reqs(self) -> int:
        return len(self.slots)

    def decoding(self) -> list[int]:
        """The requests computing one token after earlier ones: the single-step update serves them
        together; the others run the chunked form one by one."""
        loc = self.query_start_loc
        return [i for i in range(self.num_reqs) if loc[i + 1] - loc[i] == 1 and not self.fresh[i]]
