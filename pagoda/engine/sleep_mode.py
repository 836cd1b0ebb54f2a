"""Sleep and wake (vLLM's sleep mode): level 1 releases the KV pool's memory, level 2 also the
weights'. The tensors stay the same objects (their storage is resized to nothing and back), so
the runner, attention backend and adapters keep pointing at them.

Level 2 keeps a host copy of the weights on an accelerator; on the CPU (where the host copy
would be the same memory) it drops them and reloads them from their checkpoint on wake, or keeps
them when they came from a trainer (no file holds them). The KV pool's contents are gone after a
wake: the prefix cache is invalidated.
"""

from __future__ import annotations

import ctypes
import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pagoda.errors import InvalidRequest
from pagoda.model.loader import drop_weights
from pagoda.quant.gguf_checkpoint import find_gguf_file

if TYPE_CHECKING:
    from pagoda.engine.engine_core import EngineCore
    from pagoda.engine.weight_updates import WeightUpdates

logger = logging.getLogger(__name__)


class SleepMode:
    def __init__(self, core: EngineCore, weights: WeightUpdates) -> None:
        self.core = core
        self.weights = weights
        self.level = 0  # 0: awake
        self._kv: list[tuple[torch.UntypedStorage, int]] = []  # each released storage and its size
        self._kv_tensors: list[torch.Tensor] = []  # the caches over them
        self._weights: list[tuple[torch.UntypedStorage, int, torch.UntypedStorage | None]] = []
        self._reload_from: str | None = None

    def sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise InvalidRequest(f"level must be 1 or 2, got {level}")
        if self.level:
            raise InvalidRequest(f"the engine is already asleep (level {self.level})")
        if self.core.executor is not None:
            raise InvalidRequest("sleep mode is not supported with tensor or pipeline parallelism yet")
        if self.core.has_unfinished_requests():
            raise InvalidRequest("requests are in flight: pause (mode abort or wait) before sleeping")
        self.core.kv_cache.invalidate_prefix_cache()
        if self.core.scheduler.encoder_cache is not None:  # image features of the old weights (or asleep: freed)
            self.core.scheduler.encoder_cache.clear()
        caches = [t for pair in self.core.runner.distinct_kv_caches for t in pair]
        caches += [t for pair in self.core.speculation.kv_caches for t in pair]
        self._kv, self._kv_tensors = _release(caches), caches
        if level == 2:
            self._release_weights()
        self.level = level
        _empty_cache(self.core.device)
        logger.info("engine asleep (level %d)", level)

    def _release_weights(self) -> None:
        model = self.core.runner.model
        if self.core.device.type == "cpu":
            if not self._reloadable():
                return  # no plain safetensors checkpoint to reload them from, so they stay
            self._reload_from = self.weights.source
            drop_weights(model)
            return
        tensors = list(model.parameters()) + list(model.buffers())
        seen: set[int] = set()
        for tensor in tensors:
            if tensor.is_mkldnn:
                continue
            storage = tensor.untyped_storage()
            if storage.data_ptr() in seen or storage.nbytes() == 0:
                continue
            seen.add(storage.data_ptr())
            self._weights.append((storage, storage.nbytes(), storage.cpu()))
            storage.resize_(0)

    def _reloadable(self) -> bool:
        """Weights read from a safetensors directory into the full-precision format (not a
        trainer's, a GGUF file's or a GPTQ checkpoint's), which wake_up can read again."""
        source = self.weights.source
        layer: Any = self.core.runner.model.get_submodule("model.layers.0.self_attn.o_proj")
        return (
            source is not None
            and Path(source).is_dir()
            and find_gguf_file(source) is None
            and layer.weight_format.name == "full"
        )

    def wake_up(self) -> None:
        if not self.level:
            raise InvalidRequest("the engine is awake")
        if self._reload_from is not None:
            # First, so that a checkpoint gone meanwhile leaves the engine asleep, not empty.
            self.weights.reload_dropped(self._reload_from)
            self._reload_from = None
        for storage, nbytes, host in self._weights:
            storage.resize_(nbytes)
            if host is not None:
                storage.copy_(host)
        for storage, nbytes in self._kv:
            storage.resize_(nbytes)
        for cache in self._kv_tensors:
            # Resized storage holds whatever the allocator hands back: the pool starts zeroed, as
            # at startup (attention's padding positions read unwritten slots).
            cache.zero_()
        self._weights, self._kv, self._kv_tensors = [], [], []
        self.level = 0
        logger.info("engine awake")


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


def _empty_cache(device: torch.device) -> None:
    """Hand freed memory back: CUDA's caching allocator's, and on the CPU glibc's free lists
    (freed chunks inside its heap stay in the process's RSS until trimmed)."""
    if device.type == "cuda":
        torch.cuda.empty_cache()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass  # not glibc
