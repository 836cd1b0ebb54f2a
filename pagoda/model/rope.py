"""Rotary frequencies of each rope type pagoda runs: plain, linear (Gemma 3's global layers),
Llama 3.1, LongRoPE (Phi-3) and YaRN (gpt-oss).

LongRoPE chooses its factors per sequence, as transformers does: a sequence of at most
`original_max_position_embeddings` tokens (its boundary) runs on the short factors; one that is
longer runs on the long factors from position 0, so a sequence that grows past the boundary
while decoding has its KV recomputed (pagoda.core.scheduler). The rotary tables hold the short
rows (positions below the boundary) followed by the long rows (every position), and each token
reads its row: position, or boundary + position on the long factors
(ModelConfig.long_rope_boundary).
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(
    head_dim: int, theta: float, scaling: dict[str, Any] | None, *, long_factors: bool = False
) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], computed as transformers does (same float ops);
    long_factors: LongRoPE's long ones (other rope types have one set)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    rope_type = None if scaling is None else scaling["rope_type"]
    if scaling is not None and rope_type == "longrope":
        ext_factors = torch.tensor(scaling["long_factor" if long_factors else "short_factor"], dtype=torch.float32)
        return 1.0 / (ext_factors * theta**exponents)
    inv_freq = 1.0 / (theta**exponents)
    if scaling is None or rope_type is None:
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    if rope_type == "yarn":
        return _yarn_inv_freq(head_dim, theta, scaling)
    return _llama3_inv_freq(inv_freq, scaling)


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: LongRoPE's and YaRN's attention factor, 1 for the others."""
    if scaling is None or scaling["rope_type"] not in ("longrope", "yarn"):
        return 1.0
    if scaling["rope_type"] == "yarn":
        return _yarn_attention_factor(scaling)
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


def yarn_attention_mscale(scaling: dict[str, Any] | None) -> float:
    """DeepSeek's softmax scale factor under a scaled rope: mscale(factor, mscale_all_dim), which
    multiplies the softmax scale twice (transformers' yarn_apply_mscale); 1 without it."""
    if scaling is None or not scaling.get("mscale_all_dim"):
        return 1.0
    factor = float(scaling["factor"])
    return 1.0 if factor <= 1 else 0.1 * float(scaling["mscale_all_dim"]) * math.log(factor) + 1.0


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    # Llama 3.1: stretch low frequencies by `factor`, keep high ones, blend in between.
    factor = float(scaling["factor"])
    low_freq_factor = float(scaling.get("low_freq_factor", 1.0))
    high_freq_factor = float(scaling.get("high_freq_factor", 4.0))
    old_context = float(scaling.get("original_max_position_embeddings", 8192))
    low_freq_wavelen = old_context / low_freq_factor
    high_freq_wavelen = old_context / high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_context / wavelen - low_freq_factor) / (high_freq_factor - low_freq_factor)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _yarn_factor(scaling: dict[str, Any]) -> float:
    if scaling.get("factor") is not None:
        return float(scaling["factor"])
    return scaling["max_position_embeddings"] / scaling["original_max_position_embeddings"]


def _yarn_attention_factor(scaling: dict[str, Any]) -> float:
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    factor = _yarn_factor(scaling)

    def mscale(scale: float, m: float = 1.0) -> float:
        return 1.0 if scale <= 1 else 0.1 * m * math.log(scale) + 1.0

    if scaling.get("mscale") and scaling.get("mscale_all_dim"):
        return float(mscale(factor, scaling["mscale"]) / mscale(factor, scaling["mscale_all_dim"]))
    return mscale(factor)


def _yarn_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any]) -> torch.Tensor:
    # YaRN: interpolate (divide by `factor`) the low frequencies, keep (extrapolate) the high
    # ones, with a linear ramp over the dimensions between beta_fast and beta_slow rotations
    # within the original context.
    factor = _yarn_factor(scaling)
    original = scaling["original_max_position_embeddings"]
    beta_fast = scaling.get("beta_fast") or 32
    beta_slow = scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return (head_dim * math.log(original / (rotations * 2 * math.pi))) / (2 * math.log(theta))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, head_dim - 1)
    if low == high:
        high += 0.001  # no zero-width ramp
    ramp = torch.clamp((torch.arange(head_dim // 2, dtype=torch.float32) - low) / (high - low), 0, 1)
    pos_freqs = theta ** (torch.arange(0, head_dim, 2).to(dtype=torch.float) / head_dim)
    extrapolation = 1.0 / pos_freqs
    interpolation = 1.0 / (factor * pos_freqs)
    extrapolation_factor = 1 - ramp
    return interpolation * (1 - extrapolation_factor) + extrapolation * extrapolation_factor
