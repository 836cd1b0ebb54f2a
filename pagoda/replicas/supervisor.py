"""Supervision of one engine (a replica, or a server's single engine): notice its death, reap it,
and start it again with exponential backoff within a restart budget.

An `EngineSupervisor` owns the engine's `AsyncLLM` and swaps in a fresh one once a restart is
ready, so whoever holds the supervisor (ReplicaSet's replicas, SupervisedEngine) always reads
the current engine through `supervisor.llm`. The replacement gets the engine config the first
engine resolved (same label, seed, role and --max-num-seqs); what it learns at startup (its pid,
a decode replica's KV listener address) is its own. It is not in service until its engine
reported ready and the adapters loaded at runtime were loaded on it again.

Deaths are restarted with a delay of `backoff`, doubled for every restart already made within
the window (capped); when `max_restarts` restarts were made within the window, the engine stays
down ("failed") and says why. An engine shut down on purpose is never restarted.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagoda.config import DeploymentConfig, EngineConfig
from pagoda.engine.async_llm import AsyncLLM
from pagoda.kv_transfer.disk_store import remove_files_written_since
from pagoda.lora_request import LoRARequest
from pagoda.model.classifier_config import ClassifierConfig
from pagoda.replicas.weights_source import WeightsSource

logger = logging.getLogger(__name__)

# Builds an engine from its config (the caller picks transport or Ray); raises if it cannot start.
EngineStarter = Callable[[EngineConfig], AsyncLLM]

# How often a supervisor looks at its engine; a death is also seen at once by the requests it fails.
WATCH_INTERVAL_S = 0.1
# How long a restarted engine waits for the latest streamed update's snapshot to be written.
SNAPSHOT_WAIT_S = 300.0
# The longest wait between restarts, however many were made.
MAX_BACKOFF_S = 60.0


@dataclass(frozen=True)
class RestartPolicy:
    """When a dead engine is started again (DeploymentConfig's restart fields)."""

    enabled: bool = True
    max_restarts: int = 5  # within `window`; then the engine stays down
    window: float = 600.0  # seconds
    backoff: float = 1.0  # seconds before the first restart; doubled per recent restart

    @classmethod
    def of(cls, deployment: DeploymentConfig) -> RestartPolicy:
        return cls(
            enabled=deployment.restart,
            max_restarts=deployment.max_replica_restarts,
            window=deployment.replica_restart_window,
            backoff=deployment.replica_restart_backoff,
        )

    def delay(self, recent_restarts: int) -> float:
        """Seconds to wait before the next restart, after `recent_restarts` within the window."""
        return min(self.backoff * 2**recent_restarts, max(MAX_BACKOFF_S, self.backoff))


@dataclass(frozen=True)
class EngineState:
    """One supervised engine as /health shows it."""

    pid: int | None
    alive: bool
    status: str  # ok, restarting, failed (restart budget spent) or dead (not restarted)
    restarts: int
    error: str | None = None

    def as_dict(self) -> dict[str, Any]:
        state: dict[str, Any] = {"pid": self.pid, "alive": self.alive, "status": self.status, "restarts": self.restarts}
        if self.error is not None:
            state["error"] = self.error
        return state


class EngineKeeper:
    """Starts one engine on a thread of its own, which then lives as long as the engine.

    Engines load side by side (each takes seconds), but an engine process is killed when the
    thread that spawned it exits (PR_SET_PDEATHSIG, engine/parent_watch.py): so the thread that
    starts an engine waits, parked, until the engine is shut down."""

    def __init__(self, start: Callable[[], AsyncLLM], name: str) -> None:
        self._started = threading.Event()
        self._release = threading.Event()
        self._llm: AsyncLLM | None = None
        self._error: BaseException | None = None
        threading.Thread(target=self._run, args=(start,), name=name, daemon=True).start()

    def _run(self, start: Callable[[], AsyncLLM]) -> None:
        try:
            self._llm = start()
        except BaseException as exc:
            self._error = exc
        finally:
            self._started.set()
        self._release.wait()

    def result(self) -> AsyncLLM:
        """The started engine; raises what stopped it from starting."""
        self._started.wait()
        if self._error is not None:
            raise self._error
        assert self._llm is not None
        return self._llm

    def stop(self, timeout: float | None = 10.0) -> None:
        """Shut the engine down (if it started; a dead process is reaped) and let the thread end."""
        self._started.wait()
        try:
            if self._llm is not None:
                self._llm.shutdown(timeout)
        finally:
            self._release.set()


class EngineSupervisor:
    """Keeps one engine running: restarts it when it dies, within `policy`."""

    def __init__(
        self,
        keeper: EngineKeeper,
        starter: EngineStarter,
        label: str,
        policy: RestartPolicy,
        *,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        """`keeper` holds the first engine (started; raises here if it failed); `starter` builds
        each replacement from the first engine's resolved config."""
        self.label = label
        self.policy = policy
        self._keeper = keeper
        try:
            self.llm: AsyncLLM = keeper.result()
        except BaseException:
            keeper.stop()
            raise
        self._config = self.llm.config
        # When the running engine started (wall clock, as file times are), at the latest: what
        # it wrote to a disk KV tier is newer, and is removed if it dies (see _reap).
        self._engine_started = time.time()
        self._starter = starter
        self._clock = clock
        self.restarts = 0  # restarts attempted since start
        self._recent: collections.deque[float] = collections.deque()  # when, within the window
        self._failure: str | None = None  # why it stays down (restart budget spent)
        self._adapters: dict[str, LoRARequest] = {}  # loaded at runtime: loaded again after a restart
        # The front's record of the serving weights (set by it): a restart loads them first.
        self.weights: WeightsSource | None = None
        self._stop = threading.Event()
        self._watcher = threading.Thread(target=self._watch, name=f"pagoda-supervise-{label}", daemon=True)
        self._watcher.start()

    # ---- what the holder reads -------------------------------------------------------------------

    def state(self) -> EngineState:
        llm = self.llm
        alive = llm.is_alive
        if alive:
            return EngineState(llm.engine_pid, True, "ok", self.restarts)
        if self._failure is not None:
            return EngineState(llm.engine_pid, False, "failed", self.restarts, self._failure)
        error = repr(llm.error) if llm.error is not None else None
        restarting = self.policy.enabled and llm.error is not None and not self._stop.is_set()
        return EngineState(llm.engine_pid, False, "restarting" if restarting else "dead", self.restarts, error)

    # ---- adapters loaded at runtime, remembered for restarts -------------------------------------

    async def add_lora(self, lora_request: LoRARequest) -> None:
        await self.llm.add_lora(lora_request)
        self._adapters[lora_request.lora_name] = lora_request

    async def remove_lora(self, name: str) -> None:
        self._adapters.pop(name, None)
        await self.llm.remove_lora(name)

    @property
    def adapters(self) -> dict[str, LoRARequest]:
        """The adapters loaded at runtime, by name."""
        return dict(self._adapters)

    def match_adapters(self, adapters: dict[str, LoRARequest]) -> None:
        """Have exactly the runtime adapters another engine of the model has (a replica added
        beside it, before it takes requests): unload the others, load the missing ones. Call
        from a thread without an event loop."""
        extra = [name for name in self._adapters if name not in adapters]
        missing = {name: adapter for name, adapter in adapters.items() if name not in self._adapters}

        async def unload() -> None:
            for name in extra:
                await self.remove_lora(name)

        if extra:
            asyncio.run(unload())
        self._adapters.update(missing)
        if missing:
            self._load_adapters(self.llm, list(missing.values()))

    # ---- lifecycle -----------------------------------------------------------------------------

    def stop(self, timeout: float | None = 10.0) -> None:
        """Stop supervising and shut the engine down (a restart under way is shut down by the
        watcher once it is up, however long this waited for it)."""
        self._stop.set()
        self._watcher.join(timeout)
        self._keeper.stop(timeout)

    def _watch(self) -> None:
        while not self._stop.wait(WATCH_INTERVAL_S):
            llm = self.llm
            if llm.is_alive:
                continue
            if llm.error is None:
                return  # shut down on purpose: not a death
            self._reap(llm)
            if not self.policy.enabled:
                logger.error("engine %s died (%s); not restarted (--no-restart)", self.label, llm.error)
                return
            if not self._restart(llm.error):
                return

    def _reap(self, llm: AsyncLLM) -> None:
        """Shut what is left of the dead engine down: its process is reaped, its threads end."""
        try:
            self._keeper.stop(timeout=5)
        except Exception:
            logger.exception("engine %s: cleaning up after its death failed", self.label)
        config = self._config
        if config.kv_offload_disk is not None and not config.kv_offload_disk_persist:
            # Its disk tier files, which a clean shutdown deletes: left behind, they would fill
            # the disk kill after kill and keep the replacement from starting.
            removed = remove_files_written_since(config.kv_offload_disk, self._engine_started)
            if removed:
                logger.info("engine %s: removed %d disk KV tier files it left behind", self.label, removed)

    def _restart(self, cause: BaseException) -> bool:
        """Start a replacement, with backoff, until one runs; False when the budget is spent or
        supervision stopped."""
        while not self._stop.is_set():
            now = self._clock()
            while self._recent and now - self._recent[0] >= self.policy.window:
                self._recent.popleft()
            if len(self._recent) >= self.policy.max_restarts:
                self._failure = (
                    f"gave up after {len(self._recent)} restarts within "
                    f"{self.policy.window:g} s (--max-replica-restarts); last error: {cause}"
                )
                logger.error("engine %s stays down: %s", self.label, self._failure)
                return False
            delay = self.policy.delay(len(self._recent))
            logger.error("engine %s is down (%s); restarting it in %.1f s", self.label, cause, delay)
            if self._stop.wait(delay):
                return False
            self._recent.append(self._clock())
            self.restarts += 1
            self._engine_started = time.time()
            keeper = EngineKeeper(lambda: self._starter(self._config), f"pagoda-engine-{self.label}")
            try:
                llm = keeper.result()
                self.load_weights(llm)
                self._load_adapters(llm)
            except BaseException as exc:
                keeper.stop(timeout=5)
                cause = exc.__cause__ or exc
                continue
            if self._stop.is_set():
                keeper.stop()
                return False
            self._keeper, self.llm = keeper, llm
            logger.warning("engine %s restarted (restart %d), pid %s", self.label, self.restarts, llm.engine_pid)
            return True
        return False

    def load_weights(self, llm: AsyncLLM | None = None) -> None:
        """Have the restarted or added engine (`llm`, else the current one) load the weights the
        others serve, if an update changed them since the checkpoint it started from; raises (so
        the restart is tried again) when it cannot: it must not serve the old weights."""
        if self.weights is None:
            return
        source = self.weights.written(SNAPSHOT_WAIT_S, self._stop.is_set)
        if source is None:
            return
        engine = llm or self.llm
        asyncio.run(engine.engine_command("update_weights_from_disk", {"model_path": source}))
        logger.info("engine %s: loaded the current weights from %s", self.label, source)

    def _load_adapters(self, llm: AsyncLLM, adapters: list[LoRARequest] | None = None) -> None:
        """Load the adapters loaded at runtime (or `adapters` of them) before the restarted or
        added engine takes requests."""
        adapters = list(self._adapters.values()) if adapters is None else adapters
        if not adapters:
            return

        async def load() -> None:
            for adapter in adapters:
                try:
                    await llm.add_lora(adapter)
                except ValueError as exc:  # InvalidRequest: e.g. its files are gone since
                    logger.warning(
                        "engine %s: adapter %r not loaded on the new engine: %s", self.label, adapter.lora_name, exc
                    )

        asyncio.run(load())


class ModelFront:
    """What the HTTP layer reads of the engine(s) serving one model, taken from the first one:
    replicas serve one model and a restart starts the same config again, so they agree."""

    def __init__(self, first: AsyncLLM) -> None:
        self.config: EngineConfig = first.config
        self.transport = first.transport
        self.max_num_seqs_choice = first.max_num_seqs_choice
        self.kv_pool_memory: str = first.kv_pool_memory
        self.tokenizer = first.tokenizer
        self.max_model_len: int = first.max_model_len
        self.weights_digest: str | None = first.weights_digest
        self.generation_defaults: dict = first.generation_defaults
        self.classifier: ClassifierConfig | None = first.classifier
        self.engine_limits = first.engine_limits
