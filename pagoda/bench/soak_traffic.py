"""The mixed traffic of `pagoda bench soak`: classes of requests, each a few bounded loops on one
event loop, and what the clients saw (every status and error code, with the time it came).

Classes: chat streams, long prompts, `n > 1`, structured (JSON-schema) answers, disconnect storms
(streams dropped after their first token), oversized bodies (413), `/tokenize` floods, and
malformed or unwelcome requests (400 for `n` past its limit, 401 for an unknown key, 429 from a
tenant with a small request rate)."""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from pagoda.http_client.sse import aiter_sse_events

REQUEST_TIMEOUT_S = 120.0
# An oversized body whose 413 never reached the client: the server answered and closed before the
# client had sent it all, and the reset took the answer with it (the server counts it too_large).
UNREAD_413 = "closed_while_sending"
WORDS = (
    "the",
    "queue",
    "river",
    "engine",
    "stone",
    "paper",
    "window",
    "garden",
    "signal",
    "market",
    "yellow",
    "number",
    "quiet",
    "circle",
    "letter",
    "summer",
    "bridge",
    "cloud",
    "mirror",
    "table",
    "forest",
    "doctor",
    "planet",
    "silver",
    "orange",
    "animal",
    "music",
    "winter",
    "island",
    "pocket",
)
PERSON_SCHEMA = {
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
    "required": ["name", "age"],
    "additionalProperties": False,
}


@dataclass(frozen=True)
class Outcome:
    """One request's end as its client saw it. status: the HTTP status (0: the connection failed);
    code: the error code of the body or of a stream's error event, "disconnect" for a stream this
    client dropped on purpose, None for a success."""

    traffic: str
    at_s: float
    status: int
    code: str | None = None
    detail: str | None = None

    @property
    def server_error(self) -> bool:
        if self.status == 0:
            return self.code != UNREAD_413
        return self.status >= 500 or (self.status == 200 and self.code not in (None, "disconnect"))


@dataclass
class Tally:
    """Everything the clients saw; `finished_requests` counts each prompt whose choices all ended
    normally once (as the server's request_success_total does, whatever the `n`)."""

    started: float
    outcomes: list[Outcome] = field(default_factory=list)
    finished_requests: int = 0

    def add(self, traffic: str, status: int, code: str | None = None, detail: str | None = None) -> None:
        self.outcomes.append(Outcome(traffic, round(time.monotonic() - self.started, 3), status, code, detail))

    def by_class(self) -> dict[str, dict[str, int]]:
        counts: dict[str, Counter] = {}
        for o in self.outcomes:
            key = str(o.status) + (f" {o.code}" if o.code else "")
            counts.setdefault(o.traffic, Counter())[key] += 1
        return {name: dict(sorted(c.items())) for name, c in sorted(counts.items())}

    def count(self, status: int | None = None, code: str | None = None) -> int:
        return sum(
            1 for o in self.outcomes if (status is None or o.status == status) and (code is None or o.code == code)
        )


@dataclass(frozen=True)
class TrafficPlan:
    """Who sends what. `keys`: the general tenants' API keys (requests alternate between them);
    `limited_key`: a tenant with a small requests-per-minute; `max_request_bytes`: the server's
    body limit (oversized bodies exceed it); `long_prompt`: text of about the length wanted."""

    model: str
    keys: tuple[str, ...]
    limited_key: str | None
    max_request_bytes: int
    long_prompt: str
    chat_streams: int = 4
    seed: int = 0


def _error_code(response_body: bytes) -> str | None:
    try:
        error = json.loads(response_body).get("error") or {}
    except (ValueError, AttributeError):
        return "unparsable_body"
    return error.get("code") or error.get("type")


class SoakTraffic:
    """The traffic classes on one AsyncClient; `run(stop)` until `stop` is set."""

    def __init__(self, url: str, plan: TrafficPlan, tally: Tally) -> None:
        self.url = url
        self.plan = plan
        self.tally = tally
        self._random = random.Random(plan.seed)
        self._turn = 0

    def _headers(self, key: str | None = None) -> dict[str, str]:
        if key is None:
            self._turn += 1
            key = self.plan.keys[self._turn % len(self.plan.keys)] if self.plan.keys else None
        return {"Authorization": f"Bearer {key}"} if key else {}

    def _text(self, words: int) -> str:
        return " ".join(self._random.choice(WORDS) for _ in range(words))

    async def run(self, stop: asyncio.Event) -> None:
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=32)
        async with httpx.AsyncClient(
            base_url=self.url, timeout=REQUEST_TIMEOUT_S, limits=limits, trust_env=False
        ) as client:
            loops: list[tuple[str, Callable[[httpx.AsyncClient], Awaitable[None]], int, float]] = [
                ("chat_stream", self.chat_stream, self.plan.chat_streams, 0.2),
                ("long_prompt", self.long_prompt, 1, 0.5),
                ("n_samples", self.n_samples, 1, 0.5),
                ("structured", self.structured, 1, 0.5),
                ("disconnect", self.disconnect_storm, 1, 5.0),
                ("oversized", self.oversized, 1, 2.0),
                ("tokenize", self.tokenize_flood, 1, 3.0),
                ("malformed", self.malformed, 1, 3.0),
            ]
            await asyncio.gather(
                *(
                    self._loop(name, one, pause, client, stop)
                    for name, one, workers, pause in loops
                    for _ in range(workers)
                )
            )

    async def _loop(
        self,
        name: str,
        one: Callable[[httpx.AsyncClient], Awaitable[None]],
        pause_s: float,
        client: httpx.AsyncClient,
        stop: asyncio.Event,
    ) -> None:
        while not stop.is_set():
            try:
                await one(client)
            except (httpx.HTTPError, ValueError, KeyError, TypeError) as e:  # ValueError: a body that is not JSON
                self.tally.add(name, 0, type(e).__name__, str(e)[:200])
            try:
                await asyncio.wait_for(stop.wait(), pause_s * (0.5 + self._random.random()))
            except asyncio.TimeoutError:
                pass

    async def _post(
        self, client: httpx.AsyncClient, traffic: str, path: str, body: dict[str, Any], key: str | None = None
    ) -> None:
        response = await client.post(path, json=body, headers=self._headers(key))
        if response.status_code != 200:
            self.tally.add(traffic, response.status_code, _error_code(response.content))
            return
        if path.startswith("/v1/"):
            choices = response.json().get("choices") or []
            self.tally.finished_requests += sum(1 for c in choices if c.get("finish_reason")) // body.get("n", 1)
        self.tally.add(traffic, 200)

    async def _stream(
        self, client: httpx.AsyncClient, traffic: str, path: str, body: dict[str, Any], drop_after_first: bool = False
    ) -> None:
        async with client.stream("POST", path, json={**body, "stream": True}, headers=self._headers()) as response:
            if response.status_code != 200:
                self.tally.add(traffic, response.status_code, _error_code(await response.aread()))
                return
            finished, code = 0, None
            async for event in aiter_sse_events(response.aiter_lines()):
                if event.done:
                    break
                payload = event.json()
                if "error" in payload:
                    code = (payload["error"] or {}).get("code") or "stream_error"
                    break
                if drop_after_first and payload.get("choices"):
                    self.tally.add(traffic, 200, "disconnect")
                    return  # leaving the block closes the connection mid-stream
                finished += sum(1 for c in payload.get("choices") or [] if c.get("finish_reason"))
            if code is None:
                self.tally.finished_requests += finished
            self.tally.add(traffic, 200, code)

    async def chat_stream(self, client: httpx.AsyncClient) -> None:
        await self._stream(
            client,
            "chat_stream",
            "/v1/chat/completions",
            {
                "model": self.plan.model,
                "messages": [{"role": "user", "content": self._text(12)}],
                "max_tokens": self._random.randint(8, 32),
                "temperature": 0.8,
            },
        )

    async def long_prompt(self, client: httpx.AsyncClient) -> None:
        # A varying head so that each prompt is mostly cache misses (blocks flow down the tiers).
        await self._post(
            client,
            "long_prompt",
            "/v1/completions",
            {
                "model": self.plan.model,
                "prompt": self._text(4) + " " + self.plan.long_prompt,
                "max_tokens": 4,
                "temperature": 0,
            },
        )

    async def n_samples(self, client: httpx.AsyncClient) -> None:
        await self._post(
            client,
            "n_samples",
            "/v1/completions",
            {"model": self.plan.model, "prompt": self._text(8), "n": 3, "max_tokens": 12, "temperature": 0.9},
        )

    async def structured(self, client: httpx.AsyncClient) -> None:
        await self._post(
            client,
            "structured",
            "/v1/chat/completions",
            {
                "model": self.plan.model,
                "messages": [{"role": "user", "content": "a person: " + self._text(4)}],
                "max_tokens": 32,
                "temperature": 0.7,
                "response_format": {"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON_SCHEMA}},
            },
        )

    async def disconnect_storm(self, client: httpx.AsyncClient) -> None:
        body = {
            "model": self.plan.model,
            "prompt": self._text(10),
            "max_tokens": 200,
            "temperature": 0.8,
            "ignore_eos": True,
        }
        await asyncio.gather(
            *(self._stream(client, "disconnect", "/v1/completions", body, drop_after_first=True) for _ in range(4)),
            return_exceptions=False,
        )

    async def oversized(self, client: httpx.AsyncClient) -> None:
        filler = "x" * (self.plan.max_request_bytes + 1024)
        content = json.dumps({"model": self.plan.model, "prompt": filler, "max_tokens": 1}).encode()
        try:
            response = await client.post(
                "/v1/completions", content=content, headers={**self._headers(), "Content-Type": "application/json"}
            )
        except (httpx.ReadError, httpx.WriteError, httpx.RemoteProtocolError):
            self.tally.add("oversized", 0, UNREAD_413)
            return
        self.tally.add("oversized", response.status_code, _error_code(response.content))

    async def tokenize_flood(self, client: httpx.AsyncClient) -> None:
        prompt = self._text(400)

        async def one() -> None:
            response = await client.post(
                "/tokenize", json={"model": self.plan.model, "prompt": prompt}, headers=self._headers()
            )
            self.tally.add(
                "tokenize", response.status_code, None if response.status_code == 200 else _error_code(response.content)
            )

        await asyncio.gather(*(one() for _ in range(16)))

    async def malformed(self, client: httpx.AsyncClient) -> None:
        # n past its limit: 400 before any work.
        await self._post(
            client,
            "malformed",
            "/v1/completions",
            {"model": self.plan.model, "prompt": "hello", "n": 10_000, "max_tokens": 1},
        )
        if self.plan.keys:  # a key nobody holds: 401
            response = await client.post(
                "/v1/completions",
                headers={"Authorization": "Bearer not-a-key"},
                json={"model": self.plan.model, "prompt": "hello", "max_tokens": 1},
            )
            self.tally.add("malformed", response.status_code, _error_code(response.content))
        if self.plan.limited_key is not None:  # a burst past the tenant's request rate: some 429s
            await asyncio.gather(
                *(
                    self._post(
                        client,
                        "rate_limited",
                        "/v1/completions",
                        {"model": self.plan.model, "prompt": self._text(3), "max_tokens": 2},
                        key=self.plan.limited_key,
                    )
                    for _ in range(4)
                )
            )
