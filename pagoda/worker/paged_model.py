"""A model with its own paged KV cache: what every rank of a tensor-parallel model, the model
runner and a draft model (spec_decode) hold. Its own module so that a tensor-parallel worker
(pagoda.executor) builds one without importing the runner's sampling and grammar machinery.

KV tensors: one key and one value tensor per layer, [num_blocks, block_size, num_kv_heads,
head_dim], num_kv_heads being the rank's share with tensor parallelism.
"""

from __future__ import annotations

import torch

from pagoda.model.attention import AttentionBackend, BatchLayout
from pagoda.model.llama import ForwardContext, LlamaFamilyModel
from pagoda.quant.kv_cache_dtype import KVCacheFormat


def allocate_kv_caches(model: LlamaFamilyModel, num_blocks: int, block_size: int, dtype: torch.dtype,
                       device: torch.device, kv_format: KVCacheFormat | None = None
                       ) -> list[tuple[torch.Tensor, torch.Tensor]]:
    config = model.config
    kv_format = kv_format or KVCacheFormat("auto", dtype)
    shape = (num_blocks, block_size, model.num_kv_heads, kv_format.entry_size(config.head_dim))  # the rank's heads
    storage = kv_format.storage_dtype
    return [(torch.zeros(shape, dtype=storage, device=device), torch.zeros(shape, dtype=storage, device=device))
            for _ in range(config.num_layers)]


class PagedModel:
    """A model with its own paged KV cache. The runner holds the target model's; a draft model
    (spec_decode) holds its own, indexed by the same block ids and slots. `kv_format` is how the
    caches store K/V (--kv-cache-dtype; None: the model dtype) and must be the backend's."""

    def __init__(self, model: LlamaFamilyModel, backend: AttentionBackend, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, kv_format: KVCacheFormat | None = None) -> None:
        backend.check_layers([layer.self_attn.spec for layer in model.model.layers], model.config.architecture)
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.kv_format = kv_format
        self.kv_caches = allocate_kv_caches(model, num_blocks, block_size, dtype, device, kv_format)
        self.sliding_windows = set(model.config.layer_sliding_windows)

    def forward_context(self, layout: BatchLayout) -> ForwardContext:
        """Attention metadata for one batch, over this model's caches."""
        metadata = self.backend.prepare(layout, self.sliding_windows)
        return ForwardContext(self.backend, metadata, self.kv_caches)
