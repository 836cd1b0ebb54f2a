"""RequestStream: the deltas of one request, read on the event loop that submitted it.

The engine side hands over what each step's output holds for the request (its acceptance or
refusal, its delta, its handoff outcome) with `call_soon_threadsafe`; the stream merges
what its consumer has not read yet into one pending delta (as vLLM's RequestOutputCollector
does), so a consumer that falls behind reads one bigger delta instead of a growing backlog,
and never misses text or tokens.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass

from pagoda.engine.step_output import HandoffOutcome
from pagoda.outputs import RequestOutputDelta


@dataclass(frozen=True)
class StreamRoute:
    """Where a replica router sent a request: the replica's label and its pool tag."""

    replica: str
    pool: str | None = None


class PolledStream:
    """Waiting and async iteration over `poll()`: a subclass sets `_ready` (the event its
    producer sets) and `finished`, and implements `poll()` (the next delta or None)."""

    _ready: asyncio.Event
    finished: bool
    route: StreamRoute | None = None  # None: one engine, nothing routed

    def poll(self) -> RequestOutputDelta | None:
        raise NotImplementedError

    async def get(self) -> RequestOutputDelta:
        """The next delta, waiting for one if none is pending."""
        while True:
            self._ready.clear()
            delta = self.poll()
            if delta is not None:
                return delta
            await self._ready.wait()

    def __aiter__(self) -> PolledStream:
        return self

    async def __anext__(self) -> RequestOutputDelta:
        if self.finished:
            raise StopAsyncIteration
        return await self.get()


class RequestStream(PolledStream):
    """The deltas of one request, read on the event loop that created it."""

    def __init__(self, request_id: str, loop: asyncio.AbstractEventLoop, wake: asyncio.Event | None = None) -> None:
        self.request_id = request_id
        self.loop = loop
        self.finished = False  # the finishing delta has been read
        self._accepted: asyncio.Future[None] = loop.create_future()
        self._pending: RequestOutputDelta | None = None
        self._error: BaseException | None = None
        self._handoff: HandoffOutcome | None = None  # role prefill: how the request left the engine
        # Several streams may share one wake event so a caller can wait on all of them.
        self._ready = wake if wake is not None else asyncio.Event()

    # Called on the stream's event loop with what the engine reported for the request.

    def accept(self) -> None:
        """The engine accepted the request."""
        if not self._accepted.done():
            self._accepted.set_result(None)

    def deliver(self, delta: RequestOutputDelta) -> None:
        """What the request gained in a step."""
        if self._pending is None:
            self._pending = delta
        else:
            self._pending.merge(delta)
        self._ready.set()

    def fail(self, error: BaseException) -> None:
        """The engine refused the request, or died: the reader gets `error`."""
        if not self._accepted.done():
            self._accepted.set_exception(error)
            # The creator may already be gone (cancelled); don't warn about it.
            self._accepted.exception()
        self._error = error
        self._ready.set()

    def hand_off(self, outcome: HandoffOutcome) -> None:
        """Role prefill: the request left the engine (see handoff_outcome)."""
        self._handoff = outcome
        self._ready.set()

    async def wait_accepted(self) -> None:
        await self._accepted

    async def handoff_outcome(self) -> HandoffOutcome | RequestOutputDelta:
        """Role prefill: how the request left the engine — its HandoffOutcome, or its output
        when it finished at its first token (nothing to hand off). Raises if the engine died."""
        output: RequestOutputDelta | None = None
        while True:
            self._ready.clear()
            if self._handoff is not None:
                return self._handoff
            delta = self.poll()
            if delta is not None:
                output = delta if output is None else output.merge(delta)
                if output.finished:
                    return output
            await self._ready.wait()

    def poll(self) -> RequestOutputDelta | None:
        """Everything the request gained since the last read, if anything; raises once the
        engine has died (after the deltas that arrived before)."""
        delta, self._pending = self._pending, None
        if delta is None:
            if self._error is not None:
                raise self._error
            return None
        if delta.finished:
            self.finished = True
        return delta


def deliver_all(calls: list[Callable[[], None]]) -> None:
    """Run, on a stream's event loop, the stream calls one step output made for it."""
    for call in calls:
        call()
