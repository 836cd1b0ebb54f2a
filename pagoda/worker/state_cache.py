"""StateCache: the tensors of a hybrid model's state cache, beside its paged KV cache.

Per recurrent layer the model holds (pagoda.model.gated_delta_net, pagoda.model.mamba2): a short
convolution's window per slot [num_slots, conv_dim, K - 1] in the model dtype, and the recurrent
state per slot in float32 (the delta rule's [Hv, Dk, Dv], Mamba2's SSM state [H, P, N]). A sequence's slot is
assigned by the scheduler's side (pagoda.core.state_slots, `request.state_slot`); each step the
runner hands the model its requests' slots (pagoda.model.linear_state.LinearStateBatch).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

import torch

from pagoda.model.decoder import DecoderModel
from pagoda.model.linear_state import LinearStateBatch
from pagoda.request import Request


class StateSegment(Protocol):
    request: Request
    start: int
    token_ids: list[int]


class StateCache:
    def __init__(self, model: DecoderModel, num_slots: int, dtype: torch.dtype, device: torch.device) -> None:
        linear = model.config.linear_attention
        assert linear is not None, "a hybrid model's config names its recurrent layers"
        width = linear.conv_kernel_size - 1
        self.conv_windows: list[torch.Tensor | None] = []
        self.recurrent: list[torch.Tensor | None] = []
        for layer, is_linear in enumerate(linear.layers):
            held = is_linear and model.stage.holds_layer(layer)
            self.conv_windows.append(
                torch.zeros(num_slots, linear.conv_dim, width, dtype=dtype, device=device) if held else None
            )
            self.recurrent.append(
                torch.zeros(num_slots, *linear.recurrent_shape, dtype=torch.float32, device=device) if held else None
            )

    def batch(
        self, segments: Sequence[StateSegment], snapshots: Sequence[tuple[str, int, int]] = ()
    ) -> LinearStateBatch:
        """The step's view: each request's slot and token rows, whether it starts afresh, and
        where its state is saved into a snapshot slot ((request id, tokens in, slot), prefix caching)."""
        slots, loc, fresh = [], [0], []
        for segment in segments:
            assert segment.request.state_slot is not None, "a running sequence of a hybrid model holds a slot"
            slots.append(segment.request.state_slot)
            loc.append(loc[-1] + len(segment.token_ids))
            fresh.append(segment.start == 0)
        saved: dict[str, list[tuple[int, int]]] = {}
        for request_id, offset, slot in snapshots:
            saved.setdefault(request_id, []).append((offset, slot))
        per_request = [sorted(saved.get(segment.request.request_id, [])) for segment in segments]
        return LinearStateBatch(self.conv_windows, self.recurrent, slots, loc, fresh, per_request)

    def copy(self, copies: list[tuple[int, int]]) -> None:
        """Copy slots' states (source, destination): forked samples start from their lead's."""
        # In order, one by one: a restored snapshot is copied into a lead's slot before the lead's
        # state is copied into its forked samples' slots.
        for source, destination in copies:
            for tensor in (*self.conv_windows, *self.recurrent):
                if tensor is not None:
                    tensor[destination] = tensor[source]
