"""The gated MLP, down(act(gate(x)) * up(x)): a dense layer's feed-forward, one expert of a MoE
block, or its shared expert. Gate and up are fused into one matmul; the loader splits
checkpoints' tensors into it (or takes fused ones as they are). gpt-oss's experts gate with a
clamped SwiGLU instead (`GatedActivation`)."""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.kernels import Kernels
from pagoda.model.layers import Linear
from pagoda.model.parallel import TensorParallelGroup
from pagoda.quant.weight_formats import WeightFormat

ACTIVATIONS = {
    "silu": F.silu,
    "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
    "gelu": F.gelu,
}


@dataclass(frozen=True)
class GatedActivation:
    """act(gate) * up, or with `swiglu_limit` gpt-oss's clamped SwiGLU: gate clamped above and up
    on both sides at the limit, then (up + 1) * gate * sigmoid(alpha * gate), in transformers' order."""

    activation: str
    swiglu_limit: float | None = None
    swiglu_alpha: float = 1.702

    def __call__(self, gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
        if self.swiglu_limit is None:
            return ACTIVATIONS[self.activation](gate) * up
        gate = gate.clamp(min=None, max=self.swiglu_limit)
        up = up.clamp(min=-self.swiglu_limit, max=self.swiglu_limit)
        return (up + 1) * (gate * torch.sigmoid(gate * self.swiglu_alpha))


class MLP(nn.Module):
    def __init__(
        self,
        hidden_size: int,
        intermediate_size: int,
        bias: bool,
        activation: str,
        dtype: torch.dtype,
        device: torch.device,
        weight_format: WeightFormat | None,
        tp: TensorParallelGroup,
        kernels: Kernels,
        reduce: bool = True,
        gated: GatedActivation | None = None,
    ) -> None:
        """tp: the group the weights are split over (a one-rank group: whole). reduce=False leaves
        a split layer's output a partial sum for the caller to reduce (a MoE block reduces its
        experts' sum once). gated: how gate and up combine (default act(gate) * up)."""
        super().__init__()
        gate_up = tp.column(hidden_size, intermediate_size, intermediate_size, what="intermediate_size")
        self.intermediate_size = gate_up.rows[0].size  # this rank's
        self.gate_up_proj = Linear(
            hidden_size, 2 * intermediate_size, bias, dtype, device, weight_format, gate_up, kernels=kernels
        )
        self.down_proj = Linear(
            intermediate_size,
            hidden_size,
            bias,
            dtype,
            device,
            weight_format,
            tp.row(intermediate_size, hidden_size, "intermediate_size"),
            tp.all_reduce if reduce else None,
            kernels=kernels,
        )
        self.gated = gated or GatedActivation(activation)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        gate, up = self.gate_up_proj(x).split(self.intermediate_size, dim=-1)
        return self.down_proj(self.gated(gate, up))
