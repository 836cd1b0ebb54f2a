"""Prometheus `/metrics` of the target: scrape before and after a run, report the deltas.

Recognises pagoda's names (`pagoda:prefix_cache_queries_total`, ...) and vLLM's (`vllm:` prefix,
including the older `gpu_prefix_cache_*` names).
"""

from __future__ import annotations

import re
from collections import defaultdict
from dataclasses import dataclass

from pagoda.stats import histogram_quantile

METRIC_PREFIXES = ("pagoda:", "vllm:")
_SAMPLE = re.compile(r"^([a-zA-Z_:][a-zA-Z0-9_:]*)(?:\{([^}]*)\})?\s+(\S+)")
_LABEL = re.compile(r'([a-zA-Z_][a-zA-Z0-9_]*)="((?:[^"\\]|\\.)*)"')

# Every sample with its labels: (metric name, its labels) -> value.
LabeledSamples = dict[tuple[str, frozenset[tuple[str, str]]], float]
# A sample: (metric name, le label or None) -> value summed over every other label.
Samples = dict[tuple[str, str | None], float]


def parse_labeled(text: str) -> LabeledSamples:
    """The exposition text's samples, each with its labels."""
    samples: LabeledSamples = {}
    for line in text.splitlines():
        if not line or line.startswith("#"):
            continue
        match = _SAMPLE.match(line)
        if not match:
            continue
        name, labels, value = match.groups()
        try:
            number = float(value)
        except ValueError:
            continue
        samples[(name, frozenset(_LABEL.findall(labels or "")))] = number
    return samples


def parse_prometheus_text(text: str) -> Samples:
    """The samples summed over every label but a histogram bucket's `le`."""
    samples: Samples = defaultdict(float)
    for (name, labels), value in parse_labeled(text).items():
        le = dict(labels).get("le") if name.endswith("_bucket") else None
        samples[(name, le)] += value
    return dict(samples)


@dataclass
class ServerMetricsDelta:
    """What changed on the server during the run. None where the server does not export it."""

    source: str  # the metric prefix found: "pagoda:" or "vllm:"
    prefix_cache_queries: float | None = None  # tokens looked up
    prefix_cache_hits: float | None = None  # tokens found
    prefix_cache_hit_rate: float | None = None
    num_preemptions: float | None = None
    queue_time_count: float | None = None
    queue_time_mean: float | None = None
    queue_time_p50: float | None = None
    queue_time_p99: float | None = None


def _counter(samples: Samples, names: list[str]) -> float | None:
    for name in names:
        for candidate in (name, name + "_total") if not name.endswith("_total") else (name,):
            if (candidate, None) in samples:
                return samples[(candidate, None)]
    return None


def _delta(before: Samples, after: Samples, names: list[str]) -> float | None:
    a = _counter(after, names)
    if a is None:
        return None
    return a - (_counter(before, names) or 0.0)


def metrics_delta(before: Samples, after: Samples) -> ServerMetricsDelta | None:
    names_after = {name for name, _ in after}
    prefix = next((p for p in METRIC_PREFIXES if any(n.startswith(p) for n in names_after)), None)
    if prefix is None:
        return None
    delta = ServerMetricsDelta(source=prefix)
    delta.prefix_cache_queries = _delta(
        before, after, [f"{prefix}prefix_cache_queries_total", f"{prefix}gpu_prefix_cache_queries_total"]
    )
    delta.prefix_cache_hits = _delta(
        before, after, [f"{prefix}prefix_cache_hits_total", f"{prefix}gpu_prefix_cache_hits_total"]
    )
    if delta.prefix_cache_queries and delta.prefix_cache_hits is not None:
        delta.prefix_cache_hit_rate = delta.prefix_cache_hits / delta.prefix_cache_queries
    delta.num_preemptions = _delta(before, after, [f"{prefix}num_preemptions_total", f"{prefix}num_preemptions"])
    base = f"{prefix}request_queue_time_seconds"
    count = _delta(before, after, [base + "_count"])
    total = _delta(before, after, [base + "_sum"])
    if count is not None:
        delta.queue_time_count = count
        delta.queue_time_mean = total / count if count and total is not None else None
        bounds = {le for name, le in after if name == base + "_bucket" and le is not None}
        buckets = [
            (float(le), after[(base + "_bucket", le)] - before.get((base + "_bucket", le), 0.0)) for le in bounds
        ]
        delta.queue_time_p50 = histogram_quantile(0.5, buckets)
        delta.queue_time_p99 = histogram_quantile(0.99, buckets)
    return delta


async def scrape(client: object, url: str) -> Samples | None:
    """GET url with an httpx.AsyncClient; None when the target has no Prometheus endpoint."""
    try:
        response = await client.get(url, timeout=10.0)  # type: ignore[attr-defined]
    except Exception:  # any transport failure just means: no metrics
        return None
    if response.status_code != 200:
        return None
    return parse_prometheus_text(response.text)
