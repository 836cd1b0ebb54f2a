"""The engine side of every transport: build the engine on its own thread, then apply
messages, step and emit each step's output as it is. When idle it blocks on its inbox (no busy
loop); the engine's own KV handoff threads post a Wake there when they have something for it."""

from __future__ import annotations

import logging
import queue
from collections.abc import Callable
from typing import TYPE_CHECKING

from pagoda.config import EngineConfig
from pagoda.engine.threads import set_engine_threads
from pagoda.engine.transport.base import EngineFactory, OnEmitted
from pagoda.engine.transport.messages import (
    AbortRequests,
    AddRequest,
    EngineCommand,
    PrefillLocally,
    Shutdown,
    ToEngine,
    UpdateLoRA,
    Wake,
)
from pagoda.errors import InvalidRequest

if TYPE_CHECKING:
    from pagoda.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)


class EngineInbox:
    """The engine thread's messages: the front's, and Wake from the engine's own threads."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue[ToEngine] = queue.SimpleQueue()

    def put(self, message: ToEngine) -> None:
        self._queue.put(message)

    def take(self, block: bool) -> list[ToEngine]:
        """The messages waiting; with block=True, waits for at least one."""
        messages = [self._queue.get()] if block else []
        while True:
            try:
                messages.append(self._queue.get_nowait())
            except queue.Empty:
                return messages


def build_engine(config: EngineConfig, factory: EngineFactory | None) -> LLMEngine:
    # Torch's thread count is per calling thread: this runs on the thread that will step.
    set_engine_threads(config, serving=True)
    if factory is not None:
        return factory(config)
    from pagoda.engine.llm_engine import LLMEngine

    return LLMEngine(config)


def report_worker_failures(engine: LLMEngine, report: Callable[[str], None]) -> None:
    """Tensor parallelism: a worker that dies while the engine idles (so no step fails) must
    still end the engine; `report(reason)` is called from a watcher thread."""
    engine.on_worker_failure(report)


def run_engine_loop(engine: LLMEngine, inbox: EngineInbox, emit: OnEmitted) -> None:
    """Apply messages, step, emit every step's output; return on Shutdown.

    An exception from the engine ends the loop (the engine's state is unknown after it).
    """
    engine.kv_connector.set_wake(lambda: inbox.put(Wake()))
    try:
        _loop(engine, inbox, emit)
    except BaseException:
        # The engine's state is unknown now, but what it holds outside this process must go:
        # a decode engine's KV listener would otherwise keep accepting handoffs nobody applies.
        try:
            engine.close()
        except Exception:
            logger.exception("closing the failed engine failed")
        raise


def _loop(engine: LLMEngine, inbox: EngineInbox, emit: OnEmitted) -> None:
    while True:
        for message in inbox.take(not engine.has_unfinished_requests()):
            if isinstance(message, Shutdown):
                engine.close()  # clean shutdown: the disk KV tier's files
                return
            if isinstance(message, (AddRequest, UpdateLoRA)):
                _apply_request(engine, message)
            elif isinstance(message, AbortRequests):
                engine.abort_request(message.request_ids)
            elif isinstance(message, PrefillLocally):
                engine.kv_connector.prefill_locally(message.request_ids)
            elif isinstance(message, EngineCommand):
                engine.run_command(message.control_id, message.command, message.args)
        # Also without work to step: the adds' answers and handoff outcomes go out now.
        emit(engine.step(), engine.get_stats())


def _apply_request(engine: LLMEngine, message: AddRequest | UpdateLoRA) -> None:
    """An add or a LoRA update; the engine answers it in its next step output (accepted, or
    refused with the reason), so a refusal raised here needs nothing more."""
    try:
        if isinstance(message, UpdateLoRA):
            engine.update_lora(message.control_id, message.lora_request, unload=message.unload)
        else:
            engine.add_request(message.request, handoff=message.handoff, awaiting_kv=message.awaiting_kv)
    except InvalidRequest:
        pass
    except Exception as error:  # a bug for this request (but a bad add); the engine keeps serving
        if isinstance(message, UpdateLoRA):
            logger.exception("LoRA update failed for %s", message.lora_request.lora_name)
        elif not isinstance(error, ValueError):
            logger.exception("add_request failed for %s", message.request.request_id)
