"""A mixed serving load: closed-loop streams that decode continuously while long-prompt requests
arrive among them as a Poisson process (open loop).

This is the traffic where a long prefill stretches every running stream's inter-token latency,
the case for chunked prefill and for prefill/decode disaggregation. Everything is seeded: every
target gets the same prompts, in the same order per stream client, and the same arrival times;
only how many stream requests complete depends on the target's speed (closed loop).

Goodput counts requests that meet their class's SLO: TTFT at most `ttft` and the request's own
p99 inter-token gap at most `itl_p99` (a per-request percentile, so one stretched gap in a long
answer does not fail it, while a request whose tail is stretched does).
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from pagoda.bench.lengths import LengthDist, uniform
from pagoda.bench.loadgen import LoadConfig, arrival_intervals, send_request
from pagoda.bench.prompts import PromptBuilder
from pagoda.bench.records import BenchRequest, RequestRecord, RunResult
from pagoda.bench.report import LatencyStats
from pagoda.stats import percentile

# Arrival requests are numbered from here, stream requests below it (records sort by index).
ARRIVAL_INDEX_BASE = 1_000_000


@dataclass(frozen=True)
class MixedLoadSpec:
    """Stream clients (closed loop) plus Poisson arrivals of long prompts, for `duration` seconds."""

    streams: int = 8
    stream_prompt: LengthDist = uniform(56, 72)
    stream_output: int = 128
    arrival_rate: float = 0.5  # long-prompt requests per second
    arrival_prompt: LengthDist = uniform(1400, 1600)
    arrival_output: int = 16
    duration: float = 60.0  # seconds during which requests are sent; in-flight ones then finish
    seed: int = 0
    stream_class: str = "chat"
    arrival_class: str = "rag"

    def __post_init__(self) -> None:
        if self.streams < 0 or self.arrival_rate < 0 or (self.streams == 0 and self.arrival_rate == 0):
            raise ValueError("need streams >= 0, arrival_rate >= 0 and at least one of them positive")
        if self.duration <= 0:
            raise ValueError(f"duration must be > 0, got {self.duration}")
        if self.stream_output < 1 or self.arrival_output < 1:
            raise ValueError("output lengths must be >= 1")
        if self.stream_class == self.arrival_class:
            raise ValueError("the stream and arrival classes need different names")


class MixedWorkload:
    """The requests of a MixedLoadSpec for one tokenizer: deterministic for a given seed."""

    def __init__(self, spec: MixedLoadSpec, builder: PromptBuilder) -> None:
        self.spec = spec
        self.builder = builder

    def _request(
        self, index: int, class_name: str, prompt_len: int, output_len: int, rng: random.Random
    ) -> BenchRequest:
        prompt = self.builder.extend_to("", max(prompt_len, self.builder.num_special + 1), rng)
        return BenchRequest(
            index, class_name, prompt, [{"role": "user", "content": prompt}], self.builder.count(prompt), output_len
        )

    def stream_requests(self, client: int) -> Iterator[BenchRequest]:
        """The endless request sequence of one stream client (its k-th request has index
        k * streams + client)."""
        spec = self.spec
        rng = random.Random(f"{spec.seed}:{spec.stream_class}:{client}")
        k = 0
        while True:
            yield self._request(
                k * spec.streams + client, spec.stream_class, spec.stream_prompt.sample(rng), spec.stream_output, rng
            )
            k += 1

    def arrival_times(self) -> list[float]:
        """Seconds after the start at which the long-prompt requests are sent (Poisson, < duration)."""
        spec = self.spec
        if spec.arrival_rate == 0:
            return []
        gaps = arrival_intervals(spec.arrival_rate, 1.0, spec.seed)
        times, t = [], next(gaps)
        while t < spec.duration:
            times.append(t)
            t += next(gaps)
        return times

    def arrivals(self) -> list[tuple[float, BenchRequest]]:
        spec = self.spec
        rng = random.Random(f"{spec.seed}:{spec.arrival_class}")
        return [
            (
                t,
                self._request(
                    ARRIVAL_INDEX_BASE + j,
                    spec.arrival_class,
                    spec.arrival_prompt.sample(rng),
                    spec.arrival_output,
                    rng,
                ),
            )
            for j, t in enumerate(self.arrival_times())
        ]

    def warmup_requests(self) -> list[BenchRequest]:
        """One request of each class with their own seed (not part of the measured lists)."""
        spec = self.spec
        rng = random.Random(f"{spec.seed}:warmup")
        return [
            self._request(-2, spec.stream_class, spec.stream_prompt.sample(rng), spec.stream_output, rng),
            self._request(-1, spec.arrival_class, spec.arrival_prompt.sample(rng), spec.arrival_output, rng),
        ]


async def warm_up_async(config: LoadConfig, workload: MixedWorkload) -> None:
    """Send the warmup requests one after the other; raises if one fails."""
    import httpx

    async with httpx.AsyncClient(timeout=httpx.Timeout(config.timeout, connect=30.0), trust_env=False) as client:
        for request in workload.warmup_requests():
            record = await send_request(client, config, request, time.perf_counter())
            if not record.ok:
                raise RuntimeError(
                    f"warmup request failed against {config.url}: {record.error} (status {record.status})"
                )


def warm_up(config: LoadConfig, workload: MixedWorkload) -> None:
    asyncio.run(warm_up_async(config, workload))


async def run_mixed_async(config: LoadConfig, workload: MixedWorkload) -> RunResult:
    """Drive the target with the workload: `streams` clients each sending their next request when
    the previous one ends, and every arrival at its time, until the spec's duration; then waits
    for the requests in flight. Prometheus samples are not taken here (see handoff_metrics)."""
    import httpx

    spec = workload.spec
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=256)
    timeout = httpx.Timeout(config.timeout, connect=30.0)
    arrivals = workload.arrivals()  # built before the clock starts: long prompts take a while to make
    records: list[RequestRecord] = []
    async with httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as client:
        started_at = time.time()
        t0 = time.perf_counter()

        async def stream_client(index: int) -> None:
            for request in workload.stream_requests(index):
                if time.perf_counter() - t0 >= spec.duration:
                    return
                records.append(await send_request(client, config, request, t0))

        async def arrival(due: float, request: BenchRequest) -> None:
            await asyncio.sleep(max(0.0, due - (time.perf_counter() - t0)))
            records.append(await send_request(client, config, request, t0))

        await asyncio.gather(
            *(stream_client(i) for i in range(spec.streams)), *(arrival(due, request) for due, request in arrivals)
        )
        duration = time.perf_counter() - t0
    records.sort(key=lambda r: r.index)
    return RunResult(records, duration, started_at)


def run_mixed(config: LoadConfig, workload: MixedWorkload) -> RunResult:
    return asyncio.run(run_mixed_async(config, workload))


# ---- summary ------------------------------------------------------------------------------------


@dataclass(frozen=True)
class RequestSlo:
    """Seconds: a request meets it with TTFT <= ttft and its own p99 inter-token gap <= itl_p99."""

    ttft: float
    itl_p99: float


def request_itl_p99(record: RequestRecord) -> float:
    """The request's own p99 gap between tokens (0 for a single-token answer)."""
    return percentile(record.itls, 99) or 0.0


def meets_request_slo(record: RequestRecord, slo: RequestSlo) -> bool:
    return record.ok and record.ttft is not None and record.ttft <= slo.ttft and request_itl_p99(record) <= slo.itl_p99


@dataclass
class MixedClassSummary:
    """One class of a mixed run. Latencies in seconds; ITL over every gap of the class's requests."""

    name: str
    num_requests: int
    num_ok: int
    output_tokens: int
    output_throughput: float
    ttft: LatencyStats | None
    itl: LatencyStats | None
    num_good: int | None = None
    goodput: float | None = None  # requests / s meeting the class's SLO


@dataclass
class MixedSummary:
    duration: float
    num_requests: int
    num_ok: int
    output_throughput: float  # every class's output tokens / s
    goodput: float | None  # requests / s meeting their class's SLO (None without SLOs)
    per_class: dict[str, MixedClassSummary]
    slo: dict[str, RequestSlo] = field(default_factory=dict)
    errors: dict[str, int] = field(default_factory=dict)


def summarize_mixed(
    records: list[RequestRecord], duration: float, slo: dict[str, RequestSlo] | None = None
) -> MixedSummary:
    """Per class and overall. `slo` maps a class name to its SLO; a class without one has no goodput."""
    slo = slo or {}
    per_class = {}
    for name in sorted({r.class_name for r in records}):
        group = [r for r in records if r.class_name == name]
        ok = [r for r in group if r.ok]
        output_tokens = sum(r.output_tokens for r in ok)
        summary = MixedClassSummary(
            name=name,
            num_requests=len(group),
            num_ok=len(ok),
            output_tokens=output_tokens,
            output_throughput=output_tokens / duration if duration > 0 else 0.0,
            ttft=LatencyStats.of([r.ttft for r in ok if r.ttft is not None]),
            itl=LatencyStats.of([gap for r in ok for gap in r.itls]),
        )
        if name in slo:
            summary.num_good = sum(meets_request_slo(r, slo[name]) for r in group)
            summary.goodput = summary.num_good / duration if duration > 0 else 0.0
        per_class[name] = summary
    errors: dict[str, int] = {}
    for r in records:
        if not r.ok:
            key = f"{r.status}: {r.error}"[:160]
            errors[key] = errors.get(key, 0) + 1
    good = [c.num_good for c in per_class.values() if c.num_good is not None]
    return MixedSummary(
        duration=duration,
        num_requests=len(records),
        num_ok=sum(c.num_ok for c in per_class.values()),
        output_throughput=sum(c.output_tokens for c in per_class.values()) / duration if duration > 0 else 0.0,
        goodput=(sum(good) / duration if duration > 0 else 0.0) if good else None,
        per_class=per_class,
        slo=dict(slo),
        errors=errors,
    )


def parse_request_slo(text: str) -> RequestSlo:
    """'ttft=0.5,itl_p99=80ms' -> RequestSlo (seconds, or milliseconds with an ms suffix)."""
    values: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in text.split(","))):
        key, sep, value = item.partition("=")
        key = key.strip()
        if not sep or key not in ("ttft", "itl_p99"):
            raise ValueError(f"bad SLO item {item!r}; expected ttft=SECONDS and itl_p99=SECONDS")
        value = value.strip()
        try:
            seconds = float(value[:-2]) / 1000 if value.endswith("ms") else float(value.rstrip("s"))
        except ValueError:
            raise ValueError(f"bad SLO value {value!r} for {key}") from None
        if seconds <= 0:
            raise ValueError(f"SLO {key} must be > 0")
        values[key] = seconds
    if set(values) != {"ttft", "itl_p99"}:
        raise ValueError(f"an SLO needs both ttft and itl_p99, got {text!r}")
    return RequestSlo(**values)


def slo_text(slo: RequestSlo) -> str:
    return f"TTFT <= {slo.ttft * 1000:g} ms and per-request ITL p99 <= {slo.itl_p99 * 1000:g} ms"


def summary_row(summary: MixedSummary) -> dict[str, Any]:
    """The flat numbers a benchmark keeps per run (seconds, tokens / s, requests / s)."""
    row: dict[str, Any] = {
        "duration_s": summary.duration,
        "requests": summary.num_requests,
        "ok": summary.num_ok,
        "output_tok_per_s": summary.output_throughput,
        "goodput_req_per_s": summary.goodput,
    }
    for name, c in summary.per_class.items():
        row[f"{name}_requests"] = c.num_requests
        for metric in ("ttft", "itl"):
            stats = getattr(c, metric)
            if stats is not None:
                row[f"{name}_{metric}_p50_s"] = stats.p50
                row[f"{name}_{metric}_p99_s"] = stats.p99
        row[f"{name}_output_tok_per_s"] = c.output_throughput
        if c.goodput is not None and c.num_good is not None:
            row[f"{name}_goodput_req_per_s"] = c.goodput
            row[f"{name}_good_fraction"] = c.num_good / c.num_requests if c.num_requests else None
    return row
