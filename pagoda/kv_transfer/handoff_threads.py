"""The threads that move one engine's KV handoffs off its step loop.

A decode engine listens (an accept thread) and receives (pool threads that write arriving
blocks straight into blocks the engine thread allocated); a prefill engine sends (pool
threads). None of them touches the engine's scheduler or block pool: each posts what happened
as an event and wakes the engine thread, which applies it between steps (the engine is not
thread-safe). While a receive writes into its blocks, no step reads them: the request joins
the running set only after its `Received` event.
"""

from __future__ import annotations

import logging
import queue
import socket
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

import torch

from pagoda.kv_transfer.handoff import HandoffAuth, IncomingHandoff, KVHandoff, KVListener, TransferError, send_handoff
from pagoda.kv_transfer.shm_segments import SegmentMaps, ShmSegments

logger = logging.getLogger(__name__)

MAX_CONCURRENT = 4  # handoffs received (or sent) at once; more wait in the pool's queue
_ACCEPT_POLL = 0.5  # seconds: how late the accept thread notices close()


@dataclass
class HeaderArrived:
    """A prefill engine connected and sent a request's header; it waits for skip or reject."""

    incoming: IncomingHandoff


@dataclass
class Received:
    """A receive ended: every awaited block written (error None), or the transfer failed."""

    request_id: str
    error: TransferError | None


@dataclass
class Sent:
    """A send ended: `num_sent` blocks delivered (the receiver held the rest), or the error."""

    request_id: str  # the sending engine's own id for the request
    handoff: KVHandoff
    num_sent: int
    error: TransferError | None


HandoffEvent = HeaderArrived | Received | Sent
# Writes one run of arrived blocks: (indices within the request's blocks, one tensor per cache).
WriteBlocks = Callable[[list[int], Sequence[torch.Tensor]], None]


class HandoffThreads:
    """One engine's KV handoff threads and the events they post for its engine thread."""

    def __init__(self, auth: HandoffAuth) -> None:
        """`auth`: the deployment's KV transfer secret, signing what is sent and checking what arrives."""
        self.auth = auth
        self._events: queue.SimpleQueue[HandoffEvent] = queue.SimpleQueue()
        self._wake: Callable[[], None] = lambda: None
        self._pool = ThreadPoolExecutor(max_workers=MAX_CONCURRENT, thread_name_prefix="pagoda-kv")
        self._listener: KVListener | None = None
        self._closed = threading.Event()
        self._segments = ShmSegments()  # shm sends: segments reused across handoffs
        self.address: str | None = None

    def set_wake(self, wake: Callable[[], None]) -> None:
        """`wake()` is called (from these threads) after every posted event."""
        self._wake = wake

    # ---- decode side ---------------------------------------------------------------------------

    def listen(self, transport: str, address: str | None, timeout: float) -> str:
        """Start accepting handoffs; returns the address senders connect to."""
        self._listener = KVListener(transport, self.auth, address)
        self.address = self._listener.address
        threading.Thread(
            target=self._accept_loop, args=(self._listener, timeout), name="pagoda-kv-listener", daemon=True
        ).start()
        return self.address

    def _accept_loop(self, listener: KVListener, timeout: float) -> None:
        while not self._closed.is_set():
            try:
                conn = listener.accept_connection(_ACCEPT_POLL)
            except TransferError:
                continue  # no connection within the poll: look at _closed again
            except OSError:
                return  # closed under us
            self._pool.submit(self._read_header, conn, listener.transport, timeout, listener.segment_maps)

    def _read_header(self, conn: socket.socket, transport: str, timeout: float, maps: SegmentMaps) -> None:
        try:
            incoming = IncomingHandoff(conn, transport, timeout, self.auth, maps)
        except TransferError as error:
            logger.warning("a KV handoff connection failed before its header: %s", error)
            return
        self._post(HeaderArrived(incoming))

    def receive(self, incoming: IncomingHandoff, request_id: str, skip: int, write: WriteBlocks) -> None:
        """Ask for blocks skip.. of `incoming` and write each run as it arrives, on a pool thread."""
        self._pool.submit(self._receive, incoming, request_id, skip, write)

    def _receive(self, incoming: IncomingHandoff, request_id: str, skip: int, write: WriteBlocks) -> None:
        error = None
        try:
            for indices, data in incoming.receive(skip):
                write(indices, data)
        except TransferError as exc:
            error = exc
        except Exception as exc:  # a bug while writing: the engine must still hear of it
            logger.exception("receiving the KV of %s failed", request_id)
            error = TransferError(f"receiving the KV failed: {exc!r}")
        finally:
            incoming.close()
        self._post(Received(request_id, error))

    # ---- prefill side --------------------------------------------------------------------------

    def send(self, request_id: str, handoff: KVHandoff, transport: str, address: str, timeout: float) -> None:
        """Send `handoff` on a pool thread; a `Sent` event reports how it went."""
        self._pool.submit(self._send, request_id, handoff, transport, address, timeout)

    def _send(self, request_id: str, handoff: KVHandoff, transport: str, address: str, timeout: float) -> None:
        try:
            num_sent, error = send_handoff(handoff, transport, address, timeout, self.auth, self._segments), None
        except TransferError as exc:
            num_sent, error = 0, exc
        except Exception as exc:  # e.g. a malformed address
            num_sent, error = 0, TransferError(f"sending the KV failed: {exc!r}")
        self._post(Sent(request_id, handoff, num_sent, error))

    # ---- the engine thread's side --------------------------------------------------------------

    def _post(self, event: HandoffEvent) -> None:
        self._events.put(event)
        self._wake()

    def has_events(self) -> bool:
        return not self._events.empty()

    def take_events(self) -> list[HandoffEvent]:
        events = []
        while True:
            try:
                events.append(self._events.get_nowait())
            except queue.Empty:
                return events

    def close(self) -> None:
        """Stop listening; transfers under way end (or time out) on their own."""
        self._closed.set()
        if self._listener is not None:
            self._listener.close()
        self._pool.shutdown(wait=False, cancel_futures=True)
        self._segments.close()
