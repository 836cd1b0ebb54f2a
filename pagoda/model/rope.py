"""Rotary frequencies of each rope type pagoda runs: plain, linear (Gemma 3's global layers),
Llama 3.1 and LongRoPE (Phi-3).

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


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None, *,
                  long_factors: bool = False) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], computed as transformers does (same float ops);
    long_factors: LongRoPE's long ones (other rope types have one set)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    rope_type = None if scaling is None else scaling["rope_type"]
    if rope_type == "longrope":
        ext_factors = torch.tensor(scaling["long_factor" if long_factors else "short_factor"], dtype=torch.float32)
        return 1.0 / (ext_factors * theta ** exponents)
    inv_freq = 1.0 / (theta ** exponents)
    if rope_type is None:
        return inv_freq
    if rope_type == "linear":
        return inv_freq / float(scaling["factor"])
    return _llama3_inv_freq(inv_freq, scaling)


def rope_attention_factor(scaling: dict[str, Any] | None) -> float:
    """What cos and sin are multiplied by: LongRoPE's attention factor, 1 for the others."""
    if scaling is None or scaling["rope_type"] != "longrope":
        return 1.0
    if scaling.get("attention_factor") is not None:
        return float(scaling["attention_factor"])
    original = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or scaling["max_position_embeddings"] / original
    return 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))


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
