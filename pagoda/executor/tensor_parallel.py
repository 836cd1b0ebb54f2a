"""Rank 0's side of tensor parallelism: start the other ranks, hand them each step, notice
when one dies, stop them.

Rank 0 runs in the engine core's process, on the engine's thread, like vLLM's multiproc
executor's driver worker: the scheduler's step goes to the local model runner, which
broadcasts the flattened batch (`StepInputs`) to the workers just before its own forward, so
a step costs one broadcast and no extra process hop; sampling, grammars and logprobs stay on
rank 0 with the scheduler (the LM head's logits are all-gathered to every rank).

A dead worker ends the engine: the step in flight fails at its next collective (gloo sees the
closed socket), and a watcher reports a death that happens while the engine is idle through
the callbacks registered with `on_failure` (the transports turn it into the engine's death:
/health 503, in-flight requests failed). `shutdown` stops the workers; a finalizer does it
too when the executor is dropped or the interpreter exits.
"""

from __future__ import annotations

import logging
import threading
import weakref
from collections.abc import Callable
from typing import TYPE_CHECKING

import torch

from pagoda.config import EngineConfig
from pagoda.core.kv_cache_groups import KVCacheGroup
from pagoda.executor.channel import ChannelCodec, new_secret
from pagoda.executor.group import Endpoint, Groups, broadcast_object, host_store, join, wait_for_workers
from pagoda.executor.worker import (
    KVSetup,
    RankMessage,
    SleepRound,
    StepInputs,
    WeightsRound,
    WorkerSpec,
    agree_staged,
    layout_to,
)
from pagoda.kernels.attention import BatchLayout
from pagoda.model.loader import load_model_config
from pagoda.model.parallel import TensorParallelGroup
from pagoda.model.pipeline import PipelineStage

if TYPE_CHECKING:  # each backend is imported where it is chosen
    from pagoda.executor.process_workers import ProcessWorkers
    from pagoda.executor.ray_workers import RayWorkers

logger = logging.getLogger(__name__)

STARTUP_TIMEOUT_S = 300.0
STOP_TIMEOUT_S = 10.0


class TensorParallelError(RuntimeError):
    """A tensor-parallel worker (or pipeline stage) died: the engine cannot step any more."""


class TensorParallelExecutor:
    def __init__(
        self,
        config: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
        num_threads: int,
        stages: list[PipelineStage] | None = None,
    ) -> None:
        """Start ranks 1..N-1 and join the group as rank 0 (returns once all have joined).
        Each worker resolves the weight format and native kernels from `config` as rank 0 did.
        `num_threads`: each worker computes with as many threads as rank 0 (engine/threads.py).
        `stages`: the ranks are these pipeline stages instead, each of tensor_parallel_size
        ranks (pagoda.executor.pipeline)."""
        stage_ranks = config.tensor_parallel_size  # pipeline stages: a tensor-parallel group each
        world_size = len(stages) * stage_ranks if stages is not None else stage_ranks
        what = "pipeline parallelism" if stages is not None else "tensor parallelism"
        if config.enable_expert_parallel and stages is None:  # before any worker starts
            model_config = load_model_config(config.model)
            if model_config.moe is not None:
                TensorParallelGroup(0, world_size, object(), expert_parallel=True).experts(model_config.moe.num_experts)
        ray_backend = config.distributed_executor_backend == "ray"
        if ray_backend:
            from pagoda.executor.ray_workers import RayWorkers, node_address

            host = node_address(config.ray_address)
        else:
            host = "127.0.0.1"
        store = host_store(host, world_size, STARTUP_TIMEOUT_S)
        secret = new_secret()  # this deployment's: signs every control message
        self.codec = ChannelCodec(secret)
        specs = [
            WorkerSpec(
                config,
                rank,
                world_size,
                Endpoint(host, store.port),
                _worker_device(device, rank),
                dtype,
                num_threads,
                STARTUP_TIMEOUT_S,
                secret,
                stages[rank // stage_ranks] if stages is not None else None,
            )
            for rank in range(1, world_size)
        ]
        self.workers: RayWorkers | ProcessWorkers
        if ray_backend:
            self.workers = RayWorkers(specs, config.ray_address)
        else:
            from pagoda.executor.process_workers import ProcessWorkers

            self.workers = ProcessWorkers(specs)
        self._failure: str | None = None
        self._callbacks: list[Callable[[str], None]] = []
        self._lock = threading.Lock()
        self._finalizer = weakref.finalize(self, self.workers.kill)
        # Weakly: the watcher threads must not keep a dropped executor (and its workers) alive.
        on_exit = weakref.WeakMethod(self._on_worker_exit)
        self.workers.watch(lambda rank, why: _call_alive(on_exit, rank, why))
        try:
            wait_for_workers(store, world_size, lambda: self._failure, STARTUP_TIMEOUT_S, what)
            self.groups: Groups = join(
                0, world_size, device, store, config.enable_expert_parallel, stage_ranks if stages is not None else None
            )
        except BaseException:
            self._finalizer()
            raise
        self.device = device
        logger.info(
            "%s: %d %s (%s backend), %d threads each%s",
            what,
            world_size // stage_ranks if stages is not None else world_size,
            "stages" if stages is not None else "ranks",
            config.distributed_executor_backend,
            num_threads,
            ", experts placed whole (expert parallelism)" if config.enable_expert_parallel else "",
        )

    @property
    def group(self) -> TensorParallelGroup:
        """Rank 0's group, for its model."""
        return self.groups.model

    @property
    def failure(self) -> str | None:
        return self._failure

    def on_failure(self, callback: Callable[[str], None]) -> None:
        """Call `callback(reason)` once if a worker dies (now, if one already has)."""
        with self._lock:
            failure = self._failure
            if failure is None:
                self._callbacks.append(callback)
        if failure is not None:
            callback(failure)

    def start_serving(self, num_blocks: int, kv_groups: list[KVCacheGroup]) -> None:
        """Tell the workers the pool size and its groups, so each allocates its slice of every block."""
        self._broadcast(KVSetup(num_blocks, kv_groups))

    def broadcast_step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        layouts: list[BatchLayout],
        logit_rows: list[int],
        block_copies: list[tuple[int, int]],
    ) -> None:
        """Hand one forward to the workers (called by rank 0's runner just before its own)."""
        host = torch.device("cpu")
        if self.device.type != "cpu":  # the step travels from the host
            input_ids, positions = input_ids.to(host), positions.to(host)
            layouts = [layout_to(layout, host) for layout in layouts]
        self._broadcast(RankMessage(step=StepInputs(input_ids, positions, layouts, logit_rows, list(block_copies))))

    def stage_weights(
        self, message: WeightsRound, stage_here: Callable[[], str | None], tensors: list[torch.Tensor] | None = None
    ) -> str | None:
        """A weight update's first round: every worker stages its shard of what `message` names
        (a checkpoint directory, or `tensors`, streamed from a trainer to rank 0 and relayed here
        in the order `message` announces them) while `stage_here` stages rank 0's (returning its
        refusal, or None); the refusal, or None when every rank staged. Then `finish_weights`
        commits or drops them everywhere."""
        self._broadcast(RankMessage(weights=message))
        for tensor in tensors or []:
            try:
                self.groups.control.broadcast(tensor.to("cpu").contiguous(), 0).wait()
            except RuntimeError as broken:
                raise TensorParallelError(self._failure or f"the workers' group failed: {broken}") from None
        error = stage_here()
        failures = agree_staged(self.groups.control, error is None)
        if error is None and failures:
            return f"{failures} tensor-parallel rank(s) could not stage the weights (their logs say why)"
        return error

    def finish_weights(self, commit: bool) -> None:
        self._broadcast(RankMessage(weights=WeightsRound("commit" if commit else "discard")))

    def sleep_round(self, message: SleepRound) -> None:
        """Sleep or wake every worker (engine/sleep_mode.py)."""
        self._broadcast(RankMessage(sleep=message))

    def shutdown(self) -> None:
        """Stop the workers (the stop message, then a kill for any that lingers)."""
        if not self._finalizer.alive:
            return
        if self._failure is None:
            try:
                self._send_stop()
            except RuntimeError:
                pass  # a worker is gone: the kill below ends the others
        self.workers.stop(STOP_TIMEOUT_S)
        self._finalizer()

    def _send_stop(self) -> None:
        self._broadcast(None)

    def _broadcast(self, obj: object) -> None:
        if self._failure is not None:
            raise TensorParallelError(self._failure)
        try:
            broadcast_object(self.groups.control, self.codec, obj, 0)
        except RuntimeError as error:  # a peer's socket closed under the collective
            raise TensorParallelError(self._failure or f"the workers' group failed: {error}") from None

    def _on_worker_exit(self, rank: int, reason: str) -> None:
        with self._lock:
            if self._failure is not None:
                return
            self._failure = reason
            callbacks, self._callbacks = self._callbacks, []
        logger.error("%s; the engine stops", reason)
        self.workers.kill()  # the others cannot step without it
        for callback in callbacks:
            callback(reason)


def _call_alive(method: weakref.WeakMethod, rank: int, why: str) -> None:
    bound = method()
    if bound is not None:
        bound(rank, why)


def _worker_device(device: torch.device, rank: int) -> str:
    """One CUDA device per rank (cuda:0 is rank 0's); CPU ranks share the host."""
    return f"cuda:{rank}" if device.type == "cuda" else "cpu"
