"""Sleep and wake (vLLM's sleep mode): level 1 releases the KV pool's memory, level 2 also the
weights' (pagoda/worker/released_memory.py), on every tensor-parallel rank.

Level 2 keeps a host copy of the weights on an accelerator; on the CPU (where the host copy
would be the same memory) it drops them and reloads them from their checkpoint on wake, or keeps
them when they came from a trainer (no file holds them). Under tensor parallelism every rank
reloads its shard, or none adopts it and the engine stays asleep. The KV pool's contents are
gone after a wake: the prefix cache is invalidated.
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagoda.errors import InvalidRequest
from pagoda.executor.pipeline import PipelineExecutor
from pagoda.executor.worker import SleepRound
from pagoda.quant.gguf_checkpoint import find_gguf_file
from pagoda.worker.released_memory import ReleasedMemory, empty_cache

if TYPE_CHECKING:
    from pagoda.engine.engine_core import EngineCore
    from pagoda.engine.weight_updates import WeightUpdates

logger = logging.getLogger(__name__)


class SleepMode:
    def __init__(self, core: EngineCore, weights: WeightUpdates) -> None:
        self.core = core
        self.weights = weights
        self.level = 0  # 0: awake
        self._released = ReleasedMemory()
        self._reload_from: str | None = None

    def sleep(self, level: int) -> None:
        if level not in (1, 2):
            raise InvalidRequest(f"level must be 1 or 2, got {level}")
        if self.level:
            raise InvalidRequest(f"the engine is already asleep (level {self.level})")
        executor = self.core.executor
        if isinstance(executor, PipelineExecutor):
            raise InvalidRequest("sleep mode is not supported with pipeline parallelism yet")
        if self.core.has_unfinished_requests():
            raise InvalidRequest("requests are in flight: pause (mode abort or wait) before sleeping")
        self.core.kv_cache.invalidate_prefix_cache()
        if self.core.scheduler.encoder_cache is not None:  # image features of the old weights (or asleep: freed)
            self.core.scheduler.encoder_cache.clear()
        drop = level == 2 and self.core.device.type == "cpu" and self._reloadable()
        if executor is not None:
            executor.sleep_round(SleepRound("sleep", level, drop))
        caches = [t for pair in self.core.runner.distinct_kv_caches for t in pair]
        caches += [t for pair in self.core.speculation.kv_caches for t in pair]
        state = self.core.runner.state_cache  # a hybrid model's recurrent state: nothing running holds it
        if state is not None:
            caches += [t for t in (*state.conv_windows, *state.recurrent) if t is not None]
        self._released.release_kv(caches)
        if level == 2:
            self._reload_from = self.weights.source if drop else None
            self._released.release_weights(self.core.runner.model, self.core.device, drop)
        self.level = level
        empty_cache(self.core.device)
        logger.info("engine asleep (level %d)", level)

    def _reloadable(self) -> bool:
        """Weights read from a safetensors directory into the full-precision format (not a
        trainer's, a GGUF file's or a GPTQ checkpoint's), which wake_up can read again."""
        source = self.weights.source
        layer: Any = self.core.runner.model.first_attention.o_proj
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
        self._released.restore()
        if self.core.executor is not None:
            self.core.executor.sleep_round(SleepRound("wake"))
        graphs = self.core.runner.decode_graphs
        if graphs is not None:
            # A resized storage is a new allocation: graphs captured before the sleep would
            # replay into the old addresses.
            graphs.capture()
        self.level = 0
        logger.info("engine awake")
