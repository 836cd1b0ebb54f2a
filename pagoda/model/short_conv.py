"""ShortConv: the short causal depthwise convolution ahead of a linear-attention (or state-space)
layer's mixing, with its weights as checkpoints name them (`conv1d.weight` [C, 1, K], an
optional `conv1d.bias`). Computed by the kernels' causal convolution (pagoda.kernels.causal_conv)
over each sequence's carried window."""

from __future__ import annotations

import torch
from torch import nn

from pagoda.kernels import Kernels


class ShortConv(nn.Module):
    def __init__(
        self, channels: int, width: int, bias: bool, dtype: torch.dtype, device: torch.device, kernels: Kernels
    ) -> None:
        super().__init__()
        self.width = width
        self.kernels = kernels
        self.weight = nn.Parameter(torch.empty(channels, 1, width, dtype=dtype, device=device), requires_grad=False)
        self.bias = (
            nn.Parameter(torch.empty(channels, dtype=dtype, device=device), requires_grad=False) if bias else None
        )

    def prefill(self, x: torch.Tensor, window: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's tokens x [T, C] after its window (None: zeros) -> (y, new window)."""
        return self.kernels.causal_conv.prefill(x, window, self.weight[:, 0], self.bias)

    def step(self, x: torch.Tensor, windows: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """One token of each of B sequences x [B, C] after their windows [B, C, K - 1]."""
        return self.kernels.causal_conv.step(x, windows, self.weight[:, 0], self.bias)
