"""The engine on a thread of this process.

Cheapest to start, but the engine and the HTTP side share one GIL: whatever Python the event
loop runs per streamed token the engine cannot run meanwhile, so under many streaming clients
it serves fewer tokens per second than the process transport. Each step's output is handed
over as it is: the engine keeps no reference to it.
"""

from __future__ import annotations

import logging
import os
import threading

from pagoda.config import EngineConfig
from pagoda.engine.transport.base import EngineFactory, EngineInfo, EngineTransport, OnDeath, OnEmitted
from pagoda.engine.transport.engine_loop import EngineInbox, build_engine, report_worker_failures, run_engine_loop
from pagoda.engine.transport.messages import Shutdown, ToEngine

logger = logging.getLogger(__name__)


class ThreadTransport(EngineTransport):
    kind = "thread"

    def __init__(
        self,
        config: EngineConfig,
        factory: EngineFactory | None,
        on_emitted: OnEmitted,
        on_death: OnDeath,
        *,
        startup_timeout: float | None = None,
    ) -> None:
        super().__init__(config, on_emitted, on_death)
        self._inbox = EngineInbox()
        ready = threading.Event()
        built: list = []
        failure: list[BaseException] = []

        def run() -> None:
            try:
                engine = build_engine(config, factory)
            except BaseException as exc:  # reported to the constructor
                failure.append(exc)
                ready.set()
                return
            built.append(engine)
            report_worker_failures(engine, lambda reason: on_death(RuntimeError(reason)))
            ready.set()
            try:
                run_engine_loop(engine, self._inbox, on_emitted)
            except BaseException as exc:
                logger.exception("engine loop died")
                on_death(exc)

        self._thread = threading.Thread(target=run, name="pagoda-engine", daemon=True)
        self._thread.start()
        if not ready.wait(startup_timeout):
            raise TimeoutError("the engine did not start in time")
        if not built:
            raise RuntimeError("the engine failed to start") from (failure[0] if failure else None)
        engine = built[0]
        self.tokenizer = engine.tokenizer
        self.info = EngineInfo.of(engine)

    def send(self, message: ToEngine) -> None:
        self._inbox.put(message)

    def is_alive(self) -> bool:
        return self._thread.is_alive()

    @property
    def engine_pid(self) -> int | None:
        return os.getpid()

    def shutdown(self, timeout: float | None) -> None:
        self._inbox.put(Shutdown())
        self._thread.join(timeout)
