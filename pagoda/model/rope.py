"""Rotary frequencies of each rope type pagoda runs: plain, linear (Gemma 3's global layers),
Llama 3.1 and LongRoPE (Phi-3).

LongRoPE switches from its short to its long factors once a sequence grows past
`original_max_position_embeddings`, and transformers then recomputes the whole sequence with
the long ones. pagoda serves such models within the original context only (the model config
caps `max_position_embeddings` there), so every sequence uses the short factors and a cached
prefix never mixes the two.
"""

from __future__ import annotations

import math
from typing import Any

import torch


def rope_inv_freq(head_dim: int, theta: float, scaling: dict[str, Any] | None) -> torch.Tensor:
    """Inverse frequencies [head_dim / 2], computed as transformers does (same float ops)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim
    rope_type = None if scaling is None else scaling["rope_type"]
    if rope_type == "longrope":
        short_factor = torch.tensor(scaling["short_factor"], dtype=torch.float32)
        return 1.0 / (short_factor * theta ** exponents)
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
