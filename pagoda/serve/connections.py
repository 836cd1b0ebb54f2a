"""Connections a client cannot hold forever: a deadline for each request's head, and a cap on
open connections.

uvicorn's own keep-alive timer starts only after a first response, so a client that connects
and sends nothing, or sends its request line one byte at a time, holds a connection (a file
descriptor and a protocol object) for as long as it likes; enough of them exhaust the server.
`ConnectionGuard` adds to uvicorn's HTTP protocol (httptools' when installed, else h11's):

- a header deadline: from the moment a connection opens, and again from the end of each
  response, the next request's head (request line and headers) must arrive complete within
  `header_timeout` seconds, or the connection is closed without an answer;
- a connection cap: a connection opened while `max_connections` are open gets a 503 in the
  API's error shape and is closed at once, before anything is read from it.

Idle keep-alive connections are closed after uvicorn's `timeout_keep_alive`.
"""

from __future__ import annotations

import asyncio
import json
import logging
import resource
from dataclasses import dataclass
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


def _refusal_bytes() -> bytes:
    body = json.dumps(error_body("The server has too many open connections; retry shortly.",
                                 type="server_overloaded", code="too_many_connections")).encode()
    head = (b"HTTP/1.1 503 Service Unavailable\r\ncontent-type: application/json\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n"
            b"retry-after: " + str(RETRY_AFTER_SECONDS).encode() + b"\r\nconnection: close\r\n\r\n")
    return head + body


@dataclass
class ConnectionLimits:
    header_timeout: float  # seconds for a request's head to arrive complete
    max_connections: int  # open connections at once; more are refused at accept
    refused: int = 0  # connections refused so far (shared by every connection of one server)
    warned_at_cap: bool = False  # a warning per episode of running at the cap, not per refusal


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

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        super().connection_made(transport)  # type: ignore[misc]
        limits = self.limits
        if len(self.connections) > limits.max_connections:
            limits.refused += 1
            if not limits.warned_at_cap:
                limits.warned_at_cap = True
                logger.warning("%d connections are open (--max-connections): refusing new ones "
                               "with 503 until some close", limits.max_connections)
            self.transport.write(_refusal_bytes())  # the protocol's own, set by super()
            transport.close()
            return
        if limits.warned_at_cap and len(self.connections) < limits.max_connections:
            limits.warned_at_cap = False
            logger.info("below --max-connections again; %d connections refused so far", limits.refused)
        self._arm_header_deadline()

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_header_deadline()
        super().connection_lost(exc)  # type: ignore[misc]

    def on_response_complete(self) -> None:
        # Armed before uvicorn looks at pipelined data: a complete head in it cancels this.
        if not self.transport.is_closing():
            self._arm_header_deadline()
        super().on_response_complete()  # type: ignore[misc]

    def _head_received(self) -> None:
        self._cancel_header_deadline()

    def _arm_header_deadline(self) -> None:
        self._cancel_header_deadline()
        self.header_deadline = self.loop.call_later(self.limits.header_timeout,
                                                    self._header_timed_out)

    def _cancel_header_deadline(self) -> None:
        if self.header_deadline is not None:
            self.header_deadline.cancel()
            self.header_deadline = None

    def _header_timed_out(self) -> None:
        self.header_deadline = None
        handling = self.cycle is not None and not self.cycle.response_complete
        if not handling and not self.transport.is_closing():
            logger.debug("closing a connection whose request head did not arrive within %g s",
                         self.limits.header_timeout)
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
    limits = ConnectionLimits(settings.header_timeout, settings.max_connections)
    base = None if settings.http_parser == "h11" else _httptools_protocol()
    base = base or GuardedH11Protocol
    return type(base.__name__, (base,), {"limits": limits})


def http_config(app: Any, settings: ServerSettings, **options: Any) -> uvicorn.Config:
    """uvicorn's config for `app` with the connection settings of `settings`; `options` are
    uvicorn.Config's other arguments (host, port, log level...)."""
    return uvicorn.Config(app, http=guarded_protocol(settings),
                          timeout_keep_alive=settings.keep_alive_timeout,  # type: ignore[arg-type]
                          **options)


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
            logger.warning("the open-files limit (%d) is below --max-connections %d plus %d for "
                           "the server itself: raise `ulimit -n` or lower --max-connections",
                           soft, max_connections, RESERVED_FILE_DESCRIPTORS)
