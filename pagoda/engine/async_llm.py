"""AsyncLLM: an LLMEngine driven by its own thread or process, with an asyncio front.

The engine is synchronous and not thread-safe, so exactly one thread ever touches it: it is
built there, steps there, and reports stats after each step. The front sends add/abort
messages; after each step the engine side emits what changed (acceptances, validation
errors, outputs) in one batch, which the front hands to per-request streams on the callers'
event loops with one `call_soon_threadsafe` per loop. When idle the engine side blocks on
its inbox (no busy loop).

Two transports carry the same messages:
- thread (AsyncLLM's default): the engine runs on a thread of this process. Cheapest to
  start, but the engine and the HTTP side share one GIL: whatever Python the event loop runs
  (about 40-60 us per streamed token here) the engine cannot run meanwhile. At 64 streaming
  clients on 2 cores the bundled model served ~82% of the offline engine's tok/s this way.
- process (`pagoda serve`'s default): the engine runs in a spawned child process with its
  own GIL (~95% of offline in the same test), and an engine crash leaves the front alive to
  report it. Outputs cross a pipe as deltas (new text, tokens and
  logprobs since the last step), so the cost per step does not grow with output length.
  Being spawned, the child re-imports the parent's `__main__`: scripts that use this
  transport need an `if __name__ == "__main__":` guard.

A stream keeps only its newest output: engine outputs are cumulative, so a consumer that
falls behind simply receives bigger deltas instead of a growing backlog.
"""

from __future__ import annotations

import asyncio
import copy
import logging
import multiprocessing
import os
import queue
import threading
from collections import defaultdict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, AsyncIterator, Callable, Iterable, Literal

from pagoda.config import EngineConfig
from pagoda.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from pagoda.sampling_params import SamplingParams

if TYPE_CHECKING:
    from multiprocessing.connection import Connection

    from pagoda.engine.llm_engine import EngineStats, LLMEngine

logger = logging.getLogger(__name__)

EngineFactory = Callable[[EngineConfig], "LLMEngine"]
Transport = Literal["thread", "process"]


class EngineDeadError(RuntimeError):
    """The engine has stopped; no request can be served any more."""


# ---- messages (picklable: they may cross a process boundary) ------------------------------


@dataclass
class _Add:
    request_id: str
    prompt: str | list[int]
    params: SamplingParams
    arrival_time: float | None
    cache_salt: str | None
    priority: int


@dataclass
class _Abort:
    request_ids: list[str]


@dataclass
class _Shutdown:
    pass


ACCEPTED = "accepted"

# What the engine side emits per request: ACCEPTED, an exception (the add was refused), or an
# output (a snapshot on the thread transport, an _OutputDelta on the process transport).
Emitted = list[tuple[str, Any]]


# ---- streams (event loop side) -------------------------------------------------------------


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

    # Called on the event loop, scheduled from the engine side.
    def _deliver(self, item: object) -> None:
        if isinstance(item, str):  # ACCEPTED
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


def _deliver_all(items: list[tuple[RequestStream, object]]) -> None:
    for stream, item in items:
        stream._deliver(item)


def _snapshot(output: RequestOutput) -> RequestOutput:
    """A copy the event loop can read while the engine keeps appending to the original.

    Built field by field: this runs for every request on every step.
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


# ---- output deltas (process transport) -----------------------------------------------------


@dataclass
class _SampleDelta:
    index: int
    text: str  # appended to the text so far, or the whole text when replace_text
    replace_text: bool
    token_ids: list[int]
    logprobs: list[PositionLogprobs] | None
    cumulative_logprob: float | None
    finish_reason: str | None
    stop_reason: int | str | None


@dataclass
class _OutputDelta:
    samples: list[_SampleDelta]
    finished: bool
    num_cached_tokens: int
    metrics: RequestMetrics | None
    prompt_logprobs: list[PositionLogprobs | None] | None  # the entries not sent before
    # Sent with a request's first delta only.
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None


@dataclass
class _SentCounts:
    text: list[int] = field(default_factory=list)
    tokens: list[int] = field(default_factory=list)
    logprobs: list[int] = field(default_factory=list)
    prompt_logprobs: int = 0


class _DeltaEncoder:
    """Engine side: what each output gained since it was last sent."""

    def __init__(self) -> None:
        self._sent: dict[str, _SentCounts] = {}

    def __call__(self, output: RequestOutput) -> _OutputDelta:
        sent = self._sent.get(output.request_id)
        first = sent is None
        if sent is None:
            n = len(output.outputs)
            sent = self._sent[output.request_id] = _SentCounts([0] * n, [0] * n, [0] * n)
        samples = []
        for i, c in enumerate(output.outputs):
            logprobs = None
            if c.logprobs is not None:
                logprobs = c.logprobs[sent.logprobs[i]:]
                sent.logprobs[i] = len(c.logprobs)
            # Text only grows (the detokenizer holds back what a stop string may remove); a
            # shorter text would mean that changed, and is then sent whole.
            shrunk = len(c.text) < sent.text[i]
            samples.append(_SampleDelta(c.index, c.text if shrunk else c.text[sent.text[i]:],
                                        shrunk, c.token_ids[sent.tokens[i]:], logprobs,
                                        c.cumulative_logprob, c.finish_reason, c.stop_reason))
            sent.text[i] = len(c.text)
            sent.tokens[i] = len(c.token_ids)
        prompt_logprobs = None
        if output.prompt_logprobs is not None:
            prompt_logprobs = output.prompt_logprobs[sent.prompt_logprobs:]
            sent.prompt_logprobs = len(output.prompt_logprobs)
        if output.finished:
            del self._sent[output.request_id]
        delta = _OutputDelta(samples, output.finished, output.num_cached_tokens, output.metrics,
                             prompt_logprobs)
        if first:
            delta.prompt, delta.prompt_token_ids = output.prompt, output.prompt_token_ids
        return delta


def _apply_delta(replica: RequestOutput, delta: _OutputDelta) -> None:
    """Front side: grow the replica of a request's output by one delta."""
    for sample in delta.samples:
        c = replica.outputs[sample.index]
        c.text = sample.text if sample.replace_text else c.text + sample.text
        c.token_ids.extend(sample.token_ids)
        if sample.logprobs is not None:
            if c.logprobs is None:
                c.logprobs = []
            c.logprobs.extend(sample.logprobs)
        c.cumulative_logprob = sample.cumulative_logprob
        c.finish_reason = sample.finish_reason
        c.stop_reason = sample.stop_reason
    if delta.prompt_logprobs:
        if replica.prompt_logprobs is None:
            replica.prompt_logprobs = []
        replica.prompt_logprobs.extend(delta.prompt_logprobs)
    replica.finished = delta.finished
    replica.num_cached_tokens = delta.num_cached_tokens
    replica.metrics = delta.metrics


# ---- the engine loop (engine side, either transport) ---------------------------------------


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


def _build_engine(config: EngineConfig, factory: EngineFactory | None) -> "LLMEngine":
    # OpenMP thread counts are per calling thread, so this runs on the engine's own thread.
    import torch

    torch.set_num_threads(engine_thread_count(config))
    if factory is not None:
        return factory(config)
    from pagoda.engine.llm_engine import LLMEngine

    return LLMEngine(config)


def _run_engine_loop(engine: "LLMEngine", take: Callable[[bool], list[object]],
                     emit: Callable[[Emitted, "EngineStats"], None],
                     encode: Callable[[RequestOutput], Any]) -> None:
    """Apply messages, step while there is work, emit after every step; return on shutdown.

    An exception from the engine ends the loop (the engine's state is unknown after it).
    """
    while True:
        messages = take(not engine.has_unfinished_requests())
        emitted: Emitted = []
        for message in messages:
            if isinstance(message, _Shutdown):
                close = getattr(engine, "close", None)  # clean shutdown: the disk KV tier's files
                if close is not None:
                    close()
                return
            if isinstance(message, _Add):
                emitted.append((message.request_id, _add(engine, message)))
            elif isinstance(message, _Abort):
                engine.abort_request(message.request_ids)
        if engine.has_unfinished_requests():
            for output in engine.step():
                emitted.append((output.request_id, encode(output)))
        emit(emitted, engine.get_stats())


def _add(engine: "LLMEngine", message: _Add) -> object:
    try:
        engine.add_request(message.request_id, message.prompt, message.params,
                           arrival_time=message.arrival_time, cache_salt=message.cache_salt,
                           priority=message.priority)
    except ValueError as exc:
        return ValueError(str(exc))
    except Exception as exc:  # a bug for this request; the engine itself keeps serving
        logger.exception("add_request failed for %s", message.request_id)
        return RuntimeError(f"the engine could not add the request: {exc!r}")
    return ACCEPTED


def _engine_process_main(conn: "Connection", config: EngineConfig,
                         factory: EngineFactory | None) -> None:
    """Entry point of the engine process."""
    try:
        engine = _build_engine(config, factory)
    except BaseException as exc:
        conn.send(("failed", f"{type(exc).__name__}: {exc}"))
        return
    conn.send(("ready", engine.max_model_len,
               dict(getattr(engine, "generation_defaults", {}) or {}), engine.get_stats()))

    def take(block: bool) -> list[object]:
        messages = [conn.recv()] if block else []
        while conn.poll(0):
            messages.append(conn.recv())
        return messages

    def emit(emitted: Emitted, stats: "EngineStats") -> None:
        conn.send(("batch", emitted, stats))

    try:
        _run_engine_loop(engine, take, emit, _DeltaEncoder())
    except (EOFError, BrokenPipeError):
        return  # the front went away
    except BaseException as exc:
        logger.exception("engine loop died")
        try:
            conn.send(("dead", f"{type(exc).__name__}: {exc}"))
        except OSError:
            pass


# ---- the front (event loop side) -----------------------------------------------------------


@dataclass
class _Pending:
    """A submitted request as the front tracks it."""

    stream: RequestStream
    replica: RequestOutput | None = None  # process transport: the output rebuilt from deltas


class AsyncLLM:
    """asyncio front of one LLMEngine running on its own thread or in its own process."""

    def __init__(self, config: EngineConfig, *, transport: Transport = "thread",
                 engine_factory: EngineFactory | None = None,
                 startup_timeout: float | None = None) -> None:
        """`engine_factory` builds the engine instead of LLMEngine(config); on the process
        transport it must be picklable (a module-level function)."""
        if transport not in ("thread", "process"):
            raise ValueError(f"transport must be 'thread' or 'process', got {transport!r}")
        self.config = config
        self.transport = transport
        self._pending: dict[str, _Pending] = {}
        self._lock = threading.Lock()  # guards _pending, _error and _stopped
        self._error: BaseException | None = None
        self._stopped = False
        self._stats: EngineStats | None = None
        if transport == "thread":
            self._start_thread(engine_factory, startup_timeout)
        else:
            self._start_process(engine_factory, startup_timeout)

    # ---- public API ----------------------------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        return self._error is None and not self._stopped and self._worker_alive()

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
        with self._lock:
            if self._error is not None or self._stopped:
                raise EngineDeadError("the engine is not running") from self._error
            if request_id in self._pending:
                raise ValueError(f"request id {request_id!r} is already in use")
            self._pending[request_id] = _Pending(stream)
        # Sent after registering: once the engine has died, whatever is registered is failed.
        self._send(_Add(request_id, prompt, params, arrival_time, cache_salt, priority))
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
        """Stop requests; their streams get nothing more and the engine frees their blocks."""
        ids = list(request_ids)
        with self._lock:
            for request_id in ids:
                self._pending.pop(request_id, None)
            running = self._error is None and not self._stopped
        if ids and running:
            self._send(_Abort(ids))

    def shutdown(self, timeout: float | None = 10.0) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._send(_Shutdown())
        self._join(timeout)
        self._fail_all(EngineDeadError("the engine was shut down"))

    # ---- engine side -> streams --------------------------------------------------------------

    def _on_emitted(self, emitted: Emitted, stats: "EngineStats") -> None:
        """Route one step's results to their streams (runs on the engine thread or reader)."""
        self._stats = stats
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, object]]] = \
            defaultdict(list)
        with self._lock:
            for request_id, item in emitted:
                pending = self._pending.get(request_id)
                if pending is None:
                    continue  # aborted by its consumer
                if isinstance(item, BaseException) or (
                        not isinstance(item, str) and _is_finished(item)):
                    del self._pending[request_id]
                if isinstance(item, _OutputDelta):
                    item = self._rebuild(pending, request_id, item)
                by_loop[pending.stream.loop].append((pending.stream, item))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver_all, items)
            except RuntimeError:
                pass  # that event loop is closed; nobody is listening

    def _rebuild(self, pending: _Pending, request_id: str, delta: _OutputDelta) -> RequestOutput:
        if pending.replica is None:
            pending.replica = RequestOutput(
                request_id=request_id, prompt=delta.prompt,
                prompt_token_ids=delta.prompt_token_ids or [],
                outputs=[CompletionOutput(index=i) for i in range(len(delta.samples))])
        _apply_delta(pending.replica, delta)
        return _snapshot(pending.replica)

    def _on_death(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None and not self._stopped:
                self._error = error
                logger.error("the engine stopped: %s", error)
        self._fail_all(EngineDeadError(f"the engine stopped: {error}"))

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            pending, self._pending = list(self._pending.values()), {}
        by_loop: dict[asyncio.AbstractEventLoop, list[tuple[RequestStream, object]]] = \
            defaultdict(list)
        for p in pending:
            by_loop[p.stream.loop].append((p.stream, error))
        for loop, items in by_loop.items():
            try:
                loop.call_soon_threadsafe(_deliver_all, items)
            except RuntimeError:
                pass

    # ---- thread transport ----------------------------------------------------------------------

    def _start_thread(self, factory: EngineFactory | None, timeout: float | None) -> None:
        self._inbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        ready = threading.Event()
        built: list[LLMEngine] = []

        def run() -> None:
            try:
                engine = _build_engine(self.config, factory)
            except BaseException as exc:  # reported to the constructor
                self._error = exc
                ready.set()
                return
            built.append(engine)
            self._stats = engine.get_stats()
            ready.set()
            try:
                _run_engine_loop(engine, self._take_from_inbox, self._on_emitted, _snapshot)
            except BaseException as exc:
                logger.exception("engine loop died")
                self._on_death(exc)

        self._thread = threading.Thread(target=run, name="pagoda-engine", daemon=True)
        self._thread.start()
        if not ready.wait(timeout):
            raise TimeoutError("the engine did not start in time")
        if not built:
            raise RuntimeError("the engine failed to start") from self._error
        engine = built[0]
        self.tokenizer = engine.tokenizer
        self.max_model_len: int = engine.max_model_len
        self.generation_defaults: dict = dict(getattr(engine, "generation_defaults", {}) or {})
        self._send: Callable[[object], None] = self._inbox.put
        self._worker_alive: Callable[[], bool] = self._thread.is_alive
        self._join: Callable[[float | None], None] = self._thread.join

    def _take_from_inbox(self, block: bool) -> list[object]:
        messages = [self._inbox.get()] if block else []
        while True:
            try:
                messages.append(self._inbox.get_nowait())
            except queue.Empty:
                return messages

    # ---- process transport ---------------------------------------------------------------------

    def _start_process(self, factory: EngineFactory | None, timeout: float | None) -> None:
        context = multiprocessing.get_context("spawn")
        conn, child_conn = context.Pipe()
        process = context.Process(target=_engine_process_main, name="pagoda-engine",
                                  args=(child_conn, self.config, factory), daemon=True)
        process.start()
        child_conn.close()
        from pagoda.tokenizer import Tokenizer  # loaded here while the child loads the model

        try:
            self.tokenizer = Tokenizer.from_pretrained(self.config.tokenizer or self.config.model)
        except BaseException:
            process.kill()
            raise
        if not conn.poll(timeout):
            process.kill()
            raise TimeoutError("the engine did not start in time")
        try:
            message = conn.recv()
        except EOFError:
            message = ("failed", f"the engine process exited with code {process.exitcode}")
        if message[0] != "ready":
            process.join(5)
            self._error = RuntimeError(message[1])
            raise RuntimeError("the engine failed to start") from self._error
        _, self.max_model_len, self.generation_defaults, self._stats = message
        self._conn = conn
        self._process = process
        # A sender thread, so the event loop never blocks on a full pipe (a long prompt while
        # the engine is busy stepping).
        self._outbox: queue.SimpleQueue[object] = queue.SimpleQueue()
        self._send = self._outbox.put
        self._worker_alive = process.is_alive
        self._join = self._join_process
        for target, name in ((self._read_process, "pagoda-engine-reader"),
                             (self._write_process, "pagoda-engine-writer")):
            threading.Thread(target=target, name=name, daemon=True).start()

    def _write_process(self) -> None:
        while True:
            message = self._outbox.get()
            try:
                self._conn.send(message)
            except (OSError, ValueError):
                return  # the engine process is gone; the reader reports it
            if isinstance(message, _Shutdown):
                return

    def _read_process(self) -> None:
        while True:
            try:
                message = self._conn.recv()
            except (EOFError, OSError):
                if not self._stopped:
                    self._on_death(RuntimeError(
                        f"the engine process exited (code {self._process.exitcode})"))
                return
            if message[0] == "batch":
                self._on_emitted(message[1], message[2])
            elif message[0] == "dead":
                self._on_death(RuntimeError(message[1]))
                return

    def _join_process(self, timeout: float | None) -> None:
        self._process.join(timeout)
        if self._process.is_alive():
            self._process.kill()
            self._process.join(5)
        self._conn.close()


def _is_finished(item: object) -> bool:
    return bool(getattr(item, "finished", False))
