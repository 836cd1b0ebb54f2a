"""Forwarding one OpenAI-compatible request to another server, with hard limits on how long it
may take to connect and to send its first byte: a server that is down or stuck is reported as
`ForwardFailed` (with why) within those limits, never a hang.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

import httpx


class ForwardFailed(Exception):
    """The other server could not be used; `reason` is short and fit for a metric label
    (connect_error, connect_timeout, first_byte_timeout, read_error, status_NNN)."""

    def __init__(self, reason: str, detail: str) -> None:
        super().__init__(f"{reason}: {detail}")
        self.reason = reason


@dataclass
class ForwardedResponse:
    """A 200 answer whose head (and first bytes) arrived; `body` yields the rest, then closes."""

    status: int
    content_type: str
    first: bytes
    rest: AsyncIterator[bytes]

    async def body(self) -> AsyncIterator[bytes]:
        if self.first:
            yield self.first
        async for chunk in self.rest:
            yield chunk


async def forward_json(
    url: str, body: dict[str, Any], *, api_key: str | None = None, connect_timeout: float, first_byte_timeout: float
) -> ForwardedResponse:
    """POST `body` as JSON to `url` and wait for the head and first bytes of a 200 answer;
    ForwardFailed otherwise. The connection closes once `rest` is read to its end or closed."""
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    timeout = httpx.Timeout(
        connect=connect_timeout, read=first_byte_timeout, write=first_byte_timeout, pool=connect_timeout
    )
    client = httpx.AsyncClient(timeout=timeout)
    try:
        response = await client.send(client.build_request("POST", url, json=body, headers=headers), stream=True)
    except httpx.ConnectTimeout as exc:
        await client.aclose()
        raise ForwardFailed("connect_timeout", str(exc) or url) from None
    except (httpx.ConnectError, httpx.PoolTimeout) as exc:
        await client.aclose()
        raise ForwardFailed("connect_error", str(exc) or url) from None
    except httpx.TimeoutException as exc:
        await client.aclose()
        raise ForwardFailed("first_byte_timeout", str(exc) or url) from None
    except httpx.HTTPError as exc:
        await client.aclose()
        raise ForwardFailed("read_error", str(exc) or url) from None
    chunks = response.aiter_raw()
    try:
        if response.status_code != 200:
            raise ForwardFailed(
                f"status_{response.status_code}", (await response.aread())[:200].decode(errors="replace")
            )
        first = await anext(chunks, b"")
    except httpx.TimeoutException as exc:
        await response.aclose()
        await client.aclose()
        raise ForwardFailed("first_byte_timeout", str(exc) or url) from None
    except (httpx.HTTPError, ForwardFailed) as exc:
        await response.aclose()
        await client.aclose()
        if isinstance(exc, ForwardFailed):
            raise
        raise ForwardFailed("read_error", str(exc) or url) from None

    async def rest() -> AsyncIterator[bytes]:
        try:
            async for chunk in chunks:
                yield chunk
        finally:
            await response.aclose()
            await client.aclose()

    return ForwardedResponse(
        response.status_code, response.headers.get("content-type", "application/json"), first, rest()
    )
