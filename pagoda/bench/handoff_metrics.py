"""What a run moved between prefill and decode engines, from pagoda's `/metrics` before and after.

The KV handoff families (pagoda/serve/metrics/disaggregation.py) carry labels that matter here (the TTFT
phase of `kv_handoff_phase_seconds`), so the text is read with its labels (server_metrics.parse_labeled, which
server_metrics.parse_prometheus_text sums over every label but `le`).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.bench.server_metrics import LabeledSamples

PREFIX = "pagoda:"
PHASES = ("queue", "prefill", "transfer", "first_decode")


def labeled_total(samples: LabeledSamples, name: str, **labels: str) -> float | None:
    """Sum of `name` over every series whose labels include `labels`; None if there is none."""
    wanted = set(labels.items())
    values = [v for (n, ls), v in samples.items() if n == name and wanted <= ls]
    return sum(values) if values else None


@dataclass
class HandoffDelta:
    """KV handoffs during a run: counts, bytes, and the mean of each TTFT phase (seconds)."""

    handoffs_exported: float
    handoffs_imported: float
    blocks_sent: float
    bytes_sent: float
    blocks_cached: float  # found in the decode engine's prefix cache, not sent
    failures: float
    fallback_prefills: float
    phase_mean_s: dict[str, float | None] = field(default_factory=dict)
    phase_count: dict[str, float] = field(default_factory=dict)

    @property
    def bytes_per_handoff(self) -> float | None:
        return self.bytes_sent / self.handoffs_exported if self.handoffs_exported else None

    @property
    def blocks_per_handoff(self) -> float | None:
        return self.blocks_sent / self.handoffs_exported if self.handoffs_exported else None


def handoff_delta(before: LabeledSamples, after: LabeledSamples) -> HandoffDelta | None:
    """None when the server exports no handoff metrics (an engine with role both)."""
    if labeled_total(after, PREFIX + "kv_handoffs_exported_total") is None:
        return None

    def delta(name: str, **labels: str) -> float:
        return (labeled_total(after, PREFIX + name, **labels) or 0.0) - (
            labeled_total(before, PREFIX + name, **labels) or 0.0
        )

    result = HandoffDelta(
        handoffs_exported=delta("kv_handoffs_exported_total"),
        handoffs_imported=delta("kv_handoffs_imported_total"),
        blocks_sent=delta("kv_handoff_blocks_sent_total"),
        bytes_sent=delta("kv_handoff_bytes_sent_total"),
        blocks_cached=delta("kv_handoff_blocks_cached_total"),
        failures=delta("kv_handoff_failures_total"),
        fallback_prefills=delta("kv_handoff_fallback_prefills_total"),
    )
    for phase in PHASES:
        count = delta("kv_handoff_phase_seconds_count", phase=phase)
        total = delta("kv_handoff_phase_seconds_sum", phase=phase)
        result.phase_count[phase] = count
        result.phase_mean_s[phase] = total / count if count else None
    return result
