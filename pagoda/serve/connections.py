"""Connections a client cannot hold forever: a deadline and a size cap for each request's head,
and caps on open connections, in all and per client address.

uvicorn's own keep-alive timer starts only after a first response, so a client that connects
and sends nothing, or sends its request line one byte at a time, holds a connection (a file
descriptor and a protocol object) for as long as it likes; enough of them exhaust the server.
`ConnectionGuard` adds to uvicorn's HTTP protocol (httptools' when installed, else h11's):

- a header deadline: from the moment a connection opens, and again from the end of each
  response, the next request's head (request line and headers) must arrive complete within
  `header_timeout` seconds, or the connection is closed without an answer;
- a head size cap: a request head (request line and headers) larger than `max_header_bytes`
  gets a 431 and the connection is closed, before the parser holds more of it (httptools has
  no limit of its own: a 60 MB header was read whole);
- a connection cap: a connection opened while `max_connections` are open gets a 503 in the
  API's error shape and is closed at once, before anything is read from it;
- a per-client cap: likewise for a connection from an address that already holds
  `max_connections_per_client` (one client's idle sockets cannot take every slot).

Idle keep-alive connections are closed after uvicorn's `timeout_keep_alive`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from dataclasses import dataclass, field
from typing import Any

import uvicorn
from uvicorn.protocols.http.h11_impl import H11Protocol

from pagoda.serve.errors import error_body
from pagoda.serve.settings import ServerSettings

logger = logging.getLogger(__name__)

# File descriptors the process needs besides client connections (engine pipes, model files,
# logs, the listening socket).
RESERVED_FILE_DESCRIPTORS = 256
RETRY_AFTER_SECONDS = 1


def _refusal_bytes(
    message: str = "The server has too many open connections; retry shortly.", code: str = "too_many_connections"
) -> bytes:
    body = json.dumps(error_body(message, type="server_overloaded", code=code)).encode()
    head = (
        b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n"
        b"retry-after: " + str(RETRY_AFTER_SECONDS).encode() + b"\r\nconnection: close\r\n\r\n"
    )
    return head + body


def _head_too_large_bytes(limit: int) -> bytes:
    body = json.dumps(
        error_body(
            f"Request header fields exceed the server's limit of {limit} bytes.",
            type="invalid_request_error",
            code="request_header_too_large",
        )
    ).encode()
    head = (
        b"HTTP/1.1 431 Request Header Fields Too Large\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\nconnection: close\r\n\r\n"
    )
    return head + body


_HEAD_END = b"\r\n\r\n"


@dataclass
class ConnectionLimits:
    header_timeout: float  # seconds for a request's head to arrive complete
    max_connections: int  # open connections at once; more are refused at accept
    max_connections_per_client: int  # open connections from one address at once
    max_header_bytes: int  # a request head larger than this gets 431
    refused: int = 0  # connections refused so far (shared by every connection of one server)
    warned_at_cap: bool = False  # a warning per episode of running at the cap, not per refusal
    by_client: dict[str, int] = field(default_factory=dict)  # open connections per client address
    heads_too_large: int = 0  # requests answered 431 so far


class ConnectionGuard:
    """The header deadline and the connection cap, mixed into one of uvicorn's HTTP protocols
    (`limits`, one object per server, set on the subclass `guarded_protocol` makes). The
    protocol calls `_head_received` once a request's head is parsed."""

    limits: ConnectionLimits
    connections: set[Any]
    loop: asyncio.AbstractEventLoop
    transport: asyncio.Transport
    cycle: Any

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.header_deadline: asyncio.TimerHandle | None = None
        self.client_address: str | None = None  # counted in limits.by_client while open
        self.head_bytes: int | None = 0  # bytes of the head being received; None once it is in
        self.head_tail = b""  # the last bytes seen, for a head end split between reads

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        limits = self.limits
        if len(self.connections) > limits.max_connections:
            limits.refused += 1
            if not limits.warned_at_cap:
                limits.warned_at_cap = True
                logger.warning(
                    "%d connections are open (--max-connections): refusing new ones with 503 until some close",
                    limits.max_connections,
                )
            self.transport.write(_refusal_bytes())  # the protocol's own, set by super()
            transport.close()
            return
        peer = transport.get_extra_info("peername")
        address = peer[0] if isinstance(peer, (tuple, list)) and peer else None
        if address is not None and limits.by_client.get(address, 0) >= limits.max_connections_per_client:
            limits.refused += 1  # not logged one by one: the client decides how many there are
            self.transport.write(
                _refusal_bytes(
                    "This client has too many open connections; close some first.", "too_many_client_connections"
                )
            )
            transport.close()
            return
        if address is not None:
            self.client_address = address
            limits.by_client[address] = limits.by_client.get(address, 0) + 1
        if limits.warned_at_cap and len(self.connections) < limits.max_connections:
            limits.warned_at_cap = False
            logger.info("below --max-connections again; %d connections refused so far", limits.refused)
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_deadline()
        if self.client_address is not None:
            by_client = self.limits.by_client
            left = by_client.get(self.client_address, 1) - 1
            if left > 0:
                by_client[self.client_address] = left
            else:
                by_client.pop(self.client_address, None)
            self.client_address = None
        super().connection_lost(exc)  # type: ignore[misc]

    def data_received(self, data: bytes) -> None:
        if self.head_bytes is not None and not self._head_fits(data):
            return
        super().data_received(data)  # type: ignore[misc]

    def _head_fits(self, data: bytes) -> bool:
        """Count `data` toward the head being received (up to its end, when it is in `data`);
        False, with the 431 sent and the connection closing, once the head is too large."""
        seen = self.head_tail + data
        end = seen.find(_HEAD_END)
        counted = len(data) if end < 0 else max(0, end + len(_HEAD_END) - len(self.head_tail))
        self.head_bytes = (self.head_bytes or 0) + counted
        self.head_tail = seen[-(len(_HEAD_END) - 1) :]
        if self.head_bytes <= self.limits.max_header_bytes:
            return True
        self.limits.heads_too_large += 1
        self.head_bytes = None
        self._cancel_header_deadline()
        if not self.transport.is_closing():
            self.transport.write(_head_too_large_bytes(self.limits.max_header_bytes))
            self.transport.close()
        return False

    def on_response_complete(self) -> None:
        # Armed before uvicorn looks at pipelined data: a complete head in it cancels this.
        if not self.transport.is_closing():
            self._arm_header_deadline()
        super().on_response_complete()  # type: ignore[misc]

    def _head_received(self) -> None:
        self._cancel_header_deadline()
        self.head_bytes = None

    def _arm_header_deadline(self) -> None:
        self._cancel_header_deadline()
        self.head_bytes, self.head_tail = 0, b""  # the next request's head starts
        self.header_deadline = self.loop.call_later(self.limits.header_timeout, self._header_timed_out)

    def _cancel_header_deadline(self) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
            self.header_deadline = None

    def _header_timed_out(self) -> None:
        self.header_deadline = None
        handling = self.cycle is not None and not self.cycle.response_complete
        if not handling and not self.transport.is_closing():
            logger.debug(
                "closing a connection whose request head did not arrive within %g s", self.limits.header_timeout
            )
            self.transport.close()


class GuardedH11Protocol(ConnectionGuard, H11Protocol):
    """uvicorn's pure-Python h11 protocol, guarded."""

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's head is in: its cycle has begun
            self._head_received()


def _httptools_protocol() -> type[ConnectionGuard] | None:
    """uvicorn's httptools protocol, guarded, when httptools is installed (its C parser costs a
    fraction of h11's per request: what a flood of refusals is made of)."""
    try:
        from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol
    except ImportError:
        return None

    class GuardedHttpToolsProtocol(ConnectionGuard, HttpToolsProtocol):
        def on_headers_complete(self) -> None:
            super().on_headers_complete()
            self._head_received()

    return GuardedHttpToolsProtocol


def guarded_protocol(settings: ServerSettings) -> type[asyncio.Protocol]:
    """A protocol class for one server, its limits from `settings`, on the parser
    `settings.http_parser` names ("auto": httptools when installed, else h11)."""
    per_client = settings.max_connections_per_client or max(1, settings.max_connections - settings.max_connections // 8)
    limits = ConnectionLimits(settings.header_timeout, settings.max_connections, per_client, settings.max_header_bytes)
    base = None if settings.http_parser == "h11" else _httptools_protocol()
    base = base or GuardedH11Protocol
    return type(base.__name__, (base,), {"limits": limits})


def http_config(app: Any, settings: ServerSettings, **options: Any) -> uvicorn.Config:
    """uvicorn's config for `app` with the connection settings of `settings`; `options` are
    uvicorn.Config's other arguments (host, port, log level...)."""
    return uvicorn.Config(
        app,
        http=guarded_protocol(settings),
        timeout_keep_alive=settings.keep_alive_timeout,  # type: ignore[arg-type]
        # h11's own cap past ours, so an oversized head gets our 431 on either parser
        h11_max_incomplete_event_size=settings.max_header_bytes + 4096,
        **options,
    )


def raise_file_limit(max_connections: int) -> None:
    """Raise the soft open-files limit so `max_connections` clients fit (up to the hard limit);
    warn when even that is too low."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    needed = max_connections + RESERVED_FILE_DESCRIPTORS
    if soft != resource.RLIM_INFINITY and soft < needed:
        target = needed if hard == resource.RLIM_INFINITY else min(needed, hard)
        if target > soft:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
            soft = target
        if soft < needed:
            logger.warning(
                "the open-files limit (%d) is below --max-connections %d plus %d for "
                "the server itself: raise `ulimit -n` or lower --max-connections",
                soft,
                max_connections,
                RESERVED_FILE_DESCRIPTORS,
            )
