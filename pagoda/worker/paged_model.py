"""A model with its own paged KV cache: what every rank of a tensor-parallel model, the model
runner and a draft model (spec_decode) hold. Its own module so that a tensor-parallel worker
(pagoda.executor) builds one without importing the runner's sampling and grammar machinery.

KV tensors: one key and one value tensor per layer of a KV cache group, [num_blocks,
block_size, num_kv_heads, head_dim], num_kv_heads being the rank's share with tensor
parallelism; layer i of every group uses the i-th pair (pagoda.core.kv_cache_groups), so
without sliding-window release (one group) each layer has its own. A latent attention model
(pagoda.model.mla) holds per layer its latents [num_blocks, block_size, 1, kv_lora_rank] and
rope keys [..., 1, qk_rope_head_dim] as the pair (ModelConfig.kv_cache_dims).
"""

from __future__ import annotations

import ctypes
import functools
import mmap
import sys
from collections.abc import Sequence

import torch

from pagoda.core.kv_cache_groups import KVCacheGroup
from pagoda.kernels.attention import AttentionBackend, AttentionLayerSpec, BatchLayout
from pagoda.model.decoder import DecoderModel, ForwardContext
from pagoda.quant.kv_cache_dtype import KVCacheFormat

_MADV_DONTNEED = 4  # Linux: the pages read as zeros again and take no RAM until written


def allocate_kv_caches(
    model: DecoderModel,
    num_blocks: int,
    block_size: int,
    dtype: torch.dtype,
    device: torch.device,
    kv_format: KVCacheFormat | None = None,
    groups: Sequence[KVCacheGroup] | None = None,
) -> list[tuple[torch.Tensor, torch.Tensor] | None]:
    """Per layer (key_cache, value_cache); layers at the same place in different groups share them
    (None for the layers of other pipeline stages)."""
    config = model.config
    groups = groups or single_group(model)
    kv_format = kv_format or KVCacheFormat("auto", dtype)
    num_kv_heads = model.num_kv_heads  # the rank's heads
    assert isinstance(num_kv_heads, int), "read from the model's attention layers"
    key_dim, value_dim = config.kv_cache_dims
    key_shape = (num_blocks, block_size, num_kv_heads, kv_format.entry_size(key_dim))
    value_shape = (num_blocks, block_size, num_kv_heads, kv_format.entry_size(value_dim))
    storage = kv_format.storage_dtype
    # A pipeline stage allocates only the places its own layers use; other stages' layers get None.
    pairs: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    caches: list[tuple[torch.Tensor, torch.Tensor] | None] = [None] * config.num_layers
    for group in groups:
        for place, layer in enumerate(group.layers):
            if model.stage.holds_layer(layer):
                if place not in pairs:
                    pairs[place] = (
                        zeroed_cache(key_shape, storage, device),
                        zeroed_cache(value_shape, storage, device),
                    )
                caches[layer] = pairs[place]
    return caches


def zeroed_cache(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A zero-filled cache tensor. On Linux CPUs its whole pages are handed back to the kernel
    (madvise MADV_DONTNEED), which maps them as zero pages again on first write: a pool sized from
    the free memory (--kv-cache-memory auto, pagoda.core.kv_memory) takes RAM as its blocks are
    used, not all at start. The storage stays torch's own (sleep mode resizes it)."""
    tensor = torch.empty(shape, dtype=dtype, device=device)
    if device.type != "cpu" or not _release_pages(tensor):
        tensor.zero_()
    return tensor


def _release_pages(tensor: torch.Tensor) -> bool:
    """Zero `tensor` by releasing the pages wholly inside it and clearing the bytes of the pages it
    shares at either end; False where madvise is not available (the caller zeroes it)."""
    libc = _libc()
    if libc is None:
        return False
    start, nbytes = tensor.data_ptr(), tensor.numel() * tensor.element_size()
    page = mmap.PAGESIZE
    first, last = -(-start // page) * page, (start + nbytes) // page * page
    if last > first and libc.madvise(ctypes.c_void_p(first), ctypes.c_size_t(last - first), _MADV_DONTNEED) != 0:
        return False
    raw = tensor.view(-1).view(torch.uint8)
    if last > first:
        raw[: first - start].zero_()
        raw[last - start :].zero_()
    else:
        raw.zero_()
    return True


@functools.cache
def _libc() -> ctypes.CDLL | None:
    if sys.platform != "linux":
        return None
    try:
        libc = ctypes.CDLL(None, use_errno=True)
        libc.madvise.argtypes = (ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int)
        return libc
    except (OSError, AttributeError):
        return None


def single_group(model: DecoderModel) -> list[KVCacheGroup]:
    """Every layer that keeps KV in one group whose blocks are kept."""
    return [KVCacheGroup(model.config.kv_layers)]


class PagedModel:
    """A model with its own paged KV cache. The runner holds the target model's; a draft model
    (spec_decode) holds its own, indexed by the same block ids and slots. `kv_format` is how the
    caches store K/V (--kv-cache-dtype; None: the model dtype) and must be the backend's."""

    def __init__(
        self,
        model: DecoderModel,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        kv_format: KVCacheFormat | None = None,
        groups: Sequence[KVCacheGroup] | None = None,
    ) -> None:
        specs: list[AttentionLayerSpec] = []
        kv_layers = set(model.config.kv_layers)  # a hybrid model's linear-attention layers keep no KV
        for i in (i for i in model.stage.layers if i in kv_layers):
            spec = model.get_submodule(f"model.layers.{i}.self_attn").spec
            assert isinstance(spec, AttentionLayerSpec), "every attention layer describes itself"
            specs.append(spec)
        backend.check_layers(specs, model.config.architecture)
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        self.kv_format = kv_format
        self.kv_groups = list(groups or single_group(model))
        self.kv_caches = allocate_kv_caches(model, num_blocks, block_size, dtype, device, kv_format, self.kv_groups)
        windows = model.config.layer_sliding_windows
        self.sliding_windows = set(windows)
        # The attention windows of each group's layers (masks differ from the release window
        # when one group holds every layer).
        self.group_windows = [{windows[layer] for layer in group.layers} for group in self.kv_groups]

    @property
    def distinct_kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """Each cache tensor pair once (groups share them)."""
        return list({id(pair[0]): pair for pair in self.kv_caches if pair is not None}.values())

    def forward_context(self, layouts: Sequence[BatchLayout]) -> ForwardContext:
        """Attention metadata for one batch (one layout per KV cache group), over this model's caches."""
        metadata: list[object] = [None] * len(self.kv_caches)
        for group, layout, windows in zip(self.kv_groups, layouts, self.group_windows):
            prepared = self.backend.prepare(layout, windows)
            for layer in group.layers:
                metadata[layer] = prepared
        return ForwardContext(self.backend, metadata, self.kv_caches)
