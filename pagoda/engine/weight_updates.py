"""New weights for the served model while it runs, on the engine's thread (so at a step
boundary): from a safetensors directory, or streamed by a trainer over a process group
(pagoda/rl/weight_group.py). Each update is staged first (a fresh model filled and checked:
a missing tensor, a wrong shape or dtype, an unreadable file refuses it with the old weights
serving), then committed (copied in place) and the prefix cache invalidated, so no block computed
with the old weights serves a new request. A replica set stages on every replica before it
commits on any (replicas/replica_set.py).

With tensor parallelism an update runs in rounds over the ranks' control group
(executor/tensor_parallel.py): every rank stages its shard (of the directory, or of each
tensor rank 0 received from the trainer and relays to them), their outcomes are summed, and
rank 0 commits or drops on all of them. Pipeline parallelism is refused for now.

Streamed tensors may also be saved as a safetensors snapshot (`snapshot`, a directory the
caller names): a replica restarted later loads the weights from it (replicas/supervisor.py). It
is written on a thread of its own once the update is committed (written beside, then renamed:
the directory appears whole), so generation resumes at once; a newer commit abandons it.
"""

from __future__ import annotations

import json
import logging
import shutil
import struct
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from pagoda.errors import InvalidRequest
from pagoda.executor.pipeline import PipelineExecutor
from pagoda.executor.worker import WeightsRound
from pagoda.model.loader import (
    adopt_weights,
    build_empty_model,
    checkpoint_items,
    commit_weights,
    receive_targets,
    stage_weights,
)
from pagoda.model.parallel import TensorParallelGroup
from pagoda.rl.weight_group import DTYPES, TensorMeta, Transfer, WeightGroup, WeightGroupSpec, join, receive

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
        # The staged update's snapshot: where, and its tensors (held until written).
        self._staged_snapshot: tuple[Path, dict[str, torch.Tensor]] | None = None
        # The last commit's snapshot being written, and the event that abandons it.
        self._snapshot_writer: tuple[threading.Thread, threading.Event] | None = None
        self._workers_staged = False  # tensor parallelism: the workers hold a staged shard too

    def _check_updatable(self) -> None:
        if isinstance(self.core.executor, PipelineExecutor):
            raise InvalidRequest("weight updates are not supported with pipeline parallelism yet")

    def stage_from_disk(self, model_path: str) -> None:
        """Stage a safetensors directory; with tensor parallelism every rank stages its shard and
        a refusal on any rank drops them all."""
        self._check_updatable()
        path = Path(model_path)
        if not path.is_dir():
            raise InvalidRequest(f"model_path {model_path!r} is not a directory")
        self.discard()
        self._staged = self._stage_everywhere(
            WeightsRound("stage", str(path)), lambda: checkpoint_items(path), str(path)
        )
        self._staged_source = str(path)

    def join_group(self, spec: WeightGroupSpec, rank: int) -> None:
        self._check_updatable()
        if self.group is not None:
            raise InvalidRequest("a weight update group is already joined; destroy it first")
        self.group = join(spec, rank)

    def start(self) -> None:
        """The start phase: what can be checked before the trainer broadcasts."""
        self._check_updatable()
        if self.group is None:
            raise InvalidRequest("no weight update group: call /init_weight_update_group first")
        self.discard()

    def stage_received(self, metas: list[TensorMeta], snapshot: str | None = None) -> None:
        """Receive the announced tensors (always all of them: the trainer is broadcasting) and
        stage them (on every rank); with `snapshot` (a directory that does not exist yet), save
        them there once committed."""
        if self.group is None:
            raise InvalidRequest("no weight update group: call /init_weight_update_group first")
        self.discard()
        if self.core.executor is None:
            self._stage_as_received(metas, snapshot)
            return
        tensors = receive(self.group, metas)
        _check_new(snapshot)  # (only now: the trainer's broadcasts are always received)
        source = snapshot
        message = WeightsRound(
            "stage_streamed", "", [m.name for m in metas], [m.dtype for m in metas], [list(m.shape) for m in metas]
        )
        try:
            self._staged = self._stage_everywhere(
                message,
                lambda: (("trainer", name, tensor, None) for name, tensor in tensors.items()),
                source,
                list(tensors.values()),
            )
        except InvalidRequest:
            self.discard()
            raise
        self._staged_source = source
        if snapshot is not None:
            self._staged_snapshot = (Path(snapshot), tensors)

    def _stage_as_received(self, metas: list[TensorMeta], snapshot: str | None) -> None:
        """One rank: fill (and pack) each tensor into the staged model as it arrives, while the
        next ones are received (kept for the snapshot, if asked for)."""
        assert self.group is not None, "checked by the caller"
        core = self.core
        fresh = build_empty_model(
            core.model_config, core.dtype, core.device, core.weight_format, "trainer", kernels=core.runner.model.kernels
        )
        announced = [(m.name, DTYPES[m.dtype], m.shape) for m in metas]
        into = receive_targets(fresh, core.model_config, announced)
        transfer = Transfer(self.group, metas, into, keep=snapshot is not None)
        try:
            items = lambda: (("trainer", name, tensor, None) for name, tensor in transfer)  # noqa: E731
            staged = self._stage(items, None, None, True, fresh)
        finally:
            transfer.drain()
        _check_new(snapshot)
        self._staged, self._staged_source = staged, snapshot
        if snapshot is not None:
            self._staged_snapshot = (Path(snapshot), transfer.tensors)

    def _stage_everywhere(
        self,
        message: WeightsRound,
        items: Callable[[], Any],
        source: str | None,
        tensors: list[torch.Tensor] | None = None,
        check_layout: bool = True,
    ) -> Any:
        """A model filled with `items()` on this rank, and with tensor parallelism the workers'
        shards of what `message` names staged too (their refusal raises, after they dropped
        what they staged)."""
        executor = self.core.executor
        if executor is None:
            return self._stage(items, source, None, check_layout)
        staged = None

        def stage_here() -> str | None:  # raises nothing: every rank must reach the round's all-reduce
            nonlocal staged
            try:
                staged = self._stage(items, source, executor.group, check_layout)
            except InvalidRequest as error:
                return str(error)
            except Exception as error:  # a bug; still a refusal, so the other ranks drop theirs
                logger.exception("staging weights failed")
                return f"weights not updated: {error!r}"
            return None

        error = executor.stage_weights(message, stage_here, tensors)
        self._workers_staged = True  # (not before: a refusal on rank 0 discards its own shard only)
        if error is not None:
            self.discard()
            raise InvalidRequest(error if error.startswith("weights not updated") else f"weights not updated: {error}")
        return staged

    def _stage(
        self,
        items: Callable[[], Any],
        source: str | None,
        tp: TensorParallelGroup | None,
        check_layout: bool,
        fresh: Any = None,
    ) -> Any:
        core = self.core
        started = time.perf_counter()
        try:
            staged = stage_weights(
                core.runner.model,
                items(),
                core.model_config,
                core.dtype,
                core.device,
                core.weight_format,
                source or "trainer",
                tp,
                check_layout=check_layout,
                fresh=fresh,
            )
        except (ValueError, OSError) as error:
            raise InvalidRequest(f"weights not updated: {error}") from None
        logger.info("weights staged from %s in %.2fs", source or "the trainer", time.perf_counter() - started)
        return staged

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
        if self._staged_snapshot is not None:
            # One snapshot in flight (each holds a model's tensors): the previous update's is
            # out of date now, so it is abandoned rather than waited for.
            self.wait_snapshot(abandon=True)
            directory, tensors = self._staged_snapshot
            self._staged_snapshot = None
            abandoned = threading.Event()
            writer = threading.Thread(
                target=_save_snapshot, args=(tensors, directory, abandoned), name="pagoda-weights-snapshot", daemon=True
            )
            writer.start()
            self._snapshot_writer = (writer, abandoned)
        logger.info("weights updated (version %d)", self.version)

    def reload_dropped(self, model_path: str) -> None:
        """Sleep level 2 on the CPU dropped the weights (on every rank): load them again from
        their checkpoint, on every rank or none."""
        items = lambda: checkpoint_items(model_path)  # noqa: E731
        try:
            staged = self._stage_everywhere(WeightsRound("reload", model_path), items, model_path, check_layout=False)
        except InvalidRequest as error:
            raise InvalidRequest(
                f"the weights could not be loaded again: {str(error).removeprefix('weights not updated: ')}"
            ) from None
        adopt_weights(self.core.runner.model, staged)
        if self._workers_staged:
            assert self.core.executor is not None
            self.core.executor.finish_weights(commit=True)
            self._workers_staged = False

    def discard(self) -> None:
        self._staged, self._staged_source = None, None
        self._staged_snapshot = None
        if self._workers_staged:
            assert self.core.executor is not None
            self.core.executor.finish_weights(commit=False)
            self._workers_staged = False

    def destroy_group(self) -> None:
        self.group = None

    def wait_snapshot(self, abandon: bool = False) -> None:
        """Until the last committed update's snapshot is written (or failed: logged), or with
        `abandon` stopped at its next tensor and removed."""
        if self._snapshot_writer is not None:
            writer, abandoned = self._snapshot_writer
            if abandon:
                abandoned.set()
            writer.join()
            self._snapshot_writer = None


def _save_snapshot(tensors: dict[str, torch.Tensor], directory: Path, abandoned: threading.Event) -> None:
    """Write the streamed tensors as a safetensors checkpoint at `directory`: beside it first,
    then renamed, so a directory there is always whole. A failure is logged (a restarted replica
    then cannot load the weights, and says so); once `abandoned` is set it stops and removes it."""
    partial = _partial(directory)
    started = time.perf_counter()
    try:
        partial.mkdir(parents=True)
        if not _write_safetensors(tensors, partial / "model.safetensors", abandoned):
            shutil.rmtree(partial, ignore_errors=True)
            logger.info("the weights' snapshot %s was abandoned for a newer update's", directory)
            return
        partial.rename(directory)
    except OSError:
        logger.exception("the weights' snapshot %s could not be written", directory)
        shutil.rmtree(partial, ignore_errors=True)
        return
    logger.info("weights' snapshot written to %s in %.2fs", directory, time.perf_counter() - started)


_SAFETENSORS_DTYPES = {torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16"}


def _write_safetensors(tensors: dict[str, torch.Tensor], path: Path, abandoned: threading.Event) -> bool:
    """The safetensors format written straight from the tensors' memory (a little-endian header
    length, the JSON header, then each tensor's bytes): `safetensors.torch.save_file` first copies
    every tensor into a Python bytes object, holding the GIL the engine's thread needs. False
    when `abandoned` was set before the last tensor."""
    header: dict[str, Any] = {"__metadata__": {"format": "pt"}}
    hosted, offset = [], 0
    for name, tensor in tensors.items():
        host = tensor.detach().to("cpu").contiguous()
        size = host.numel() * host.element_size()
        header[name] = {
            "dtype": _SAFETENSORS_DTYPES[host.dtype],
            "shape": list(host.shape),
            "data_offsets": [offset, offset + size],
        }
        hosted.append(host)
        offset += size
    encoded = json.dumps(header, separators=(",", ":")).encode()
    encoded += b" " * (-len(encoded) % 8)  # the data starts 8-byte aligned
    with open(path, "wb") as file:
        file.write(struct.pack("<Q", len(encoded)))
        file.write(encoded)
        for host in hosted:
            if abandoned.is_set():
                return False
            if host.numel():
                file.write(host.view(-1).view(torch.uint8).numpy().data)
    return True


def _check_new(snapshot: str | None) -> None:
    if snapshot is not None and (Path(snapshot).exists() or _partial(Path(snapshot)).exists()):
        raise InvalidRequest(f"weights not updated: the snapshot directory {snapshot!r} already exists")


def _partial(directory: Path) -> Path:
    return directory.with_name(directory.name + ".partial")
