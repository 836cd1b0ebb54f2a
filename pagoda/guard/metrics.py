"""Guardrail decisions and the latency the guard adds, on the server's metrics registry."""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram

from pagoda.guard.decision import RuleHit

PREFIX = "pagoda:"
GUARD_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)


class GuardMetrics:
    def __init__(self, registry: CollectorRegistry, model_name: str) -> None:
        self.model_name = model_name
        self._decisions = Counter(
            PREFIX + "guardrail_decisions",
            "Guardrail rule firings (matches or verdicts).",
            ["model_name", "rule", "tenant", "stage", "action"],
            registry=registry,
        )
        self._input = Histogram(
            PREFIX + "guardrail_input_seconds",
            "Time the input guard took per request (added to the time to first token).",
            ["model_name"],
            buckets=GUARD_BUCKETS,
            registry=registry,
        )
        self._output = Histogram(
            PREFIX + "guardrail_output_seconds",
            "Time the output filter took per engine output (added to the inter-token latency).",
            ["model_name"],
            buckets=GUARD_BUCKETS,
            registry=registry,
        )
        self._holdback = Histogram(
            PREFIX + "guardrail_first_release_delay_seconds",
            "From a sample's first generated text to its first released text (hold-back "
            "added to the time to first token).",
            ["model_name"],
            buckets=GUARD_BUCKETS,
            registry=registry,
        )
        self._input_child = self._input.labels(model_name)
        self._output_child = self._output.labels(model_name)
        self._holdback_child = self._holdback.labels(model_name)

    def record_hit(self, tenant: str, hit: RuleHit) -> None:
        self._decisions.labels(self.model_name, hit.rule, tenant, hit.stage, hit.action).inc(hit.count)

    def record_input_seconds(self, seconds: float) -> None:
        self._input_child.observe(seconds)

    def record_output_seconds(self, seconds: float) -> None:
        self._output_child.observe(seconds)

    def record_first_release_delay(self, seconds: float) -> None:
        self._holdback_child.observe(seconds)
