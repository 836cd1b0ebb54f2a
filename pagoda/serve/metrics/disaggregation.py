"""Prometheus families for prefill/decode disaggregation, read from the engine's stats snapshot
(pagoda/engine/disaggregation.py).

`kv_handoff_phase_seconds{phase}` breaks the TTFT of handed-off requests into queue and
prefill (observed on the prefill engine) and transfer and first decode (on the decode engine);
the counters give handoffs, blocks and bytes moved, blocks the receiver's prefix cache already
held, and failures by kind. Every family carries the engine's `role`.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from pagoda.engine.disaggregation import PHASE_BUCKETS

if TYPE_CHECKING:
    from pagoda.engine.disaggregation import DisaggStats

_COUNTERS = (
    ("kv_handoffs_exported", "Requests exported with their KV blocks (prefill role).", "handoffs_exported"),
    ("kv_handoffs_imported", "Handed-off requests continued on transferred KV (decode role).", "handoffs_imported"),
    ("kv_handoff_blocks_sent", "KV blocks sent to decode engines.", "blocks_sent"),
    ("kv_handoff_bytes_sent", "KV bytes sent to decode engines.", "bytes_sent"),
    ("kv_handoff_blocks_received", "KV blocks received from prefill engines.", "blocks_received"),
    ("kv_handoff_bytes_received", "KV bytes received from prefill engines.", "bytes_received"),
    (
        "kv_handoff_blocks_cached",
        "KV blocks of handoffs found in this engine's prefix cache (not sent).",
        "blocks_cached",
    ),
    ("kv_handoff_fallback_prefills", "Failed handoffs prefilled by this (decode) engine instead.", "fallback_prefills"),
)


def disagg_families(stats: DisaggStats | None, prefix: str, labels: list[str], values: list[str]) -> Iterator[Any]:
    if stats is None:
        return
    labels, values = labels + ["role"], values + [stats.role]
    for name, doc, field in _COUNTERS:
        family = CounterMetricFamily(prefix + name, doc, labels=labels)
        family.add_metric(values, getattr(stats, field))
        yield family
    failures = CounterMetricFamily(
        prefix + "kv_handoff_failures",
        "KV handoffs that did not complete, by kind (send, receive, refused).",
        labels=labels + ["kind"],
    )
    for kind, count in stats.failures.items():
        failures.add_metric(values + [kind], count)
    yield failures
    phases = HistogramMetricFamily(
        prefix + "kv_handoff_phase_seconds",
        "Time to first token of handed-off requests, by phase (queue, prefill, transfer, first_decode).",
        labels=labels + ["phase"],
    )
    for phase, histogram in stats.phases.items():
        cumulative, buckets = 0, []
        for bound, count in zip([*map(floatToGoString, PHASE_BUCKETS), "+Inf"], histogram.counts):
            cumulative += count
            buckets.append((bound, cumulative))
        phases.add_metric(values + [phase], buckets, histogram.sum)
    yield phases
