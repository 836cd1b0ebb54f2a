"""KV cache storage dtypes: the model dtype (auto), int8, fp8_e4m3, fp8_e5m2.

Quantized K/V are scaled per token and per KV head: each [head_dim] vector written into the
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
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

KV_CACHE_DTYPES = ("auto", "int8", "fp8_e4m3", "fp8_e5m2")
SCALE_BYTES = 4
# Stored element type and the largest magnitude it represents.
_QUANTIZED = {
    "int8": (torch.int8, 127.0),
    "fp8_e4m3": (torch.float8_e4m3fn, 448.0),
    "fp8_e5m2": (torch.float8_e5m2, 57344.0),
}


@dataclass(frozen=True)
class KVCacheFormat:
    """How K/V vectors are stored in the paged cache for one `--kv-cache-dtype`."""

    name: str
    model_dtype: torch.dtype

    @property
    def quantized(self) -> bool:
        return self.name != "auto"

    @property
    def storage_dtype(self) -> torch.dtype:
        return torch.uint8 if self.quantized else self.model_dtype

    def entry_size(self, head_dim: int) -> int:
        """Last dimension of the cache tensor for vectors of `head_dim`."""
        return head_dim + SCALE_BYTES if self.quantized else head_dim

    def bytes_per_token(self, num_layers: int, num_kv_heads: int, head_dim: int) -> int:
        """Cache bytes one token takes across all layers, keys and values."""
        element = torch.tensor([], dtype=self.storage_dtype).element_size()
        return 2 * num_layers * num_kv_heads * self.entry_size(head_dim) * element

    def encode(self, values: torch.Tensor) -> torch.Tensor:
        """[..., head_dim] in the model dtype -> cache entries [..., entry_size]."""
        if not self.quantized:
            return values
        element_dtype, largest = _QUANTIZED[self.name]
        values = values.float()
        scales = values.abs().amax(dim=-1, keepdim=True).clamp(min=1e-12) / largest
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
        head_dim = entries.shape[-1] - SCALE_BYTES
        stored = entries[..., :head_dim].contiguous().view(element_dtype)
        scales = entries[..., head_dim:].contiguous().view(torch.float32)
        return (stored.float() * scales).to(self.model_dtype)


def make_kv_cache_format(name: str, model_dtype: torch.dtype) -> KVCacheFormat:
    if name not in KV_CACHE_DTYPES:
        raise ValueError(f"kv_cache_dtype {name!r} is not supported; choose one of {', '.join(KV_CACHE_DTYPES)}")
    return KVCacheFormat(name, model_dtype)


def kv_cache_bytes_per_token(num_layers: int, num_kv_heads: int, head_dim: int, kv_cache_dtype: str,
                             model_dtype: torch.dtype) -> int:
    """What `pagoda plan` needs: KV bytes per token for a model shape and a --kv-cache-dtype."""
    return make_kv_cache_format(kv_cache_dtype, model_dtype).bytes_per_token(num_layers, num_kv_heads, head_dim)
