"""KV handoff series in /metrics: counters by role, failures by kind, TTFT phases as histograms."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.engine.disaggregation import DisaggStats
from pagoda.serve.metrics.server import ServerMetrics


def scrape(stats) -> dict[str, float]:
    body, _ = ServerMetrics("m", lambda: stats).render()
    return {
        sample.name + str(sorted(sample.labels.items())): sample.value
        for family in text_string_to_metric_families(body.decode())
        for sample in family.samples
    }


def value(samples: dict[str, float], name: str, **labels: str) -> float:
    return samples[name + str(sorted({"model_name": "m", **labels}.items()))]


def engine_stats(disaggregation: DisaggStats) -> SimpleNamespace:
    return SimpleNamespace(
        num_running=0,
        num_waiting=0,
        kv_cache_usage=0.0,
        prefix_cache_queries=0,
        prefix_cache_hits=0,
        num_preemptions=0,
        num_prompt_tokens=0,
        num_generation_tokens=0,
        spec_decode=None,
        iteration_tokens=None,
        disaggregation=disaggregation,
    )


def test_decode_engine_handoff_series() -> None:
    stats = DisaggStats(
        "decode", handoffs_imported=2, blocks_received=5, bytes_received=5120, blocks_cached=3, fallback_prefills=1
    )
    stats.failures["receive"] = 1
    stats.observe("transfer", 0.003)
    stats.observe("transfer", 0.3)
    stats.observe("first_decode", 0.02)
    samples = scrape(engine_stats(stats))
    assert value(samples, "pagoda:kv_handoffs_imported_total", role="decode") == 2
    assert value(samples, "pagoda:kv_handoff_bytes_received_total", role="decode") == 5120
    assert value(samples, "pagoda:kv_handoff_blocks_cached_total", role="decode") == 3
    assert value(samples, "pagoda:kv_handoff_failures_total", role="decode", kind="receive") == 1
    assert value(samples, "pagoda:kv_handoff_failures_total", role="decode", kind="send") == 0
    assert value(samples, "pagoda:kv_handoff_phase_seconds_count", role="decode", phase="transfer") == 2
    assert value(samples, "pagoda:kv_handoff_phase_seconds_bucket", role="decode", phase="transfer", le="0.005") == 1
    assert value(samples, "pagoda:kv_handoff_phase_seconds_sum", role="decode", phase="transfer") == pytest.approx(
        0.303
    )
    assert value(samples, "pagoda:kv_handoff_phase_seconds_count", role="decode", phase="queue") == 0


def test_no_handoff_series_without_engine_stats() -> None:
    assert not any("kv_handoff" in name for name in scrape(None))
