"""RoutedStream: one request's deltas as read from whichever replica serves it.

It reads like the replica's RequestStream (poll / get / async iteration, a shared wake event)
and adds what a fleet needs:
- failover: when the replica dies before the request produced anything, the request is sent
  again to another live replica and the reader never notices (nothing was sent to the client
  yet, so nothing can be duplicated); a request that had already started fails with the
  replica's EngineDeadError, as it would on a single engine;
- load accounting: the outstanding tokens it was charged to its replica are paid back as its
  prompt is computed and its tokens arrive, and in full when it ends.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from pagoda.engine.request_stream import PolledStream, RequestStream, StreamRoute
from pagoda.engine.transport import EngineDeadError
from pagoda.outputs import RequestOutputDelta
from pagoda.replicas.replica import Flight

logger = logging.getLogger(__name__)

# Send the request again, avoiding the replicas in the set; returns the new stream and flight.
Resubmit = Callable[[set[int]], Awaitable[tuple[RequestStream, Flight]]]


class RoutedStream(PolledStream):
    def __init__(
        self,
        request_id: str,
        stream: RequestStream,
        flight: Flight,
        resubmit: Resubmit,
        wake: asyncio.Event,
        on_done: Callable[[str], None] = lambda request_id: None,
    ) -> None:
        """`on_done(request_id)` runs once the request finished or failed for good."""
        self.request_id = request_id
        self.loop = stream.loop
        self.finished = False  # the finishing delta has been read
        self.flight = flight
        self._inner: RequestStream | None = stream
        self._resubmit = resubmit
        self._ready = wake
        self._started = False  # a delta was read: the request can no longer move
        self._failed_on: set[int] = set()
        self._retry: asyncio.Task[None] | None = None
        self._error: BaseException | None = None
        self._on_done = on_done

    @property
    def replica(self) -> int:
        return self.flight.replica.index

    @property
    def route(self) -> StreamRoute:  # type: ignore[override]
        """The replica serving the request now (failover moves it)."""
        replica = self.flight.replica
        return StreamRoute(replica.label, replica.pool)

    def poll(self) -> RequestOutputDelta | None:
        """What the request gained since the last read, or None; raises if it failed."""
        if self._error is not None:
            self._on_done(self.request_id)
            raise self._error
        inner = self._inner
        if inner is None:
            return None  # being sent to another replica
        try:
            delta = inner.poll()
        except EngineDeadError as exc:
            self.flight.close()
            if self._started:
                self._on_done(self.request_id)
                raise
            self._begin_retry(exc)
            return None
        if delta is None:
            return None
        self._started = True
        self.flight.progress(delta)
        if delta.finished:
            self.finished = True
            self.flight.close()
            self._on_done(self.request_id)
        return delta

    def cancel(self) -> None:
        """The request was aborted: stop any failover and pay back its tokens."""
        if self._retry is not None:
            self._retry.cancel()
        self._inner = None
        self.flight.close()

    def _begin_retry(self, cause: EngineDeadError) -> None:
        dead = self.flight.replica.index
        self._failed_on.add(dead)
        self.flight.replica.num_moved_away += 1
        self._inner = None
        logger.warning(
            "replica %d died before request %s started; sending it to another replica", dead, self.request_id
        )

        async def retry() -> None:
            try:
                self._inner, self.flight = await self._resubmit(set(self._failed_on))
            except asyncio.CancelledError:
                raise
            except BaseException as exc:  # no live replica left, or it refused the request
                self._error = (
                    exc
                    if not isinstance(exc, EngineDeadError)
                    else EngineDeadError(f"no replica could take the request after replica {dead} died: {exc}")
                )
                self._error.__cause__ = cause
            self._ready.set()

        self._retry = self.loop.create_task(retry())
