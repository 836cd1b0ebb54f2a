"""The SSE reader the load generator, the gate, the audit and the tests share."""

from __future__ import annotations

import asyncio
import json

import pytest

from pagoda.http_client.sse import aiter_sse_events, aiter_sse_lines, iter_sse_events

STREAM = [
    ": keep-alive",
    'data: {"choices": [{"text": "a"}]}',
    "",
    "event: ping",
    'data:{"choices": []}',
    "",
    "data: [DONE]",
    "",
]


def test_data_lines_are_events_and_done_ends_the_stream() -> None:
    events = list(iter_sse_events(STREAM))
    assert [e.line for e in events] == [STREAM[1], STREAM[4], STREAM[6]]
    assert events[0].json() == {"choices": [{"text": "a"}]}
    assert events[1].data == '{"choices": []}'  # no space after the colon is still data
    assert [e.done for e in events] == [False, False, True]


def test_other_lines_are_collected_when_asked() -> None:
    other: list[str] = []
    list(iter_sse_events(STREAM, other))
    assert other == ["event: ping"]  # comments and blank lines are part of the format


def test_async_reader_matches_the_sync_one() -> None:
    async def lines():
        for line in STREAM:
            yield line

    async def read() -> list[str]:
        return [event.data async for event in aiter_sse_events(lines())]

    assert asyncio.run(read()) == [e.data for e in iter_sse_events(STREAM)]


def test_malformed_payload_raises_on_json() -> None:
    event = next(iter_sse_events(["data: {not json"]))
    with pytest.raises(json.JSONDecodeError):
        event.json()


def test_lines_split_only_where_sse_splits_them() -> None:
    """A token such as U+2028 or U+0085 travels raw inside a JSON string (llama-server sends it
    so); only CR LF, LF and CR end a line, also when a chunk ends between CR and LF."""
    event = json.dumps({"text": "a\u2028b\x85c\x1cd"}, ensure_ascii=False)
    body = f"data: {event}\r\n\r\ndata: [DONE]\n\n"

    async def lines(chunks: list[str]) -> list[str]:
        async def source():
            for chunk in chunks:
                yield chunk

        return [line async for line in aiter_sse_lines(source())]

    cuts = [body[: len(f"data: {event}\r")], body[len(f"data: {event}\r") :]]
    for chunks in ([body], cuts, list(body)):
        got = asyncio.run(lines(chunks))
        assert got == [f"data: {event}", "", "data: [DONE]", ""]
        assert json.loads(next(iter_sse_events(got)).data)["text"] == "a\u2028b\x85c\x1cd"
