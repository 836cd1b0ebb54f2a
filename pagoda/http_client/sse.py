"""Reading server-sent events from the lines of a streamed response (`aiter_sse_lines` over
httpx's `aiter_text`, httpx's `iter_lines`, or a whole body's `splitlines()`).

One `data:` line is one event: OpenAI-compatible servers, pagoda's included (serve/api/sse.py
escapes the line breaks JSON would leave raw), never split an event's data over several lines.
Blank lines end events and `:` lines are comments; both are skipped.
"""

from __future__ import annotations

import json
import re
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

DONE = "[DONE]"
# SSE ends a line at CR LF, LF or CR only. httpx's `aiter_lines` (like str.splitlines) also ends
# one at U+0085, U+2028, U+2029 and a few control characters, which JSON may carry raw inside a
# string: another server's event with such a token would be cut in two.
_LINE_END = re.compile(r"\r\n|\r|\n")


@dataclass(frozen=True)
class SseEvent:
    """One `data:` line: the line as received and its payload (whitespace stripped)."""

    line: str
    data: str

    @property
    def done(self) -> bool:
        """The `data: [DONE]` that ends an OpenAI stream."""
        return self.data == DONE

    def json(self) -> Any:
        """The payload parsed as JSON (json.JSONDecodeError when it is not)."""
        return json.loads(self.data)


def sse_event(line: str, other_lines: list[str] | None = None) -> SseEvent | None:
    """The event a line carries, None for any other line. A line that is neither data, blank
    nor a comment (an `event:` or `id:` field, or garbage) goes to `other_lines` when given."""
    if line.startswith("data:"):
        return SseEvent(line, line[len("data:") :].strip())
    if other_lines is not None and line.strip() and not line.startswith(":"):
        other_lines.append(line)
    return None


def iter_sse_events(lines: Iterable[str], other_lines: list[str] | None = None) -> Iterator[SseEvent]:
    """The events of a stream's lines, `data: [DONE]` included (see `SseEvent.done`)."""
    for line in lines:
        if (event := sse_event(line, other_lines)) is not None:
            yield event


async def aiter_sse_events(lines: AsyncIterable[str], other_lines: list[str] | None = None) -> AsyncIterator[SseEvent]:
    """`iter_sse_events` over an async stream of lines."""
    async for line in lines:
        if (event := sse_event(line, other_lines)) is not None:
            yield event


async def aiter_sse_lines(chunks: AsyncIterable[str]) -> AsyncIterator[str]:
    """The lines of a streamed text body (httpx's `aiter_text`), split where SSE splits them."""
    pending = ""
    async for chunk in chunks:
        pending += chunk
        # A CR at the end may be the first half of a CR LF: it waits for the next chunk.
        held = "\r" if pending.endswith("\r") else ""
        *lines, rest = _LINE_END.split(pending[: len(pending) - len(held)])
        for line in lines:
            yield line
        pending = rest + held
    if pending.rstrip("\r"):
        yield pending.rstrip("\r")
