"""HTTP load generator for any OpenAI-compatible server (pagoda, vLLM, llama.cpp's llama-server).

Streams every response and times it: TTFT from sending to the first chunk with content, ITL
between content chunks. Arrivals are open-loop (Poisson, or gamma-distributed intervals with
--burstiness, as vLLM's benchmark_serving does) or closed-loop (a fixed number of clients, each
sending its next request when the previous one ends).
"""

from __future__ import annotations

import asyncio
import itertools
import json
import math
import random
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

from pagoda.bench.records import BenchRequest, RequestRecord, RunResult
from pagoda.bench.server_metrics import scrape
from pagoda.http_client.sse import aiter_sse_events, aiter_sse_lines

ENDPOINTS = {"completions": "/v1/completions", "chat": "/v1/chat/completions"}


@dataclass
class LoadConfig:
    """How to drive the target. Open loop when request_rate is finite; concurrency caps it then."""

    base_url: str
    model: str
    endpoint: str = "completions"
    request_rate: float = math.inf
    burstiness: float = 1.0
    concurrency: int | None = None
    num_requests: int | None = None
    duration: float | None = None
    ignore_eos: bool = False
    temperature: float = 0.0
    timeout: float = 600.0
    api_key: str | None = None
    extra_body: dict[str, Any] = field(default_factory=dict)
    seed: int = 0
    warmup: int = 0

    def __post_init__(self) -> None:
        if self.endpoint not in ENDPOINTS:
            raise ValueError(f"--endpoint must be one of {', '.join(ENDPOINTS)}, got {self.endpoint!r}")
        if self.num_requests is None and self.duration is None:
            raise ValueError("give --num-requests and/or --duration")
        if self.num_requests is not None and self.num_requests < 1:
            raise ValueError(f"--num-requests must be >= 1, got {self.num_requests}")
        if self.duration is not None and self.duration <= 0:
            raise ValueError(f"--duration must be > 0, got {self.duration}")
        if self.request_rate <= 0:
            raise ValueError(f"--request-rate must be > 0, got {self.request_rate}")
        if self.burstiness <= 0:
            raise ValueError(f"--burstiness must be > 0, got {self.burstiness}")
        if self.concurrency is not None and self.concurrency < 1:
            raise ValueError(f"--concurrency must be >= 1, got {self.concurrency}")
        base = self.base_url.rstrip("/")
        self.base_url = base[: -len("/v1")] if base.endswith("/v1") else base

    @property
    def open_loop(self) -> bool:
        return math.isfinite(self.request_rate) or self.concurrency is None

    @property
    def url(self) -> str:
        return self.base_url + ENDPOINTS[self.endpoint]

    @property
    def metrics_url(self) -> str:
        return self.base_url + "/metrics"


def request_body(config: LoadConfig, request: BenchRequest) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": config.model,
        "max_tokens": request.output_len,
        "temperature": config.temperature,
        "stream": True,
        "stream_options": {"include_usage": True},
    }
    if config.endpoint == "chat":
        body["messages"] = request.messages
    else:
        body["prompt"] = request.prompt
    if config.ignore_eos:
        body["ignore_eos"] = True  # an extra field that pagoda, vLLM and llama-server understand
    body.update(config.extra_body)
    return body


def _content_of(chunk: dict[str, Any]) -> str:
    text = ""
    for choice in chunk.get("choices") or []:
        if "text" in choice:
            text += choice.get("text") or ""
        delta = choice.get("delta") or {}
        text += (delta.get("content") or "") + (delta.get("reasoning_content") or "")
    return text


async def send_request(client: Any, config: LoadConfig, request: BenchRequest, t0: float) -> RequestRecord:
    """Send one streaming request and time it; never raises (failures land in the record)."""
    import httpx

    record = RequestRecord(request.index, request.class_name, request.prompt_len, request.output_len)
    headers = {"Authorization": f"Bearer {config.api_key}"} if config.api_key else {}
    sent = time.perf_counter()
    record.start = sent - t0
    last = first_choice = None
    num_chunks = 0
    usage = None
    try:
        async with client.stream("POST", config.url, json=request_body(config, request), headers=headers) as resp:
            record.status = resp.status_code
            if resp.status_code != 200:
                body = (await resp.aread()).decode(errors="replace")
                record.error = _error_message(body) or f"HTTP {resp.status_code}"
                return record
            async for event in aiter_sse_events(aiter_sse_lines(resp.aiter_text())):
                if event.done:
                    break
                chunk = event.json()
                if "error" in chunk:
                    record.error = _error_message(event.data) or "error in stream"
                    break
                if chunk.get("usage"):
                    usage = chunk["usage"]
                if chunk.get("choices") and first_choice is None:
                    first_choice = time.perf_counter()
                if _content_of(chunk):
                    now = time.perf_counter()
                    if last is None:
                        record.ttft = now - sent
                    else:
                        record.itls.append(now - last)
                    last = now
                    num_chunks += 1
        record.e2e = time.perf_counter() - sent
    except (httpx.HTTPError, json.JSONDecodeError, OSError) as e:
        record.error = f"{type(e).__name__}: {e}"[:300]
        if not isinstance(e, json.JSONDecodeError):
            record.status = 0
        return record
    record.output_tokens = num_chunks
    if usage:
        record.output_tokens = int(usage.get("completion_tokens") or num_chunks)
        record.reported_prompt_tokens = usage.get("prompt_tokens")
        details = usage.get("prompt_tokens_details") or {}
        if details.get("cached_tokens") is not None:
            record.cached_tokens = int(details["cached_tokens"])
    if record.ttft is None and record.error is None:
        # Tokens that decode to no text yet (e.g. part of a UTF-8 character) still count as
        # generated when the server says so; the first chunk that carried a choice is then the TTFT.
        if record.output_tokens > 0 and first_choice is not None and usage:
            record.ttft = first_choice - sent
        else:
            record.error = "no content in the response"
    return record


def _error_message(body: str) -> str | None:
    try:
        payload = json.loads(body)
    except json.JSONDecodeError:
        return body[:300] or None
    err = payload.get("error") if isinstance(payload, dict) else None
    if isinstance(err, dict):
        return str(err.get("message"))[:300]
    return str(err or payload)[:300]


def arrival_intervals(rate: float, burstiness: float, seed: int) -> Iterator[float]:
    """Gaps between arrivals: gamma(shape=burstiness, mean=1/rate); burstiness 1 is Poisson."""
    if math.isinf(rate):
        return itertools.repeat(0.0)
    rng = random.Random(seed)
    scale = 1.0 / (rate * burstiness)
    return (rng.gammavariate(burstiness, scale) for _ in itertools.count())


class _Run:
    """State of one run: the request source, the clock, dependencies between agent turns."""

    def __init__(self, config: LoadConfig, requests: Iterable[BenchRequest], client: Any, progress: Any) -> None:
        self.config = config
        self.source = iter(requests)
        self.client = client
        self.progress = progress
        self.records: list[RequestRecord] = []
        self.done: dict[int, asyncio.Event] = {}
        self.dispatched = 0
        self.t0 = time.perf_counter()
        self.semaphore = asyncio.Semaphore(config.concurrency) if config.concurrency else None

    def next_request(self) -> BenchRequest | None:
        cfg = self.config
        if cfg.num_requests is not None and self.dispatched >= cfg.num_requests:
            return None
        if cfg.duration is not None and time.perf_counter() - self.t0 >= cfg.duration:
            return None
        request = next(self.source, None)
        if request is not None:
            self.dispatched += 1
            self.done[request.index] = asyncio.Event()
        return request

    async def wait_for_dependency(self, request: BenchRequest) -> None:
        if request.depends_on is not None and request.depends_on in self.done:
            await self.done[request.depends_on].wait()

    async def execute(self, request: BenchRequest) -> None:
        await self.wait_for_dependency(request)
        record = await send_request(self.client, self.config, request, self.t0)
        self.records.append(record)
        self.done[request.index].set()
        self.progress.update(1)

    async def execute_capped(self, request: BenchRequest) -> None:
        if self.semaphore is None:
            await self.execute(request)
            return
        await self.wait_for_dependency(request)  # before taking a slot, so waiting turns hold none
        async with self.semaphore:
            await self.execute(request)

    async def open_loop(self) -> None:
        tasks = []
        due = 0.0
        for gap in arrival_intervals(self.config.request_rate, self.config.burstiness, self.config.seed):
            wait = due - (time.perf_counter() - self.t0)
            if wait > 0:
                await asyncio.sleep(wait)
            request = self.next_request()
            if request is None:
                break
            tasks.append(asyncio.create_task(self.execute_capped(request)))
            due += gap
        await asyncio.gather(*tasks)

    async def closed_loop(self) -> None:
        async def client_loop() -> None:
            while (request := self.next_request()) is not None:
                await self.execute(request)

        await asyncio.gather(*(client_loop() for _ in range(self.config.concurrency or 1)))


async def run_load_async(
    config: LoadConfig,
    requests: Iterable[BenchRequest],
    *,
    progress: bool = True,
    warmup_requests: list[BenchRequest] | None = None,
) -> RunResult:
    import httpx
    from tqdm import tqdm

    limit = max(config.concurrency or 0, 256)
    limits = httpx.Limits(max_connections=limit, max_keepalive_connections=limit)
    timeout = httpx.Timeout(config.timeout, connect=30.0)
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        for request in warmup_requests or []:
            record = await send_request(client, config, request, time.perf_counter())
            if not record.ok:
                raise RuntimeError(
                    f"warmup request failed against {config.url}: {record.error} (status {record.status})"
                )
        before = await scrape(client, config.metrics_url)
        bar = tqdm(total=config.num_requests, disable=not progress, unit="req", desc="bench", leave=False)
        started_at = time.time()
        run = _Run(config, requests, client, bar)
        try:
            await (run.open_loop() if config.open_loop else run.closed_loop())
        finally:
            bar.close()
        duration = time.perf_counter() - run.t0
        after = await scrape(client, config.metrics_url)
    run.records.sort(key=lambda r: r.index)
    return RunResult(run.records, duration, started_at, before, after)


def run_load(
    config: LoadConfig,
    requests: Iterable[BenchRequest],
    *,
    progress: bool = True,
    warmup_requests: list[BenchRequest] | None = None,
) -> RunResult:
    return asyncio.run(run_load_async(config, requests, progress=progress, warmup_requests=warmup_requests))
