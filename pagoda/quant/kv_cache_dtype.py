"""KV cache storage dtypes: the model dtype (auto), int8, fp8_e4m3, fp8_e5m2 (per-token scales)
and fp8 (one scale per layer, as vLLM's fp8 KV cache).

int8 / fp8_e4m3 / fp8_e5m2 K/V are scaled per token and per KV head: each [head_dim] vector written into the
cache gets its own float32 scale (max|x| / the type's largest value; fp8 values are cast
after scaling, int8 rounded to nearest). Why per token-head rather than per block:

- a token's K/V are quantized exactly once, when written, from values known at that moment;
  a per-block scale would either need re-quantizing the block's earlier tokens when a later
  token exceeds its range (changing cached prefix blocks under readers) or a calibrated static
  scale (outliers then clip);
- the result of a block does not depend on which tokens shared the block, so chunked prefill,
  prefix caching and preemption stay output-neutral within a dtype;
- the cost is 4 bytes per head_dim bytes (6% at head_dim 64, 3% at 128).

Layout: the cache tensor is uint8 [num_blocks, block_size, num_kv_heads, head_dim + 4], each
entry the quantized vector's bytes followed by its float32 scale's bytes. Scales travel with
their values, so block copies, gathers and the pool's accounting need no second tensor.

`fp8` stores e4m3 values with no per-vector scale: exactly one byte per element (4x the fp32
pool's blocks, 2x bf16's), the layout [..., head_dim] of uint8. Its scale is per tensor and
fixed, 1.0 for keys and values of every layer, which is what vLLM uses when a checkpoint brings
no calibrated k/v scales. A float format needs no per-vector scale for precision (e4m3 keeps 3
mantissa bits at every magnitude); the scale only places the range: values beyond +-448 clip
and values below 2^-6 lose bits as subnormals (2^-9 the smallest step). Scales do not depend on
any token, so prefix caching stays output-neutral here as well.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.quant.storage_bytes import KV_SCALE_BYTES as SCALE_BYTES
from pagoda.quant.storage_bytes import check_kv_cache_dtype

# Stored element type and the largest magnitude it represents.
_QUANTIZED = {
    "int8": (torch.int8, 127.0),
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": (torch.float8_e5m2, 57344.0),
    "fp8": (torch.float8_e4m3fn, 448.0),
}
# Formats whose scale is one fixed value per tensor (key or value cache of a layer), not stored.
_PER_TENSOR_SCALE = {"fp8": 1.0}


@dataclass(frozen=True)
class KVCacheFormat:
    """How K/V vectors are stored in the paged cache for one `--kv-cache-dtype`."""

    name: str
    model_dtype: torch.dtype

    @property
    def quantized(self) -> bool:
        return self.name != "auto"

    @property
    def scale_per_token(self) -> bool:
        """Each cached vector carries its own float32 scale after its values."""
        return self.quantized and self.name not in _PER_TENSOR_SCALE

    @property
    def tensor_scale(self) -> float:
        """The fixed scale of a per-tensor format (1.0 otherwise: unused)."""
        return _PER_TENSOR_SCALE.get(self.name, 1.0)

    @property
    def element_dtype(self) -> torch.dtype:
        """The type the quantized values are stored as (the model dtype for auto)."""
        return _QUANTIZED[self.name][0] if self.quantized else self.model_dtype

    @property
    def largest(self) -> float:
        """The largest magnitude the stored type represents (quantized formats)."""
        return _QUANTIZED[self.name][1]

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8 if self.quantized else self.model_dtype

    def entry_size(self, head_dim: int) -> int:
        """Last dimension of the cache tensor for vectors of `head_dim`."""
        return head_dim + SCALE_BYTES if self.scale_per_token else head_dim

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """[..., head_dim] in the model dtype -> cache entries [..., entry_size]."""
        if not self.quantized:
            return values
        element_dtype, largest = _QUANTIZED[self.name]
        values = values.float()
        # Divisors as tensors on the values' device: CUDA divides by a Python scalar as a
        # multiplication by its reciprocal, which rounds differently from the IEEE division the
        # CPU and the Triton kernels do, and the cache must hold the same bytes on every backend.
        if not self.scale_per_token:
            tensor_scale = torch.full((), self.tensor_scale, dtype=torch.float32, device=values.device)
            stored = (values / tensor_scale).clamp(-largest, largest).to(element_dtype)
            return stored.view(torch.uint8)
        largest_value = torch.full((), largest, dtype=torch.float32, device=values.device)
        scales = values.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / largest_value
        scaled = values / scales
        if element_dtype == torch.int8:
            stored = torch.round(scaled).clamp(-127, 127).to(torch.int8)
        else:
            stored = scaled.clamp(-largest, largest).to(element_dtype)
        return torch.cat([stored.view(torch.uint8), scales.view(torch.uint8)], dim=-1)

    def decode(self, entries: torch.Tensor) -> torch.Tensor:
        """Cache entries [..., entry_size] -> values [..., head_dim] in the model dtype."""
        if not self.quantized:
            return entries
        element_dtype, _ = _QUANTIZED[self.name]
        if not self.scale_per_token:
            return (entries.view(element_dtype).float() * self.tensor_scale).to(self.model_dtype)
        head_dim = entries.shape[-1] - SCALE_BYTES
        stored = entries[..., :head_dim].contiguous().view(element_dtype)
        scales = entries[..., head_dim:].contiguous().view(torch.float32)
        return (stored.float() * scales).to(self.model_dtype)


def make_kv_cache_format(name: str, model_dtype: torch.dtype) -> KVCacheFormat:
    check_kv_cache_dtype(name)
    return KVCacheFormat(name, model_dtype)
