"""The engine side of every transport: build the engine on its own thread, then apply
messages, step while there is work and emit after every step. When idle it blocks on its
inbox (no busy loop); the engine's own KV handoff threads post a Wake there when they have
something for it."""

from __future__ import annotations

import logging
import queue
from typing import TYPE_CHECKING, Callable

from pagoda.config import EngineConfig
from pagoda.engine.threads import set_engine_threads
from pagoda.engine.transport.base import EngineFactory, OnEmitted
from pagoda.engine.transport.messages import (ACCEPTED, AbortRequests, AddRequest, Emitted,
                                              EmittedItem, PrefillLocally, Shutdown, ToEngine,
                                              UpdateLoRA, Wake)
from pagoda.errors import InvalidRequest
from pagoda.structured.grammar import grammar_failure

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


def build_engine(config: EngineConfig, factory: EngineFactory | None) -> "LLMEngine":
    # Torch's thread count is per calling thread: this runs on the thread that will step.
    set_engine_threads(config, serving=True)
    if factory is not None:
        return factory(config)
    from pagoda.engine.llm_engine import LLMEngine

    return LLMEngine(config)


def report_worker_failures(engine: "LLMEngine", report: Callable[[str], None]) -> None:
    """Tensor parallelism: a worker that dies while the engine idles (so no step fails) must
    still end the engine; `report(reason)` is called from a watcher thread."""
    register = getattr(engine, "on_worker_failure", None)  # an engine_factory's stand-in may lack it
    if register is not None:
        register(report)


def run_engine_loop(engine: "LLMEngine", inbox: EngineInbox, emit: OnEmitted) -> None:
    """Apply messages, step while there is work, emit after every step; return on Shutdown.

    An exception from the engine ends the loop (the engine's state is unknown after it).
    """
    set_wake = getattr(engine, "set_wake", None)  # an engine_factory's stand-in may lack it
    if set_wake is not None:
        set_wake(lambda: inbox.put(Wake()))
    take_outcomes = getattr(engine, "take_handoff_outcomes", lambda: [])
    try:
        _loop(engine, inbox, emit, take_outcomes)
    except BaseException:
        # The engine's state is unknown now, but what it holds outside this process must go:
        # a decode engine's KV listener would otherwise keep accepting handoffs nobody applies.
        try:
            engine.close()
        except Exception:
            logger.exception("closing the failed engine failed")
        raise


def _loop(engine: "LLMEngine", inbox: EngineInbox, emit: OnEmitted,
          take_outcomes: Callable[[], Emitted]) -> None:
    while True:
        messages = inbox.take(not engine.has_unfinished_requests())
        emitted: Emitted = []
        for message in messages:
            if isinstance(message, Shutdown):
                close = getattr(engine, "close", None)  # clean shutdown: the disk KV tier's files
                if close is not None:
                    close()
                return
            if isinstance(message, AddRequest):
                result = _add(engine, message)
                if result is not None:  # structured output: None = accepted once its grammar compiles
                    emitted.append((message.request_id, result))
            elif isinstance(message, AbortRequests):
                engine.abort_request(message.request_ids)
            elif isinstance(message, UpdateLoRA):
                emitted.append((message.control_id, _update_lora(engine, message)))
            elif isinstance(message, PrefillLocally):
                engine.prefill_locally(message.request_ids)
        if engine.has_unfinished_requests():
            deltas = engine.step()
            # Structured output: ACCEPTED or the grammar's error before the request's first delta.
            emitted.extend((request_id, ACCEPTED if error is None else grammar_failure(error))
                           for request_id, error in engine.take_grammar_outcomes())
            for delta in deltas:
                emitted.append((delta.request_id, delta))
        emitted.extend(take_outcomes())  # role prefill: requests handed off (or not) since the last step
        emit(emitted, engine.get_stats())


def _add(engine: "LLMEngine", message: AddRequest) -> EmittedItem | None:
    try:
        handoff = ({"handoff": message.handoff} if message.handoff is not None else {}) | (
            {"awaiting_kv": True} if message.awaiting_kv else {})  # a stand-in engine may not take them
        engine.add_request(message.request_id, message.prompt, message.params,
                           arrival_time=message.arrival_time, cache_salt=message.cache_salt,
                           priority=message.priority, lora_request=message.lora_request, **handoff)
    except InvalidRequest as exc:
        return exc
    except ValueError as exc:
        return InvalidRequest(str(exc))
    except Exception as exc:  # a bug for this request; the engine itself keeps serving
        logger.exception("add_request failed for %s", message.request_id)
        return RuntimeError(f"the engine could not add the request: {exc!r}")
    return None if engine.is_waiting_for_grammar(message.request_id) else ACCEPTED


def _update_lora(engine: "LLMEngine", message: UpdateLoRA) -> EmittedItem:
    """Load or unload an adapter between steps: the running batch is never touched, and a bad
    adapter is refused with the reason."""
    try:
        if message.unload:
            engine.remove_lora(message.lora_request.lora_name)
        else:
            engine.add_lora(message.lora_request)
    except InvalidRequest as exc:
        return exc
    except Exception as exc:  # a bug while loading; the engine itself keeps serving
        logger.exception("LoRA update failed for %s", message.lora_request.lora_name)
        return RuntimeError(f"the engine could not update LoRA adapter {message.lora_request.lora_name!r}: {exc!r}")
    return ACCEPTED
