"""Reading server-sent events from the lines of a streamed response (httpx's `iter_lines` /
`aiter_lines`, or a whole body's `splitlines()`).

One `data:` line is one event: OpenAI-compatible servers, pagoda's included (serve/api/sse.py
escapes the line breaks JSON would leave raw), never split an event's data over several lines.
Blank lines end events and `:` lines are comments; both are skipped.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterable, AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any

DONE = "[DONE]"


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
        return SseEvent(line, line[len("data:"):].strip())
    if other_lines is not None and line.strip() and not line.startswith(":"):
        other_lines.append(line)
    return None


def iter_sse_events(lines: Iterable[str], other_lines: list[str] | None = None) -> Iterator[SseEvent]:
    """The events of a stream's lines, `data: [DONE]` included (see `SseEvent.done`)."""
    for line in lines:
        if (event := sse_event(line, other_lines)) is not None:
            yield event


async def aiter_sse_events(lines: AsyncIterable[str],
                           other_lines: list[str] | None = None) -> AsyncIterator[SseEvent]:
    """`iter_sse_events` over an async stream of lines."""
    async for line in lines:
        if (event := sse_event(line, other_lines)) is not None:
            yield event
