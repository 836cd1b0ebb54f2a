"""The short causal depthwise convolution of linear-attention and state-space layers, per
device: over a sequence's new tokens after its carried window, and the single-token update.

Each channel c convolves its last K inputs with its own K weights (plus a bias), then SiLU:
    y_t[c] = silu(sum_j w[c, j] * x_{t-K+1+j}[c] + b[c])
A sequence carries the K - 1 inputs before its next token (zeros before its first), so a
prompt computed in chunks gives what one pass gives. `naive_causal_conv` is the per-token
reference.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F


def naive_causal_conv(
    x: torch.Tensor, window: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None
) -> tuple[torch.Tensor, torch.Tensor]:
    """x [T, C], window [C, K - 1] (None: zeros), weight [C, K] -> (y [T, C], new window)."""
    width = weight.shape[1]
    history = torch.zeros(x.shape[1], width - 1, dtype=x.dtype) if window is None else window.clone()
    out = torch.empty_like(x)
    for t in range(x.shape[0]):
        inputs = torch.cat((history, x[t].unsqueeze(1)), dim=1)  # [C, K]
        y = (inputs * weight).sum(dim=1) + (0 if bias is None else bias)
        out[t] = F.silu(y)
        history = inputs[:, 1:]
    return out, history


class TorchCausalConv:
    """The causal convolution in PyTorch ops (transformers' conv1d form)."""

    name = "torch"

    def prefill(
        self, x: torch.Tensor, window: torch.Tensor | None, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One sequence's new tokens x [T, C] after its window [C, K - 1] (None: a first chunk,
        zeros). Returns (y [T, C], the window after them [C, K - 1])."""
        width = weight.shape[1]
        columns = x.transpose(0, 1)  # [C, T]
        if window is None:
            window = torch.zeros(x.shape[1], width - 1, dtype=x.dtype, device=x.device)
        full = torch.cat((window.to(x.dtype), columns), dim=1)  # [C, K - 1 + T]
        y = F.conv1d(full.unsqueeze(0).to(weight.dtype), weight.unsqueeze(1), bias, groups=x.shape[1])
        return F.silu(y[0]).transpose(0, 1).to(x.dtype), full[:, full.shape[1] - (width - 1) :]

    def step(
        self, x: torch.Tensor, windows: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """One token of each of B sequences, x [B, C], after their windows [B, C, K - 1].
        Returns (y [B, C], the new windows)."""
        inputs = torch.cat((windows.to(x.dtype), x.unsqueeze(-1)), dim=-1)  # [B, C, K]
        y = (inputs.to(weight.dtype) * weight).sum(dim=-1)
        if bias is not None:
            y = y + bias
        return F.silu(y).to(x.dtype), inputs[..., 1:]
