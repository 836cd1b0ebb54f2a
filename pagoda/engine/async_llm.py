"""AsyncLLM: an LLMEngine on its own thread, with an asyncio front for the server.

The engine is synchronous and not thread-safe, so exactly one thread (the engine thread) ever
touches it: it is built there, steps there, and answers stats from a snapshot it takes after
each step. Other threads talk to it through a queue of add/abort messages; outputs travel
back to per-request streams on the caller's event loop with one `call_soon_threadsafe` per
step. When idle the engine thread blocks on the queue (no busy loop).

A stream keeps only its newest output: engine outputs are cumulative, so a consumer that
falls behind simply receives bigger deltas instead of a growing backlog.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import os
import queue
import threading
from collections import defaultdict
from dataclasses import dataclass
from typing import TYPE_CHECKING, AsyncIterator, Callable, Iterable

from pagoda.config import EngineConfig
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda.engine.llm_engine import EngineStats, LLMEngine

logger = logging.getLogger(__name__)


class EngineDeadError(RuntimeError):
    """The engine thread has stopped; no request can be served any more."""


@dataclass
class _Add:
    stream: "RequestStream"
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float | None
    cache_salt: str | None
    priority: int


@dataclass
class _Abort:
    request_ids: list[str]


class _Shutdown:
    pass


_ACCEPTED = object()


class RequestStream:
    """The outputs of one request, read on the event loop that created it."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop,
                 wake: asyncio.Event | None = None) -> None:
        self.request_id = request_id
        self.loop = loop
        self.finished = False
        self._accepted: asyncio.Future[None] = loop.create_future()
        self._latest: RequestOutput | None = None
        self._error: BaseException | None = None
        # Several streams may share one wake event so a caller can wait on all of them.
        self._ready = wake if wake is not None else asyncio.Event()

    # Called on the event loop, scheduled by the engine thread.
    def _deliver(self, item: object) -> None:
        if item is _ACCEPTED:
            if not self._accepted.done():
                self._accepted.set_result(None)
            return
        if isinstance(item, BaseException):
            if not self._accepted.done():
                self._accepted.set_exception(item)
                # The creator may already be gone (cancelled); don't warn about it.
                self._accepted.exception()
            self._error = item
        else:
            assert isinstance(item, RequestOutput)
            self._latest = item
        self._ready.set()

    async def wait_accepted(self) -> None:
        await self._accepted

    def poll(self) -> RequestOutput | None:
        """The newest output not yet read, if any; raises once the engine has died."""
        output, self._latest = self._latest, None
        if output is None:
            if self._error is not None:
                raise self._error
            return None
        if output.finished:
            self.finished = True
        return output

    async def get(self) -> RequestOutput:
        """The newest output, waiting for one newer than the last read."""
        while True:
            self._ready.clear()
            output = self.poll()
            if output is not None:
                return output
            await self._ready.wait()

    def __aiter__(self) -> "RequestStream":
        return self

    async def __anext__(self) -> RequestOutput:
        if self.finished:
            raise StopAsyncIteration
        return await self.get()


def _snapshot(output: RequestOutput) -> RequestOutput:
    """A copy the event loop can read while the engine keeps appending to the original.

    Built field by field: this runs for every request on every step, on the engine thread.
    """
    metrics = output.metrics
    if metrics is not None:
        metrics = copy.copy(metrics)
    prompt_logprobs = output.prompt_logprobs
    return RequestOutput(
        request_id=output.request_id, prompt=output.prompt,
        prompt_token_ids=output.prompt_token_ids,
        outputs=[CompletionOutput(index=c.index, text=c.text, token_ids=c.token_ids[:],
                                  cumulative_logprob=c.cumulative_logprob,
                                  logprobs=c.logprobs[:] if c.logprobs is not None else None,
                                  finish_reason=c.finish_reason, stop_reason=c.stop_reason)
                 for c in output.outputs],
        finished=output.finished,
        prompt_logprobs=prompt_logprobs[:] if prompt_logprobs is not None else None,
        num_cached_tokens=output.num_cached_tokens,
        metrics=metrics,
    )


def engine_thread_count(config: EngineConfig) -> int:
    """Intra-op threads for the engine: as configured, else every core but one.

    The spare core is for the event loop (HTTP, tokenization, SSE): an engine that spreads
    over all cores is stalled whenever the HTTP side wants one (MEASURED.md, the thread trap).
    """
    if config.num_threads is not None:
        return config.num_threads
    try:
        cores = len(os.sched_getaffinity(0))
    except AttributeError:
        cores = os.cpu_count() or 1
    return max(1, cores - 1)


def _set_engine_threads(config: EngineConfig) -> None:
    # OpenMP thread counts are per calling thread, so this must run on the engine thread.
    import torch

    torch.set_num_threads(engine_thread_count(config))


class AsyncLLM:
    """Thread-owning asyncio front of one LLMEngine."""

    def __init__(self, config: EngineConfig, *,
                 engine_factory: Callable[[EngineConfig], "LLMEngine"] | None = None,
                 startup_timeout: float | None = None) -> None:
        self.config = config
        self._engine_factory = engine_factory
        self._messages: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._lock = threading.Lock()  # orders "check alive + enqueue" against death
        self._error: BaseException | None = None
        self._stopped = False
        self._stats: EngineStats | None = None
        self._ready = threading.Event()
        self._engine: LLMEngine | None = None
        self._thread = threading.Thread(target=self._run, name="pagoda-engine", daemon=True)
        self._thread.start()
        if not self._ready.wait(startup_timeout):
            raise TimeoutError("the engine did not start in time")
        if self._engine is None:
            raise RuntimeError("the engine failed to start") from self._error
        engine = self._engine
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        self.generation_defaults: dict = dict(getattr(engine, "generation_defaults", {}) or {})

    # ---- public API (any thread / the event loop) ---------------------------------------------

    @property
    def is_alive(self) -> bool:
        return self._error is None and not self._stopped and self._thread.is_alive()

    @property
    def error(self) -> BaseException | None:
        return self._error

    def get_stats(self) -> "EngineStats | None":
        return self._stats

    async def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                          *, arrival_time: float | None = None, cache_salt: str | None = None,
                          priority: int = 0, wake: asyncio.Event | None = None) -> RequestStream:
        """Submit a request; returns once the engine accepted it.

        Raises ValueError (the engine's validation message) or EngineDeadError. `wake` is set
        whenever the stream has something new (share one across streams to wait on several).
        """
        stream = RequestStream(request_id, asyncio.get_running_loop(), wake)
        self._send(_Add(stream, prompt, params, arrival_time, cache_salt, priority))
        try:
            await stream.wait_accepted()
        except asyncio.CancelledError:
            self.abort([request_id])
            raise
        return stream

    async def generate(self, request_id: str, prompt: str | list[int], params: SamplingParams,
                       *, arrival_time: float | None = None, cache_salt: str | None = None,
                       priority: int = 0) -> AsyncIterator[RequestOutput]:
        """Outputs of one request; the request is aborted if the consumer stops early."""
        stream = await self.add_request(request_id, prompt, params, arrival_time=arrival_time,
                                        cache_salt=cache_salt, priority=priority)
        try:
            async for output in stream:
                yield output
        finally:
            if not stream.finished:
                self.abort([request_id])

    def abort(self, request_ids: Iterable[str]) -> None:
        ids = list(request_ids)
        if ids and self.is_alive:
            try:
                self._send(_Abort(ids))
            except EngineDeadError:
                pass

    def shutdown(self, timeout: float | None = 10.0) -> None:
        with self._lock:
            self._stopped = True
            self._messages.put(_Shutdown())
        self._thread.join(timeout)

    def _send(self, message: object) -> None:
        with self._lock:
            if self._error is not None or self._stopped:
                raise EngineDeadError("the engine is not running") from self._error
            self._messages.put(message)

    # ---- engine thread ------------------------------------------------------------------------

    def _run(self) -> None:
        try:
            _set_engine_threads(self.config)
            if self._engine_factory is not None:
                engine = self._engine_factory(self.config)
            else:
                from pagoda.engine.llm_engine import LLMEngine

                engine = LLMEngine(self.config)
            self._stats = engine.get_stats()
            self._engine = engine
        except BaseException as exc:  # reported to the constructor
            self._error = exc
            self._ready.set()
            return
        self._ready.set()

        streams: dict[str, RequestStream] = {}
        try:
            self._loop(engine, streams)
        except BaseException as exc:
            logger.exception("engine loop died")
            self._die(exc, streams)

    def _loop(self, engine: "LLMEngine", streams: dict[str, RequestStream]) -> None:
        while True:
            messages = self._take_messages(block=not engine.has_unfinished_requests())
            deliveries: list[tuple[RequestStream, object]] = []
            for message in messages:
                if isinstance(message, _Shutdown):
                    self._fail_streams(streams, EngineDeadError("the engine was shut down"))
                    return
                if isinstance(message, _Add):
                    self._add(engine, message, streams, deliveries)
                elif isinstance(message, _Abort):
                    engine.abort_request(message.request_ids)
                    for request_id in message.request_ids:
                        streams.pop(request_id, None)
            if engine.has_unfinished_requests():
                for output in engine.step():
                    stream = streams.get(output.request_id)
                    if stream is None:
                        continue  # aborted by its consumer
                    if output.finished:
                        del streams[output.request_id]
                    deliveries.append((stream, _snapshot(output)))
            self._stats = engine.get_stats()
            self._deliver(deliveries)

    def _take_messages(self, block: bool) -> list[object]:
        messages = [self._messages.get()] if block else []
        while True:
            try:
                messages.append(self._messages.get_nowait())
            except queue.Empty:
                return messages

    @staticmethod
    def _add(engine: "LLMEngine", message: _Add, streams: dict[str, RequestStream],
             deliveries: list[tuple[RequestStream, object]]) -> None:
        stream = message.stream
        if stream.request_id in streams:
            deliveries.append((stream, ValueError(
                f"request_id {stream.request_id!r} is already in use")))
            return
        try:
            engine.add_request(stream.request_id, message.prompt, message.params,
                               arrival_time=message.arrival_time, cache_salt=message.cache_salt,
                               priority=message.priority)
        except ValueError as exc:
            deliveries.append((stream, exc))
            return
        except Exception as exc:  # a bug for this request; the engine itself keeps serving
            logger.exception("add_request failed for %s", stream.request_id)
            deliveries.append((stream, RuntimeError(f"the engine could not add the request: "
                                                    f"{exc!r}")))
            return
        streams[stream.request_id] = stream
        deliveries.append((stream, _ACCEPTED))

    @staticmethod
    def _deliver(deliveries: list[tuple[RequestStream, object]]) -> None:
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, object]]] = \
            defaultdict(list)
        for stream, item in deliveries:
            by_loop[stream.loop].append((stream, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver_all, items)
            except RuntimeError:
                pass  # that event loop is closed; nobody is listening

    def _die(self, exc: BaseException, streams: dict[str, RequestStream]) -> None:
        with self._lock:
            self._error = exc
            pending = self._take_messages(block=False)
        error = EngineDeadError(f"the engine stopped: {exc!r}")
        for message in pending:
            if isinstance(message, _Add):
                streams[message.stream.request_id] = message.stream
        self._fail_streams(streams, error)

    def _fail_streams(self, streams: dict[str, RequestStream], error: BaseException) -> None:
        self._deliver([(stream, error) for stream in streams.values()])
        streams.clear()


def _deliver_all(items: list[tuple[RequestStream, object]]) -> None:
    for stream, item in items:
        stream._deliver(item)

