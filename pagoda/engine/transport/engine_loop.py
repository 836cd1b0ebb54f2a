"""The engine side of either transport: build the engine on its own thread, then apply
messages, step while there is work and emit after every step. When idle it blocks on its
inbox (no busy loop)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Callable

from pagoda.config import EngineConfig
from pagoda.engine.threads import set_engine_threads
from pagoda.engine.transport.base import EngineFactory, OnEmitted
from pagoda.engine.transport.messages import (ACCEPTED, AbortRequests, AddRequest, Emitted,
                                              EmittedItem, Shutdown, ToEngine, UpdateLoRA)
from pagoda.errors import InvalidRequest
from pagoda.structured.grammar import grammar_failure

if TYPE_CHECKING:
    from pagoda.engine.llm_engine import LLMEngine

logger = logging.getLogger(__name__)

# take(block): the messages waiting in the inbox; with block=True, waits for at least one.
Take = Callable[[bool], list[ToEngine]]


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


def run_engine_loop(engine: "LLMEngine", take: Take, emit: OnEmitted) -> None:
    """Apply messages, step while there is work, emit after every step; return on Shutdown.

    An exception from the engine ends the loop (the engine's state is unknown after it).
    """
    while True:
        messages = take(not engine.has_unfinished_requests())
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
        if engine.has_unfinished_requests():
            deltas = engine.step()
            # Structured output: ACCEPTED or the grammar's error before the request's first delta.
            emitted.extend((request_id, ACCEPTED if error is None else grammar_failure(error))
                           for request_id, error in engine.take_grammar_outcomes())
            for delta in deltas:
                emitted.append((delta.request_id, delta))
        emit(emitted, engine.get_stats())


def _add(engine: "LLMEngine", message: AddRequest) -> EmittedItem | None:
    try:
        engine.add_request(message.request_id, message.prompt, message.params,
                           arrival_time=message.arrival_time, cache_salt=message.cache_salt,
                           priority=message.priority, lora_request=message.lora_request)
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
