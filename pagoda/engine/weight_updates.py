"""New weights for the served model while it runs, on the engine's thread (so at a step
boundary): from a safetensors directory, or streamed by a trainer over a process group
(pagoda/rl/weight_group.py). Each update is staged first (a fresh model filled and checked:
a missing tensor, a wrong shape or dtype, an unreadable file refuses it with the old weights
serving), then committed (copied in place) and the prefix cache invalidated, so no block computed
with the old weights serves a new request. A replica set stages on every replica before it
commits on any (replicas/replica_set.py).

With tensor parallelism an update from disk runs in rounds over the ranks' control group
(executor/tensor_parallel.py): every rank stages its shard, their outcomes are summed, and rank 0
commits or drops on all of them. Streamed updates and pipeline parallelism are refused for now.
"""

from __future__ import annotations

import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagoda.errors import InvalidRequest
from pagoda.executor.pipeline import PipelineExecutor
from pagoda.model.loader import adopt_weights, checkpoint_items, commit_weights, stage_weights
from pagoda.model.parallel import TensorParallelGroup
from pagoda.rl.weight_group import TensorMeta, WeightGroup, WeightGroupSpec, join, receive

if TYPE_CHECKING:
    from pagoda.engine.engine_core import EngineCore

logger = logging.getLogger(__name__)


class WeightUpdates:
    def __init__(self, core: EngineCore) -> None:
        self.core = core
        self.source: str | None = core.config.model  # where the serving weights came from; None: a trainer
        self.version = 0  # updates committed
        self.group: WeightGroup | None = None
        self._staged: Any = None  # a filled model awaiting commit
        self._staged_source: str | None = None
        self._workers_staged = False  # tensor parallelism: the workers hold a staged shard too

    def _check_updatable(self, streamed: bool = False) -> None:
        executor = self.core.executor
        if isinstance(executor, PipelineExecutor):
            raise InvalidRequest("weight updates are not supported with pipeline parallelism yet")
        if streamed and executor is not None:
            raise InvalidRequest(
                "weights streamed from a trainer are not supported with tensor parallelism yet "
                "(update from disk: every rank stages its shard)"
            )

    def stage_from_disk(self, model_path: str) -> None:
        """Stage a safetensors directory; with tensor parallelism every rank stages its shard and
        a refusal on any rank drops them all."""
        self._check_updatable()
        path = Path(model_path)
        if not path.is_dir():
            raise InvalidRequest(f"model_path {model_path!r} is not a directory")
        executor = self.core.executor
        if executor is None:
            self._stage(_checkpoint(path), str(path))
            return
        self.discard()

        def stage_here() -> str | None:  # raises nothing: every rank must reach the round's all-reduce
            try:
                self._stage(_checkpoint(path), str(path), executor.group)
            except InvalidRequest as error:
                return str(error)
            except Exception as error:  # a bug; still a refusal, so the other ranks drop theirs
                logger.exception("staging weights failed")
                return f"weights not updated: {error!r}"
            return None

        error = executor.stage_weights(str(path), stage_here)
        self._workers_staged = True  # (not before: a refusal on rank 0 discards its own shard only)
        if error is not None:
            self.discard()
            raise InvalidRequest(error if error.startswith("weights not updated") else f"weights not updated: {error}")

    def join_group(self, spec: WeightGroupSpec, rank: int) -> None:
        self._check_updatable(streamed=True)
        if self.group is not None:
            raise InvalidRequest("a weight update group is already joined; destroy it first")
        self.group = join(spec, rank)

    def start(self) -> None:
        """The start phase: what can be checked before the trainer broadcasts."""
        self._check_updatable(streamed=True)
        if self.group is None:
            raise InvalidRequest("no weight update group: call /init_weight_update_group first")
        self.discard()

    def stage_received(self, metas: list[TensorMeta]) -> None:
        """Receive the announced tensors (always all of them: the trainer is broadcasting), then
        stage them."""
        if self.group is None:
            raise InvalidRequest("no weight update group: call /init_weight_update_group first")
        tensors = receive(self.group, metas)
        self._stage(((("trainer", name, tensor, None)) for name, tensor in tensors.items()), None)

    def _stage(self, items: Any, source: str | None, tp: TensorParallelGroup | None = None) -> None:
        core = self.core
        started = time.perf_counter()
        try:
            self._staged = stage_weights(
                core.runner.model,
                items,
                core.model_config,
                core.dtype,
                core.device,
                core.weight_format,
                source or "trainer",
                tp,
            )
        except (ValueError, OSError) as error:
            self.discard()
            raise InvalidRequest(f"weights not updated: {error}") from None
        self._staged_source = source
        logger.info("weights staged from %s in %.2fs", source or "the trainer", time.perf_counter() - started)

    @property
    def staged(self) -> bool:
        return self._staged is not None

    def commit(self) -> None:
        if self._staged is None:
            raise InvalidRequest("no weights are staged")
        commit_weights(self.core.runner.model, self._staged)
        if self._workers_staged:
            assert self.core.executor is not None  # workers staged through it
            self.core.executor.finish_weights(commit=True)
            self._workers_staged = False
        self.source, self._staged, self._staged_source = self._staged_source, None, None
        self.version += 1
        self.core.kv_cache.invalidate_prefix_cache()
        if self.core.scheduler.encoder_cache is not None:  # image features of the old weights (or asleep: freed)
            self.core.scheduler.encoder_cache.clear()
        logger.info("weights updated (version %d)", self.version)

    def reload_dropped(self, model_path: str) -> None:
        """Sleep level 2 on the CPU dropped the weights: load them again from their checkpoint."""
        core = self.core
        try:
            staged = stage_weights(
                core.runner.model,
                checkpoint_items(model_path),
                core.model_config,
                core.dtype,
                core.device,
                core.weight_format,
                model_path,
                check_layout=False,
            )
        except (ValueError, OSError) as error:
            raise InvalidRequest(f"the weights could not be loaded again: {error}") from None
        adopt_weights(core.runner.model, staged)

    def discard(self) -> None:
        self._staged, self._staged_source = None, None
        if self._workers_staged:
            assert self.core.executor is not None
            self.core.executor.finish_weights(commit=False)
            self._workers_staged = False

    def destroy_group(self) -> None:
        self.group = None


def _checkpoint(path: Path) -> Any:
    """The directory's tensors for staging; InvalidRequest when it holds no safetensors checkpoint."""
    try:
        return checkpoint_items(path)
    except (ValueError, OSError) as error:
        raise InvalidRequest(f"weights not updated: {error}") from None
