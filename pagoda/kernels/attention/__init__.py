"""Attention backends. `select_backend` picks one for a device."""

from __future__ import annotations

import torch

from pagoda.kernels.attention.backend import AttentionBackend, AttentionLayerSpec, BatchLayout
from pagoda.native import NativeKernels
from pagoda.quant.kv_cache_dtype import KVCacheFormat

__all__ = ["AttentionBackend", "AttentionLayerSpec", "BatchLayout", "select_backend"]


def select_backend(
    name: str, device: torch.device, kv_format: KVCacheFormat | None = None, native: NativeKernels | None = None
) -> AttentionBackend:
    """`auto` means Triton on CUDA when it is installed, the torch reference otherwise. Both
    read every KV cache dtype (`kv_format`; None: the model dtype). With `native` (the CPU
    kernels), the torch backend attends decode-sized requests through the native kernel."""
    if name in ("auto", "triton") and device.type == "cuda":
        try:
            from pagoda.kernels.attention.triton_backend import TritonAttentionBackend
        except ImportError:
            if name == "triton":
                raise ValueError(
                    "attention_backend=triton needs the `triton` package (pip install 'pagoda[gpu]')"
                ) from None
        else:
            return TritonAttentionBackend(kv_format=kv_format)
    if name == "triton" and device.type != "cuda":
        raise ValueError("attention_backend=triton needs a CUDA device")
    if name not in ("auto", "torch", "triton"):
        raise ValueError(f"attention_backend must be auto, torch or triton, got {name!r}")
    from pagoda.kernels.attention.torch_backend import TorchAttentionBackend

    return TorchAttentionBackend(kv_format, native)
