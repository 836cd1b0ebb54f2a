"""ASGI middleware that refuses request bodies over a size limit with a 413.

The body is read here (up to the limit) and replayed to the app, so a chunked upload with
no Content-Length is bounded too; after the replay the app's `receive` falls through to the
server's, which is how handlers still notice a disconnect.
"""

from __future__ import annotations

import json
from typing import Callable

from starlette.types import ASGIApp, Message, Receive, Scope, Send

from pagoda.serve.errors import bad_request, request_too_large


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int,
                 on_reject: Callable[[], None] | None = None) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.on_reject = on_reject

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
        chunks: list[bytes] = []
        size = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                return
            body = message.get("body", b"")
            size += len(body)
            if size > self.max_bytes:
                await self._reject(send)
                return
            chunks.append(body)
            if not message.get("more_body", False):
                break
        replayed = False

        async def replay() -> Message:
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": b"".join(chunks), "more_body": False}
            return await receive()

        await self.app(scope, replay, send)

    async def _reject(self, send: Send) -> None:
        if self.on_reject is not None:
            self.on_reject()
        await _send_error(send, 413, request_too_large(self.max_bytes).body())


async def _send_error(send: Send, status: int, body: dict) -> None:
    payload = json.dumps(body).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"),
                            (b"content-length", str(len(payload)).encode()),
                            (b"connection", b"close")]})
    await send({"type": "http.response.body", "body": payload})
