"""Gemma 2 and Gemma 3 (text): the shared decoder with Gemma's norms (RMSNorm scaling by
(1 + w), a norm after attention and two around the MLP), embeddings scaled by sqrt(hidden),
tied embeddings unless the config says otherwise, and local layers sliding over a window.
Gemma 3 adds per-head q/k norms and a rope base of its own for the local layers
(`rope_local_base_freq`, or transformers 5's per-layer-type `rope_parameters`)."""

from __future__ import annotations

from typing import Any

from pagoda.model.families.base import ModelFamily
from pagoda.model.hf_config import HFConfig, windows_from_max_window_layers
from pagoda.model.model_config import ModelConfig

_GEMMA2, _GEMMA3 = "Gemma2ForCausalLM", "Gemma3ForCausalLM"


def _every_nth_layer_global(hf: HFConfig, window: int, num_layers: int) -> list[int | None]:
    """Configs older than `layer_types`: every `sliding_window_pattern`-th layer is global, the
    others slide."""
    pattern = int(hf.get("sliding_window_pattern") or (2 if hf.architecture == _GEMMA2 else 6))
    return [window if (i + 1) % pattern else None for i in range(num_layers)]


def read_config(hf: HFConfig) -> ModelConfig:
    # A Gemma-like architecture pagoda does not run (read by its model_type for `pagoda plan`) keeps
    # the shared reading's windows: its layer pattern is not known.
    gemma3 = hf.architecture == _GEMMA3 or hf.model_type == "gemma3_text"
    known = hf.architecture in (_GEMMA2, _GEMMA3)
    return hf.decoder(
        qk_norm=gemma3,
        sliding_windows=_every_nth_layer_global if known else windows_from_max_window_layers,
        gemma_norms=True,
        tie_word_embeddings=True,
        scale_embeddings=True,
        # transformers' defaults where a config names no base; Gemma 3's checkpoints name the
        # local layers' base `rope_local_base_freq`
        default_rope_theta=1e6 if gemma3 else 10000.0,
        default_sliding_rope_theta=_optional_float(hf.get("rope_local_base_freq")) or (10000.0 if gemma3 else None),
    )


def _optional_float(value: Any) -> float | None:
    return None if value is None else float(value)


FAMILY = ModelFamily(read_config=read_config)
