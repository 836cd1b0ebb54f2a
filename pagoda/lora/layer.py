"""LoRALinear: a base `Linear` plus the batched delta of the adapters resident in its slots.

It needs only the base layer's in/out features (DESIGN.md, "One linear layer"): the base
output comes from the layer's own weight format (full, int8, int4, GGUF) untouched, and the
delta is added to the rows of adapter tokens. A fused projection (q/k/v, gate/up) has one
part per PEFT module; each part's A and B go into the stacked weights block-diagonally:
rank row `r` of part `p` is row `r * parts + p`, and its B row is non-zero only in the part's
output columns. So one shrink and one expand cover all parts, and the first `rank * parts`
rows hold every part's first `rank` ranks.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from pagoda.lora.adapter import LoRAAdapter
from pagoda.lora.batch import LoRAStepState
from pagoda.model.layers import Linear


@dataclass(frozen=True)
class LoRAPart:
    """One PEFT module inside a (possibly fused) projection: its output rows [offset, offset + size)."""

    module: str
    offset: int
    size: int


class LoRALinear(nn.Module):
    # Per-slot adapter weights, registered as (non-persistent) buffers in __init__.
    lora_a: torch.Tensor
    lora_b_t: torch.Tensor

    def __init__(
        self,
        base: Linear,
        layer_index: int,
        parts: list[LoRAPart],
        *,
        max_loras: int,
        max_rank: int,
        state: LoRAStepState,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.base = base
        self.layer_index = layer_index
        self.parts = parts
        self.state = state
        width = max_rank * len(parts)
        self.register_buffer(
            "lora_a", torch.zeros(max_loras, width, base.in_features, dtype=dtype, device=device), persistent=False
        )
        self.register_buffer(
            "lora_b_t", torch.zeros(max_loras, width, base.out_features, dtype=dtype, device=device), persistent=False
        )

    @property
    def in_features(self) -> int:
        return self.base.in_features

    @property
    def out_features(self) -> int:
        return self.base.out_features

    @property
    def weight_format(self):
        return self.base.weight_format

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        output = self.base(x)
        batch = self.state.batch
        if batch is None:
            return output
        return self.base.kernels.lora_delta(output, x, self.lora_a, self.lora_b_t, batch, batch.rank * len(self.parts))

    def load_slot(self, slot: int, adapter: LoRAAdapter) -> None:
        """Write the adapter's A and B for this layer into `slot` (zeros where it has none)."""
        self.lora_a[slot].zero_()
        self.lora_b_t[slot].zero_()
        num_parts = len(self.parts)
        for index, part in enumerate(self.parts):
            weights = adapter.modules.get((self.layer_index, part.module))
            if weights is None:
                continue
            rank = weights.rank
            rows = slice(index, index + rank * num_parts, num_parts)
            self.lora_a[slot, rows] = weights.a.to(self.lora_a.device, self.lora_a.dtype)
            self.lora_b_t[slot, rows, part.offset : part.offset + part.size] = weights.b.T.to(
                self.lora_b_t.device, self.lora_b_t.dtype
            )
