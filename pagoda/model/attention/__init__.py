"""Attention backends. `select_backend` picks one for a device."""

from __future__ import annotations

import torch

from pagoda.model.attention.backend import AttentionBackend, AttentionLayerSpec, BatchLayout
from pagoda.quant.kv_cache_dtype import KVCacheFormat

__all__ = ["AttentionBackend", "AttentionLayerSpec", "BatchLayout", "select_backend"]


def select_backend(name: str, device: torch.device, kv_format: KVCacheFormat | None = None) -> AttentionBackend:
    """`auto` means Triton on CUDA when it is installed, the torch reference otherwise. A
    quantized KV cache (int8/fp8) is read by the torch backend only so far."""
    quantized_kv = kv_format is not None and kv_format.quantized
    if quantized_kv and name == "triton":
        raise ValueError(f"kv_cache_dtype {kv_format.name} is supported by the torch attention backend only "
                         f"(use --attention-backend torch or auto)")
    if name in ("auto", "triton") and device.type == "cuda" and not quantized_kv:
        try:
            from pagoda.model.attention.triton_backend import TritonAttentionBackend
        except ImportError:
            if name == "triton":
                raise ValueError("attention_backend=triton needs the `triton` package "
                                 "(pip install 'pagoda[gpu]')") from None
        else:
            return TritonAttentionBackend()
    if name == "triton" and device.type != "cuda":
        raise ValueError("attention_backend=triton needs a CUDA device")
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"attention_backend must be auto, torch or triton, got {name!r}")
    from pagoda.model.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(kv_format)
