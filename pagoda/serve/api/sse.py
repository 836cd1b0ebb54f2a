"""Server-sent events, and noticing clients that go away so their requests are aborted.

ASGI servers on spec 2.4 only report a vanished client when a write fails, which never
happens while a request waits in the queue or generates a long non-streamed answer. Both
paths here therefore listen for `http.disconnect` themselves and cancel the work.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from starlette.responses import StreamingResponse
from starlette.types import Receive, Scope, Send

from pagoda.serve.errors import APIError

T = TypeVar("T")


class ClientDisconnected(Exception):
    """The client closed the connection before the answer was ready."""


async def wait_for_disconnect(receive: Receive) -> None:
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


async def cancel_on_disconnect(request: Request, work: Awaitable[T]) -> T:
    """Await `work`, cancelling it (and raising ClientDisconnected) if the client leaves."""
    work_task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(wait_for_disconnect(request.receive))
    try:
        done, _ = await asyncio.wait({work_task, listener}, return_when=asyncio.FIRST_COMPLETED)
        if work_task in done:
            return work_task.result()
        work_task.cancel()
        try:
            await work_task
        except (asyncio.CancelledError, Exception):
            pass
        raise ClientDisconnected()
    finally:
        listener.cancel()
        if not work_task.done():
            work_task.cancel()


class EventStreamResponse(StreamingResponse):
    """Server-sent events that stop (cancelling the body iterator) when the client leaves.

    `on_close` runs however the response ends, even if the body iterator never started.
    """

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[str], on_close: Callable[[], None]) -> None:
        super().__init__(content, headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
        self._on_close = on_close

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        stream_task = asyncio.ensure_future(self.stream_response(send))
        listener = asyncio.ensure_future(wait_for_disconnect(receive))
        try:
            await asyncio.wait({stream_task, listener}, return_when=asyncio.FIRST_COMPLETED)
            if not stream_task.done():
                stream_task.cancel()
            try:
                await stream_task
            except (asyncio.CancelledError, OSError):
                pass
        finally:
            listener.cancel()
            if not stream_task.done():
                stream_task.cancel()
            self._on_close()


# Line breaks to Python's str.splitlines (which line-based SSE clients such as httpx's
# aiter_lines use) that JSON leaves raw: escaped so an event always stays on one line.
_LINE_BREAKS = str.maketrans({"\u2028": "\\u2028", "\u2029": "\\u2029", "\x85": "\\u0085"})


def to_json(value: Any) -> str:
    """Compact JSON that is safe inside one SSE line."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).translate(_LINE_BREAKS)


def sse_event(payload: dict[str, Any]) -> str:
    return f"data: {to_json(payload)}\n\n"


class ChoiceChunks:
    """Streamed chunks that each carry one choice, formatted from a fixed head and tail.

    Every chunk of a response repeats id, object, created and model; serialising only the
    choice keeps the per-token work of a stream small.
    """

    def __init__(self, base: dict[str, Any], include_usage: bool) -> None:
        self.base = base
        self.include_usage = include_usage
        self._head = "data: " + to_json(base)[:-1] + ',"choices":[{'
        self._tail = '}],"usage":null}\n\n' if include_usage else "}]}\n\n"

    def event(self, choice_fields: str) -> str:
        """`choice_fields`: the choice object's members as JSON text, without braces."""
        return self._head + choice_fields + self._tail


def sse_error(error: APIError) -> str:
    """How a failure after the stream started is reported (the status is already sent)."""
    return sse_event(error.body())


SSE_DONE = "data: [DONE]\n\n"
