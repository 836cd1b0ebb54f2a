"""Graceful shutdown: on the first SIGINT/SIGTERM stop taking requests and let the running ones
finish, bounded by --shutdown-timeout; on a second signal exit at once.

`DrainGate` is a pure ASGI middleware that counts HTTP requests in flight and, once draining,
answers every new request (and /health, so a load balancer takes the server out) with 503 in
OpenAI's error shape. `DrainingServer` is uvicorn's server with its signal handling replaced:
uvicorn alone would close the listening socket at once (clients see connection refused, not a
503) and, after a graceful stop, re-raise the signal (a KeyboardInterrupt traceback).
"""

from __future__ import annotations

import json
import logging
import threading
import time
from collections.abc import Callable
from types import FrameType
from typing import Any

import uvicorn

logger = logging.getLogger(__name__)

POLL_SECONDS = 0.05
RETRY_AFTER_SECONDS = 5


class DrainGate:
    """ASGI middleware: counts requests in flight; refuses new ones with 503 while draining."""

    def __init__(self, app: Any) -> None:
        self.app = app
        self.in_flight = 0
        self.draining = False

    async def __call__(self, scope: dict, receive: Callable, send: Callable) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if self.draining:
            await _send_shutting_down(send)
            return
        self.in_flight += 1
        try:
            await self.app(scope, receive, send)
        finally:
            self.in_flight -= 1


async def _send_shutting_down(send: Callable) -> None:
    body = json.dumps(
        {
            "error": {
                "message": "The server is shutting down; retry on another replica.",
                "type": "server_error",
                "param": None,
                "code": "shutting_down",
            }
        }
    ).encode()
    await send(
        {
            "type": "http.response.start",
            "status": 503,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(body)).encode()),
                (b"retry-after", str(RETRY_AFTER_SECONDS).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": body})


class DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first signal drains through `gate` and whose second exits now."""

    def __init__(
        self, config: uvicorn.Config, gate: DrainGate, shutdown_timeout: float, on_force_exit: Callable[[], None]
    ) -> None:
        super().__init__(config)
        self.gate = gate
        self.shutdown_timeout = shutdown_timeout
        self.on_force_exit = on_force_exit

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        # Not appended to uvicorn's _captured_signals: it would re-raise them after the stop.
        if self.gate.draining:
            logger.warning("second signal: exiting now")
            self.on_force_exit()
            self.force_exit = True
            self.should_exit = True
            return
        self.gate.draining = True
        logger.info(
            "draining: %d request(s) in flight, new requests get 503; waiting up to %.1f s (signal again to exit now)",
            self.gate.in_flight,
            self.shutdown_timeout,
        )
        threading.Thread(target=self._exit_when_drained, name="pagoda-drain", daemon=True).start()

    def _exit_when_drained(self) -> None:
        deadline = time.monotonic() + self.shutdown_timeout
        while self.gate.in_flight > 0 and time.monotonic() < deadline:
            time.sleep(POLL_SECONDS)
        if self.gate.in_flight > 0:
            logger.warning("shutdown timeout: cutting %d request(s) still in flight", self.gate.in_flight)
        self.should_exit = True
