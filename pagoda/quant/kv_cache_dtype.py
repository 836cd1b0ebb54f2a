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

from pagoda.quant.storage_bytes import KV_CACHE_DTYPES, check_kv_cache_dtype, kv_cache_bytes_per_token
from pagoda.quant.storage_bytes import KV_SCALE_BYTES as SCALE_BYTES
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
        """Cache bytes one token takes across all layers, keys and values (storage_bytes' formula)."""
        element = torch.tensor([], dtype=self.model_dtype).element_size()
        return kv_cache_bytes_per_token(num_layers, num_kv_heads, head_dim, self.name, element)

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
    check_kv_cache_dtype(name)
    return KVCacheFormat(name, model_dtype)

