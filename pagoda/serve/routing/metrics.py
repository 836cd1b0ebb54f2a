"""Metrics of model routing: route decisions, fallbacks by reason, remote endpoints skipped.
Rendered with every model's own metrics by `merged_registry`, one family per name."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter
from prometheus_client.registry import Collector

PREFIX = "pagoda:"


class RoutingMetrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        self._decisions = Counter(
            PREFIX + "model_route_decisions",
            "Requests a route sent to a model, by the rule that matched (its index in the route).",
            ["route", "model_name", "rule"],
            registry=self.registry,
        )
        self._fallbacks = Counter(
            PREFIX + "model_fallbacks",
            "Requests answered by a fallback instead "
            "of the model they were for, by why (no_live_replica, overloaded, "
            "failed_before_first_token).",
            ["model_name", "fallback", "reason"],
            registry=self.registry,
        )
        self._remote_skips = Counter(
            PREFIX + "remote_fallback_skipped",
            "Remote fallbacks that could not "
            "answer and were skipped, by why (connect_timeout, connect_error, "
            "first_byte_timeout, read_error, status_NNN).",
            ["endpoint", "reason"],
            registry=self.registry,
        )

    def record_decision(self, route: str, model: str, rule_index: int) -> None:
        self._decisions.labels(route, model, str(rule_index)).inc()

    def record_fallback(self, model: str, fallback: str, reason: str) -> None:
        self._fallbacks.labels(model, fallback, reason).inc()

    def record_remote_skip(self, endpoint: str, reason: str) -> None:
        self._remote_skips.labels(endpoint, reason).inc()


class MergedFamilies(Collector):
    """The families of several registries, those of the same name merged into one (each model's
    series already carry its `model_name` label)."""

    def __init__(self, sources: list[CollectorRegistry]) -> None:
        self._sources = sources

    def collect(self) -> Iterator[Any]:
        families: dict[str, Any] = {}
        for source in self._sources:
            for family in source.collect():
                into = families.get(family.name)
                if into is None:
                    copy = type(family).__new__(type(family))
                    copy.__dict__.update(family.__dict__)
                    copy.samples = list(family.samples)
                    families[family.name] = copy
                else:
                    into.samples.extend(family.samples)
        yield from families.values()


def merged_registry(sources: list[CollectorRegistry]) -> CollectorRegistry:
    registry = CollectorRegistry(auto_describe=False)
    registry.register(MergedFamilies(sources))
    return registry
