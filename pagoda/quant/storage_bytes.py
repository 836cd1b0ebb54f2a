"""Bytes the storage formats take, as plain arithmetic (no torch): the one KV-size formula behind
the engine's pool sizing (via ModelConfig.kv_bytes_per_token) and `pagoda plan`, and the weight
bytes per parameter of each weight format. kv_cache_dtype.py and weight_formats.py lay the
tensors out this way; tests/quant check the formulas against the allocated tensors."""

from __future__ import annotations

from typing import get_args

from pagoda.config import KVCacheDType, Quantization, QuantizationGroupSize

KV_CACHE_DTYPES = get_args(KVCacheDType)
# Quantized K/V: each [head_dim] vector stores one byte per element plus its float32 scale;
# fp8 (vLLM's) has one fixed scale per tensor and no bytes per vector beyond its elements.
KV_SCALE_BYTES = 4
KV_PER_TENSOR_SCALE_DTYPES = ("fp8",)
QUANTIZED_KV_ELEMENT_BYTES = 1

# Weight formats (--quantization). int8: one byte per weight plus a 2-byte scale per output row;
# int4: half a byte per weight plus a (scale, zero) pair of 2-byte values per group of inputs.
WEIGHT_QUANTIZATIONS = get_args(Quantization)
INT4_GROUP_SIZES = get_args(QuantizationGroupSize)


def int4_group_size_for(in_features: int) -> int | None:
    """The largest int4 group size that divides a layer's input dimension (None: none does)."""
    return next((g for g in sorted(INT4_GROUP_SIZES, reverse=True) if in_features % g == 0), None)


SCALE_ELEMENT_BYTES = 2


def check_kv_cache_dtype(kv_cache_dtype: str) -> None:
    if kv_cache_dtype not in KV_CACHE_DTYPES:
        raise ValueError(
            f"kv_cache_dtype {kv_cache_dtype!r} is not supported; choose one of {', '.join(KV_CACHE_DTYPES)}"
        )


def kv_entry_bytes(head_dim: int, kv_cache_dtype: str, model_element_bytes: float) -> float:
    """Bytes one key (or value) vector of one KV head takes in the cache."""
    check_kv_cache_dtype(kv_cache_dtype)
    if kv_cache_dtype == "auto":
        return head_dim * model_element_bytes
    if kv_cache_dtype in KV_PER_TENSOR_SCALE_DTYPES:
        return head_dim * QUANTIZED_KV_ELEMENT_BYTES
    return head_dim * QUANTIZED_KV_ELEMENT_BYTES + KV_SCALE_BYTES


def kv_cache_bytes_per_token(
    num_layers: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str, model_element_bytes: float
) -> int:
    """KV cache bytes one token takes: a key and a value vector per KV head in every layer, stored
    as `kv_cache_dtype` ("auto": the model dtype, `model_element_bytes` each)."""
    return int(num_layers * 2 * num_kv_heads * kv_entry_bytes(head_dim, kv_cache_dtype, model_element_bytes))


def latent_kv_bytes_per_token(
    num_layers: int, latent_dim: int, rope_dim: int, kv_cache_dtype: str, model_element_bytes: float
) -> int:
    """KV cache bytes one token takes with multi-head latent attention: per layer one latent and
    one rope key, each a vector of its own (a quantized format scales each apart), shared by
    every head."""
    per_layer = kv_entry_bytes(latent_dim, kv_cache_dtype, model_element_bytes) + kv_entry_bytes(
        rope_dim, kv_cache_dtype, model_element_bytes
    )
    return int(num_layers * per_layer)


def linear_weight_bytes(
    in_features: int, out_features: int, quantization: str, element_bytes: float, group_size: int = 128
) -> float:
    """Bytes one Linear's weight takes in a weight format (element_bytes: the model dtype's)."""
    if quantization == "none":
        return in_features * out_features * element_bytes
    if quantization == "int8":
        return in_features * out_features + out_features * SCALE_ELEMENT_BYTES
    if quantization == "int4":
        return in_features * out_features / 2 + 2 * SCALE_ELEMENT_BYTES * out_features * (in_features // group_size)
    raise ValueError(f"quantization {quantization!r} is not supported; choose one of {', '.join(WEIGHT_QUANTIZATIONS)}")


def weight_bytes_per_parameter(quantization: str, element_bytes: float, group_size: int = 128) -> float:
    """Average bytes per decoder-linear weight, for when only parameter counts are known (`pagoda
    plan`): int8's per-row scales are left out (2 bytes per row of thousands of weights)."""
    if quantization == "int4":
        return 0.5 + 2 * SCALE_ELEMENT_BYTES / group_size
    if quantization == "int8":
        return 1.0
    return linear_weight_bytes(1, 1, quantization, element_bytes)
