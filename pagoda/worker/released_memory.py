"""What sleep mode releases on one rank (the engine core's, or a tensor-parallel worker's) and
gives back on wake: the KV pool's storage, and at level 2 the weights'.

The tensors stay the same objects (their storage is resized to nothing and back), so the
runner, attention backend and adapters keep pointing at them. On an accelerator the weights are
kept in a host copy; on the CPU (where that copy would be the same memory) they are either
dropped (`drop_weights`, reloaded from their checkpoint by the caller before `restore`) or kept.
"""

from __future__ import annotations

import ctypes

import torch

from pagoda.model.loader import drop_weights


class ReleasedMemory:
    def __init__(self) -> None:
        self._kv: list[tuple[torch.UntypedStorage, int]] = []  # each released storage and its size
        self._kv_tensors: list[torch.Tensor] = []  # the caches over them
        self._weights: list[tuple[torch.UntypedStorage, int, torch.UntypedStorage]] = []  # storage, size, host copy

    def release_kv(self, caches: list[torch.Tensor]) -> None:
        self._kv, self._kv_tensors = _release(caches), caches

    def release_weights(self, model: torch.nn.Module, device: torch.device, drop: bool) -> None:
        """Move the weights to host memory (an accelerator), or with `drop` free them (the CPU:
        the caller reloads them before `restore`); on the CPU without `drop` they stay."""
        if device.type == "cpu":
            if drop:
                drop_weights(model)  # type: ignore[arg-type]
            return
        seen: set[int] = set()
        for tensor in list(model.parameters()) + list(model.buffers()):
            if tensor.is_mkldnn:
                continue
            storage = tensor.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            self._weights.append((storage, storage.nbytes(), storage.cpu()))
            storage.resize_(0)

    def restore(self) -> None:
        for storage, nbytes, host in self._weights:
            storage.resize_(nbytes)
            storage.copy_(host)
        for storage, nbytes in self._kv:
            storage.resize_(nbytes)
        for cache in self._kv_tensors:
            # Resized storage holds whatever the allocator hands back: the pool starts zeroed, as
            # at startup (attention's padding positions read unwritten slots).
            cache.zero_()
        self._weights, self._kv, self._kv_tensors = [], [], []


def _release(tensors: list[torch.Tensor]) -> list[tuple[torch.UntypedStorage, int]]:
    released, seen = [], set()
    for tensor in tensors:
        storage = tensor.untyped_storage()
        if storage.data_ptr() in seen or storage.nbytes() == 0:
            continue
        seen.add(storage.data_ptr())
        released.append((storage, storage.nbytes()))
        storage.resize_(0)
    return released


def empty_cache(device: torch.device) -> None:
    """Hand freed memory back: CUDA's caching allocator's, and on the CPU glibc's free lists
    (freed chunks inside its heap stay in the process's RSS until trimmed)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc
