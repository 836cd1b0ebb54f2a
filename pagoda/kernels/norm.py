"""RMSNorm, alone and with the residual add folded in, per device.

`TorchNorm` is the PyTorch reference (transformers' op order, so float32 outputs match it to
rounding); `NativeNorm` runs float32 rows through pagoda's native kernels and leaves other
dtypes to the reference. unit_offset: Gemma's form, which scales by (1 + weight) and casts
after the product.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from pagoda.native import NativeKernels


class TorchNorm:
    name = "torch"

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            # One fused kernel instead of five; in float32 it computes transformers' ops
            # (mean of squares, rsqrt, scale, weight) with the same results, bit for bit.
            return F.rms_norm(x, weight.shape, 1.0 + weight if unit_offset else weight, eps)
        input_dtype = x.dtype
        if unit_offset:
            x = x.float()
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps)
            return (x * (1.0 + weight.float())).to(input_dtype)
        x = x.to(torch.float32)
        variance = x.pow(2).mean(-1, keepdim=True)
        x = x * torch.rsqrt(variance + eps)
        return weight * x.to(input_dtype)

    def add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        unit_offset: bool,
        pre_weight: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(norm(s), s) for the new residual stream s = residual + x, or residual + norm(x;
        pre_weight) (Gemma's norm of a block's output before the add, with the same eps and
        offset). x is consumed: an implementation may write s into it."""
        summed = residual + (x if pre_weight is None else self.rms_norm(x, pre_weight, eps, unit_offset))
        return self.rms_norm(summed, weight, eps, unit_offset), summed


class NativeNorm(TorchNorm):
    name = "native"

    def __init__(self, native: NativeKernels) -> None:
        self.native = native

    def rms_norm(self, x: torch.Tensor, weight: torch.Tensor, eps: float, unit_offset: bool) -> torch.Tensor:
        if x.dtype == torch.float32 and weight.dtype == torch.float32:
            return self.native.rms_norm(x, weight, eps, unit_offset)
        return super().rms_norm(x, weight, eps, unit_offset)

    def add_rms_norm(
        self,
        x: torch.Tensor,
        residual: torch.Tensor,
        weight: torch.Tensor,
        eps: float,
        unit_offset: bool,
        pre_weight: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if (
            x.dtype == torch.float32
            and weight.dtype == torch.float32
            and x.dim() == 2
            and residual.shape == x.shape
            and residual.dtype == torch.float32
            and (pre_weight is None or pre_weight.dtype == torch.float32)
        ):
            x = x.contiguous()  # the new residual stream is written into the block output's buffer
            out = self.native.add_rms_norm_(x, residual, weight, eps, unit_offset, pre_weight)
            return out, x
        return super().add_rms_norm(x, residual, weight, eps, unit_offset, pre_weight)
