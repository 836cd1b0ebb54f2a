"""Prometheus families for structured output, read from the engine's stats snapshot:
grammar compile time histogram, compile cache queries and hits (hit rate = hits / queries),
timeouts and failures, and requests by constraint kind."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily

from pagoda.sampling_params import KINDS
from pagoda.structured.compiler import COMPILE_TIME_BUCKETS, StructuredOutputStats


def structured_output_families(
    stats: StructuredOutputStats | None, prefix: str, labels: list[str], values: list[str]
) -> Iterator[Any]:
    stats = stats or StructuredOutputStats()
    histogram = HistogramMetricFamily(
        prefix + "structured_output_compile_time_seconds",
        "Time to compile a grammar (cache misses only).",
        labels=labels,
    )
    cumulative, buckets = 0, []
    for bound, count in zip((*COMPILE_TIME_BUCKETS, float("inf")), stats.compile_time_bucket_counts):
        cumulative += count
        buckets.append((str(bound) if bound != float("inf") else "+Inf", cumulative))
    histogram.add_metric(values, buckets, stats.compile_time_sum)
    yield histogram
    for name, doc, value in (
        ("structured_output_cache_queries", "Grammar lookups in the compile cache.", stats.cache_queries),
        ("structured_output_cache_hits", "Grammar lookups served by the compile cache.", stats.cache_hits),
        ("structured_output_compile_timeouts", "Requests failed by --structured-output-timeout.", stats.num_timeouts),
        ("structured_output_compile_failures", "Requests whose grammar failed to compile.", stats.num_failures),
    ):
        family = CounterMetricFamily(prefix + name, doc, labels=labels)
        family.add_metric(values, value)
        yield family
    by_kind = CounterMetricFamily(
        prefix + "structured_output_requests", "Structured-output requests by kind.", labels=labels + ["kind"]
    )
    for kind in KINDS:
        by_kind.add_metric(values + [kind], stats.requests_by_kind.get(kind, 0))
    yield by_kind
