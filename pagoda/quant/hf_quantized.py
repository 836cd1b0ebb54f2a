"""Hugging Face checkpoints that carry a `quantization_config` in config.json.

Detected before loading so that an unsupported method is one clear error naming the file and
what is supported, not a confusing "unexpected tensor qweight" later.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

SUPPORTED_HF_METHODS: tuple[str, ...] = ()


def checkpoint_quantization(model_dir: Path) -> dict[str, Any] | None:
    """The checkpoint's quantization_config, or None for a full-precision checkpoint."""
    config_path = model_dir / "config.json"
    if not config_path.is_file():
        return None
    try:
        config = json.loads(config_path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{config_path}: not valid JSON ({error})") from None
    quantization = config.get("quantization_config")
    return quantization if isinstance(quantization, dict) else None


def check_checkpoint_quantization(model_dir: Path) -> None:
    quantization = checkpoint_quantization(model_dir)
    if quantization is None:
        return
    method = quantization.get("quant_method", "(no quant_method)")
    if method in SUPPORTED_HF_METHODS:
        return
    supported = ", ".join(SUPPORTED_HF_METHODS) or "none yet"
    raise ValueError(f"{model_dir / 'config.json'}: checkpoint quantization {method!r} is not supported "
                     f"(quantized Hugging Face formats pagoda loads: {supported}); use a full-precision "
                     f"checkpoint with --quantization int8|int4, or a GGUF file")
