"""MXFP4 (OCP microscaling FP4), as gpt-oss's Hub checkpoints store their experts: dequantized
at load into the model's weight format.

A weight [..., rows, K] is stored as `blocks` [..., rows, K / 32, 16] uint8, two FP4 (e2m1)
codes per byte, the low nibble first, and `scales` [..., rows, K / 32] uint8, one e8m0 exponent
(biased by 127) per 32 values: value = FP4(code) * 2 ** (scale - 127).
"""

from __future__ import annotations

import torch

# The 16 e2m1 codes: sign bit, two exponent bits, one mantissa bit.
FP4_VALUES = (0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0, -0.0, -0.5, -1.0, -1.5, -2.0, -3.0, -4.0, -6.0)
BLOCK_SIZE = 32  # values per scale
SCALE_BIAS = 127


def dequantize_mxfp4(blocks: torch.Tensor, scales: torch.Tensor, name: str = "tensor") -> torch.Tensor:
    """blocks [..., G, 16] uint8 and scales [..., G] uint8 -> float32 [..., G * 32]."""
    if blocks.dtype != torch.uint8 or scales.dtype != torch.uint8:
        raise ValueError(f"{name}: MXFP4 blocks and scales must be uint8, got {blocks.dtype} and {scales.dtype}")
    if blocks.shape[-1] != BLOCK_SIZE // 2 or tuple(blocks.shape[:-1]) != tuple(scales.shape):
        raise ValueError(
            f"{name}: MXFP4 blocks {tuple(blocks.shape)} do not fit scales {tuple(scales.shape)} "
            f"(expected blocks [..., G, {BLOCK_SIZE // 2}] with scales [..., G])"
        )
    table = torch.tensor(FP4_VALUES, dtype=torch.float32, device=blocks.device)
    values = torch.stack((table[(blocks & 0x0F).long()], table[(blocks >> 4).long()]), dim=-1)
    values = values.reshape(*blocks.shape[:-1], BLOCK_SIZE)
    exponents = scales.to(torch.int32) - SCALE_BIAS
    return torch.ldexp(values, exponents.unsqueeze(-1)).reshape(*scales.shape[:-1], -1)
