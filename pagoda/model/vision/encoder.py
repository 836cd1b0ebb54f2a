"""The vision encoder interface and the activations vision configs name."""

from __future__ import annotations

import torch
from torch import nn


def activation(name: str) -> nn.Module:
    """The activations vision configs name (transformers' ACT2FN spellings)."""
    if name == "quick_gelu":
        return _QuickGELU()
    if name in ("gelu", "gelu_new", "gelu_pytorch_tanh"):
        return nn.GELU(approximate="none" if name == "gelu" else "tanh")
    if name == "silu":
        return nn.SiLU()
    raise ValueError(f"vision activation {name!r} is not supported")


class _QuickGELU(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class VisionEncoder(nn.Module):
    """One image's pixels in, its placeholder rows out: [num_placeholder_tokens, text hidden]."""

    def encode(self, pixel_values: torch.Tensor, grid: tuple[int, ...]) -> torch.Tensor:
        raise NotImplementedError
