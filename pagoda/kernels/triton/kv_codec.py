"""Quantized KV cache entries in Triton: encode on write, decode inside attention.

The layouts are pagoda.quant.kv_cache_dtype's (the torch backend's): a uint8 cache whose entries
are the quantized vector's bytes, followed, for the per-token formats (int8, fp8_e4m3,
fp8_e5m2), by the vector's float32 scale; `fp8` (e4m3) has one fixed scale per tensor instead.
The kernels write bit for bit what `KVCacheFormat.encode` writes (IEEE divisions, ties to even)
so that both backends read the same cache.

fp8 is converted with integer arithmetic on the bits, not with Triton's float8 types: sm_80 has
no e4m3 conversions, and the CPU interpreter's fp32 -> fp8 cast drops the carry when rounding
crosses a power of two (7.85 -> 4.0 instead of 8.0). Decoding goes through float16, which holds
every e4m3 and e5m2 value exactly.
"""

from __future__ import annotations

from dataclasses import dataclass

import triton
import triton.language as tl

from pagoda.quant.kv_cache_dtype import KVCacheFormat

# KV_QUANT: how the cache stores vectors.
MODEL_DTYPE = 0  # the model dtype, no scale
PER_TOKEN_SCALE = 1  # 1-byte elements + a float32 scale per [head_dim] vector
PER_TENSOR_SCALE = 2  # 1-byte elements, one scale per tensor passed to the kernel
# KV_TYPE: the 1-byte element type.
INT8, FP8_E4M3, FP8_E5M2 = 0, 1, 2
_ELEMENT_TYPES = {"int8": INT8, "fp8_e4m3": FP8_E4M3, "fp8_e5m2": FP8_E5M2, "fp8": FP8_E4M3}


@dataclass(frozen=True)
class KVCacheEncoding:
    """What the kernels need to know about a `KVCacheFormat` (their constexprs and scales)."""

    mode: int = MODEL_DTYPE
    element: int = INT8
    largest: float = 1.0
    key_scale: float = 1.0  # PER_TENSOR_SCALE only
    value_scale: float = 1.0

    @staticmethod
    def of(kv_format: KVCacheFormat | None) -> KVCacheEncoding:
        if kv_format is None or not kv_format.quantized:
            return KVCacheEncoding()
        mode = PER_TOKEN_SCALE if kv_format.scale_per_token else PER_TENSOR_SCALE
        return KVCacheEncoding(
            mode, _ELEMENT_TYPES[kv_format.name], kv_format.largest, kv_format.tensor_scale, kv_format.tensor_scale
        )


@triton.jit
def _round_half_even(x):
    """Round to the nearest integer, ties to even (torch.round); exact for |x| < 2^22."""
    r = tl.floor(x + 0.5)
    tie_to_odd = ((r - x) == 0.5) & ((r.to(tl.int32) & 1) != 0)
    return tl.where(tie_to_odd, r - 1.0, r)


@triton.jit
def _fp8_bits(y, KV_TYPE: tl.constexpr):
    """float32 values already within the type's range -> the e4m3fn / e5m2 bit patterns (int32),
    rounded to nearest, ties to even."""
    if KV_TYPE == 1:
        MANT: tl.constexpr = 3
        BIAS: tl.constexpr = 7
        MIN_NORMAL: tl.constexpr = 0.015625  # 2^-6
        SUBNORMAL_STEPS: tl.constexpr = 512.0  # 1 / 2^-9
    else:
        # Triton compiles only the branch KV_TYPE selects, and a constexpr must be declared with
        # its annotation: each branch declares its own (a redefinition to Python, not to Triton).
        MANT: tl.constexpr = 2  # type: ignore[no-redef]
        BIAS: tl.constexpr = 15  # type: ignore[no-redef]
        MIN_NORMAL: tl.constexpr = 0.00006103515625  # type: ignore[no-redef]  # 2^-14
        SUBNORMAL_STEPS: tl.constexpr = 65536.0  # type: ignore[no-redef]  # 1 / 2^-16
    DROP: tl.constexpr = 23 - MANT
    bits = y.to(tl.int32, bitcast=True)
    sign = (bits >> 31) & 1
    magnitude = bits & 0x7FFFFFFF
    # Normal: round the float32 mantissa to MANT bits (a carry moves into the exponent), then
    # rebias the exponent from 127 to BIAS.
    rounded = magnitude + ((1 << (DROP - 1)) - 1) + ((magnitude >> DROP) & 1)
    normal = (rounded >> DROP) - ((127 - BIAS) << MANT)
    # Subnormal: a whole number of the smallest steps (rounding up to MIN_NORMAL gives its bits).
    absolute = magnitude.to(tl.float32, bitcast=True)
    subnormal = _round_half_even(tl.minimum(absolute, MIN_NORMAL) * SUBNORMAL_STEPS).to(tl.int32)
    return tl.where(absolute < MIN_NORMAL, subnormal, normal) | (sign << 7)


@triton.jit
def encode_vectors(x, KV_TYPE: tl.constexpr, LARGEST: tl.constexpr):
    """float32 values, already divided by their scale -> the stored bytes (uint8)."""
    if KV_TYPE == 0:
        return _round_half_even(x).to(tl.int8).to(tl.uint8, bitcast=True)
    clipped = tl.minimum(tl.maximum(x, -LARGEST), LARGEST)
    return _fp8_bits(clipped, KV_TYPE).to(tl.uint8)


@triton.jit
def decode_bytes(stored, KV_TYPE: tl.constexpr):
    """Stored bytes (uint8) -> the unscaled values, exactly, as float16."""
    if KV_TYPE == 0:
        return stored.to(tl.int8, bitcast=True).to(tl.float16)
    wide = stored.to(tl.uint16)
    if KV_TYPE == 1:
        # e4m3's sign, exponent and mantissa moved into float16's fields: the value / 2^8
        # (exponent bias 15 vs 7), subnormals included.
        bits = ((wide & 0x80) << 8) | ((wide & 0x7F) << 7)
        return bits.to(tl.float16, bitcast=True) * 256.0
    return (wide << 8).to(tl.float16, bitcast=True)  # e5m2 is float16's upper byte
