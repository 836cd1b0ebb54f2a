"""Rotate-half rotary embedding of a step's q and k heads, per device.

rotate_half(x) * sin is computed as roll(x) * sin_rolled, where sin_rolled is sin with its first
half negated (pagoda.model.layers.RotaryEmbedding builds the tables): the same products with the
sign moved to the table, so results are bit-identical to transformers' form with one op fewer.
`NativeRotary` rotates float32 heads in place with pagoda's native kernel (the q and k columns of
the fused qkv output, no copy), with the same products, bit for bit.
"""

from __future__ import annotations

import torch

from pagoda.native import NativeKernels


class TorchRotary:
    name = "torch"

    def __call__(self, heads: torch.Tensor, cos: torch.Tensor, sin_rolled: torch.Tensor) -> torch.Tensor:
        """heads [T, N, D] with the step's cos and sin_rolled rows [T, 1, D]; the heads are
        consumed (an implementation may rotate them in place)."""
        return heads * cos + heads.roll(heads.shape[-1] // 2, dims=-1) * sin_rolled


class NativeRotary(TorchRotary):
    name = "native"

    def __init__(self, native: NativeKernels) -> None:
        self.native = native

    def __call__(self, heads: torch.Tensor, cos: torch.Tensor, sin_rolled: torch.Tensor) -> torch.Tensor:
        if heads.dtype == torch.float32 and cos.dtype == torch.float32 and heads.stride(-1) == 1:
            self.native.rotary_(heads, cos, sin_rolled)
            return heads
        return super().__call__(heads, cos, sin_rolled)
