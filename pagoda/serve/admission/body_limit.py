"""ASGI middleware that refuses request bodies over a size limit with a 413, and bodies that
take longer than a deadline to arrive with a 408.

The body is read here (up to the limit) and replayed to the app, so a chunked upload with
no Content-Length is bounded too; after the replay the app's `receive` falls through to the
server's, which is how handlers still notice a disconnect. The deadline bounds a client that
sends a body a byte at a time: without it, each such request holds a connection and an app task
for as long as the client likes (the connection guard bounds only the headers).
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagoda.serve.errors import bad_request, body_timed_out, request_too_large


class BodySizeLimit:
    def __init__(
        self,
        app: ASGIApp,
        max_bytes: int,
        on_reject: Callable[[], None] | None = None,
        timeout: float | None = None,
        on_timeout: Callable[[], None] | None = None,
    ) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject
        self.timeout = timeout
        self.on_timeout = on_timeout

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope["method"] in ("GET", "HEAD", "OPTIONS"):
            await self.app(scope, receive, send)
            return
        headers = dict(scope.get("headers") or [])
        declared = headers.get(b"content-length")
        if declared is not None:
            try:
                length = int(declared)
            except ValueError:
                await _send_error(send, 400, bad_request("Invalid Content-Length header.").body())
                return
            if length > self.max_bytes:
                await self._reject(send)
                return
        try:
            chunks = await asyncio.wait_for(self._read_body(receive, send), self.timeout)
        except asyncio.TimeoutError:
            if self.on_timeout is not None:
                self.on_timeout()
            await _send_error(send, 408, body_timed_out(self.timeout or 0).body())
            return
        if chunks is None:
            return
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _read_body(self, receive: Receive, send: Send) -> list[bytes] | None:
        """The body's chunks, or None when it was refused (413) or the client left."""
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return None
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._reject(send)
                return None
            chunks.append(body)
            if not message.get("more_body", False):
                return chunks

    async def _reject(self, send: Send) -> None:
        if self.on_reject is not None:
            self.on_reject()
        await _send_error(send, 413, request_too_large(self.max_bytes).body())


async def _send_error(send: Send, status: int, body: dict) -> None:
    payload = json.dumps(body).encode()
    await send(
        {
            "type": "http.response.start",
            "status": status,
            "headers": [
                (b"content-type", b"application/json"),
                (b"content-length", str(len(payload)).encode()),
                (b"connection", b"close"),
            ],
        }
    )
    await send({"type": "http.response.body", "body": payload})
