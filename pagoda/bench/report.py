"""Summaries of a run: latency percentiles, throughput, goodput under SLOs, errors, server deltas."""

from __future__ import annotations

import dataclasses
import json
import platform
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from pagoda.bench.records import RequestRecord
from pagoda.bench.server_metrics import ServerMetricsDelta
from pagoda.stats import sorted_percentile

PERCENTILES = (50, 90, 95, 99)
SLO_KEYS = ("ttft", "itl", "tpot", "e2e")
SLO_HELP = (
    "latency targets in seconds (or with an ms suffix) for goodput, e.g. ttft=0.5,itl=50ms. "
    "Keys: ttft, itl (every gap of the request), tpot (its mean time per output token), e2e"
)


@dataclass
class LatencyStats:
    """Seconds."""

    count: int
    mean: float
    p50: float
    p90: float
    p95: float
    p99: float
    max: float

    @classmethod
    def of(cls, values: list[float]) -> LatencyStats | None:
        if not values:
            return None
        s = sorted(values)
        p50, p90, p95, p99 = (sorted_percentile(s, q) for q in PERCENTILES)
        return cls(len(s), sum(s) / len(s), p50, p90, p95, p99, s[-1])


def parse_slo(text: str | None) -> dict[str, float]:
    slo: dict[str, float] = {}
    for item in filter(None, (s.strip() for s in (text or "").split(","))):
        key, sep, value = item.partition("=")
        key = key.strip().lower()
        if not sep or key not in SLO_KEYS:
            raise ValueError(f"bad --slo item {item!r}; expected KEY=SECONDS with KEY in {', '.join(SLO_KEYS)}")
        try:
            seconds = float(value[:-2]) / 1000 if value.endswith("ms") else float(value.rstrip("s"))
        except ValueError:
            raise ValueError(f"bad --slo value {value!r} for {key}") from None
        if seconds <= 0:
            raise ValueError(f"--slo {key} must be > 0")
        slo[key] = seconds
    return slo


def meets_slo(record: RequestRecord, slo: dict[str, float]) -> bool:
    if not record.ok:
        return False
    checks = {
        "ttft": record.ttft,
        "itl": max(record.itls) if record.itls else 0.0,
        "tpot": record.tpot if record.tpot is not None else 0.0,
        "e2e": record.e2e,
    }
    return all((value := checks[k]) is not None and value <= limit for k, limit in slo.items())


@dataclass
class ClassSummary:
    name: str
    num_requests: int
    num_ok: int
    input_tokens: int
    output_tokens: int
    request_throughput: float  # completed requests / s
    output_throughput: float  # output tokens / s
    total_token_throughput: float  # (prompt + output) tokens / s
    ttft: LatencyStats | None
    itl: LatencyStats | None
    tpot: LatencyStats | None
    e2e: LatencyStats | None
    num_good: int | None = None
    goodput: float | None = None  # requests / s meeting every SLO
    cached_token_fraction: float | None = None  # as reported in usage, when the target reports it


def summarize_records(name: str, records: list[RequestRecord], duration: float, slo: dict[str, float]) -> ClassSummary:
    ok = [r for r in records if r.ok]
    input_tokens = sum(r.prompt_len for r in ok)
    output_tokens = sum(r.output_tokens for r in ok)
    cached = [r for r in ok if r.cached_tokens is not None]
    summary = ClassSummary(
        name=name,
        num_requests=len(records),
        num_ok=len(ok),
        input_tokens=input_tokens,
        output_tokens=output_tokens,
        request_throughput=len(ok) / duration if duration > 0 else 0.0,
        output_throughput=output_tokens / duration if duration > 0 else 0.0,
        total_token_throughput=(input_tokens + output_tokens) / duration if duration > 0 else 0.0,
        ttft=LatencyStats.of([r.ttft for r in ok if r.ttft is not None]),
        itl=LatencyStats.of([gap for r in ok for gap in r.itls]),
        tpot=LatencyStats.of([r.tpot for r in ok if r.tpot is not None]),
        e2e=LatencyStats.of([r.e2e for r in ok if r.e2e is not None]),
        cached_token_fraction=(
            sum(r.cached_tokens or 0 for r in cached) / max(1, sum(r.prompt_len for r in cached)) if cached else None
        ),
    )
    if slo:
        summary.num_good = sum(meets_slo(r, slo) for r in records)
        summary.goodput = summary.num_good / duration if duration > 0 else 0.0
    return summary


@dataclass
class Summary:
    """A whole run: overall and per class, plus what failed and what the server counted."""

    target: str
    duration: float
    overall: ClassSummary
    per_class: list[ClassSummary]
    errors: dict[str, int]
    slo: dict[str, float]
    server: ServerMetricsDelta | None = None
    concurrency: int | None = None
    request_rate: float | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def summarize(
    target: str,
    records: list[RequestRecord],
    duration: float,
    slo: dict[str, float] | None = None,
    server: ServerMetricsDelta | None = None,
    **kwargs: Any,
) -> Summary:
    slo = slo or {}
    names = sorted({r.class_name for r in records})
    errors = Counter(f"{r.status}: {r.error}"[:160] for r in records if not r.ok)
    return Summary(
        target=target,
        duration=duration,
        overall=summarize_records("all", records, duration, slo),
        per_class=[summarize_records(n, [r for r in records if r.class_name == n], duration, slo) for n in names]
        if len(names) > 1
        else [],
        errors=dict(errors.most_common()),
        slo=slo,
        server=server,
        **kwargs,
    )


# ---- rendering ----------------------------------------------------------------------------------


def _ms(stats: LatencyStats | None, attr: str) -> str:
    return "-" if stats is None else f"{getattr(stats, attr) * 1000:.1f}"


def render_table(headers: list[str], rows: list[list[str]]) -> str:
    widths = [max([len(h)] + [len(r[i]) for r in rows]) for i, h in enumerate(headers)]

    def line(cells: list[str]) -> str:
        return "  ".join(c.ljust(w) if i == 0 else c.rjust(w) for i, (c, w) in enumerate(zip(cells, widths)))

    return "\n".join([line(headers), line(["-" * w for w in widths])] + [line(r) for r in rows])


def render_summary(summary: Summary) -> str:
    out = [
        f"target {summary.target}: {summary.overall.num_ok}/{summary.overall.num_requests} ok "
        f"in {summary.duration:.2f} s"
    ]
    classes = [summary.overall] + summary.per_class
    rows = [
        [
            c.name,
            str(c.num_requests),
            f"{c.request_throughput:.2f}",
            f"{c.output_throughput:.1f}",
            f"{c.total_token_throughput:.1f}",
        ]
        + ([f"{c.goodput:.2f} ({c.num_good}/{c.num_requests})"] if summary.slo else [])
        for c in classes
    ]
    headers = ["class", "requests", "req/s", "out tok/s", "total tok/s"] + (["goodput req/s"] if summary.slo else [])
    out += ["", render_table(headers, rows), ""]
    rows = []
    for c in classes:
        for metric in ("ttft", "itl", "tpot", "e2e"):
            stats = getattr(c, metric)
            if stats is None:
                continue
            rows.append([c.name, metric.upper()] + [_ms(stats, a) for a in ("mean", "p50", "p90", "p95", "p99", "max")])
    if rows:
        out += [render_table(["class", "ms", "mean", "p50", "p90", "p95", "p99", "max"], rows), ""]
    if summary.slo:
        out.append("SLO: " + ", ".join(f"{k} <= {v * 1000:g} ms" for k, v in summary.slo.items()))
    if summary.errors:
        out.append("errors (status: message):")
        out += [f"  {count:5d}  {msg}" for msg, count in summary.errors.items()]
    server = summary.server
    if server is not None:
        parts = []
        if server.prefix_cache_hit_rate is not None:
            parts.append(
                f"prefix cache hit rate {server.prefix_cache_hit_rate:.1%} "
                f"({server.prefix_cache_hits:.0f}/{server.prefix_cache_queries:.0f} tokens)"
            )
        if server.num_preemptions is not None:
            parts.append(f"preemptions {server.num_preemptions:.0f}")
        if server.queue_time_mean is not None:
            parts.append(
                f"queue time mean {server.queue_time_mean * 1000:.1f} ms"
                + (f", p99 ~{server.queue_time_p99 * 1000:.1f} ms" if server.queue_time_p99 else "")
            )
        out.append(f"server ({server.source} metrics, delta over the run): " + ("; ".join(parts) or "nothing known"))
    return "\n".join(out).rstrip()


def machine_info() -> dict[str, Any]:
    import os

    info: dict[str, Any] = {
        "platform": platform.platform(),
        "python": platform.python_version(),
        "cpu_count": os.cpu_count(),
        "processor": platform.processor(),
    }
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                info["cpu"] = line.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return info


def to_jsonable(value: Any) -> Any:
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {k: to_jsonable(v) for k, v in dataclasses.asdict(value).items()}
    if isinstance(value, dict):
        return {str(k): to_jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [to_jsonable(v) for v in value]
    if isinstance(value, float):
        if value != value or value in (float("inf"), float("-inf")):
            return None
        return round(value, 6)  # microseconds are plenty and keep per-request files small
    return value


def write_json(path: Path, payload: dict[str, Any]) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(to_jsonable(payload), separators=(",", ":")))
