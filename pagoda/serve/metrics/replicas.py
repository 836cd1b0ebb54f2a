"""Engine-level metrics of several replicas in one family each, told apart by a `replica` label
(one engine's as they are), and the engines' supervision: up or down, restarts.

Each replica's stats are collected by the same collector a single engine uses; its families are
then merged by name, every sample gaining `replica="<index>"`. Prometheus queries aggregate them
(`sum without (replica) (pagoda:num_requests_running)`) or compare replicas.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from pagoda.engine.llm_engine import EngineStats

REPLICA_LABEL = "replica"

# One replica's stats getter -> the collector of a single engine's families.
CollectorOf = Callable[[Callable[[], "EngineStats | None"]], Collector]


class ReplicaLabelledCollector(Collector):
    """Each replica's families under a `replica` label; with no replicas (one engine), the
    families of `stats` as they are."""

    def __init__(
        self,
        stats: Callable[[], EngineStats | None],
        replica_stats: Callable[[], dict[str, EngineStats | None]],
        collector_of: CollectorOf,
    ) -> None:
        self._engine = collector_of(stats)
        self._replica_stats = replica_stats
        self._collector_of = collector_of

    def collect(self) -> Iterator[Any]:
        by_replica = self._replica_stats()
        if not by_replica:
            yield from self._engine.collect()
            return
        merged: dict[str, Metric] = {}
        for label, stats in by_replica.items():
            for family in self._collector_of(_reading(stats)).collect():
                into = merged.get(family.name)
                if into is None:
                    into = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                into.samples.extend(
                    sample._replace(labels={**sample.labels, REPLICA_LABEL: label}) for sample in family.samples
                )
        yield from merged.values()


def _reading(stats: EngineStats | None) -> Callable[[], EngineStats | None]:
    """A stats source that returns one replica's stats, read once for this scrape."""
    return lambda: stats


class SupervisionCollector(Collector):
    """Whether each engine is up, and how often it was restarted, read from the engine client's
    /health body (so the two always agree): `replica_up` (1 or 0) and `replica_restarts_total`,
    labelled `replica` for a replica set, unlabelled for a single engine."""

    def __init__(self, prefix: str, model_name: str, health: Callable[[], dict[str, Any]]) -> None:
        self._prefix = prefix
        self._model_name = model_name
        self._health = health

    def collect(self) -> Iterator[Any]:
        body = self._health()
        replicas = body.get("replicas")
        engines = [({REPLICA_LABEL: str(r["replica"])}, r) for r in replicas] if replicas is not None else [({}, body)]
        up = GaugeMetricFamily(
            self._prefix + "replica_up",
            "1 while the engine serves, 0 while it is down (restarting, failed or dead).",
            labels=["model_name", REPLICA_LABEL] if replicas is not None else ["model_name"],
        )
        restarts = CounterMetricFamily(
            self._prefix + "replica_restarts",
            "Restarts of the engine after it died.",
            labels=["model_name", REPLICA_LABEL] if replicas is not None else ["model_name"],
        )
        for labels, engine in engines:
            values = [self._model_name, *labels.values()]
            up.add_metric(values, 1.0 if engine.get("status") == "ok" else 0.0)
            restarts.add_metric(values, float(engine.get("restarts", 0)))
        yield up
        yield restarts


class AutoscaleCollector(Collector):
    """An autoscaled replica set's target and decisions, read from the /health body's
    `autoscale` part (nothing when the set is not autoscaled): `replicas_desired` and
    `scale_events_total{direction,reason}`."""

    def __init__(self, prefix: str, model_name: str, health: Callable[[], dict[str, Any]]) -> None:
        self._prefix = prefix
        self._model_name = model_name
        self._health = health

    def collect(self) -> Iterator[Any]:
        autoscale = self._health().get("autoscale")
        if autoscale is None:
            return
        desired = GaugeMetricFamily(
            self._prefix + "replicas_desired",
            "Replicas the autoscaler wants (its last decision's target).",
            labels=["model_name"],
        )
        desired.add_metric([self._model_name], float(autoscale["desired"]))
        events = CounterMetricFamily(
            self._prefix + "scale_events",
            "Autoscaling decisions, by direction (up, down) and reason (queue_depth, kv_usage, idle).",
            labels=["model_name", "direction", "reason"],
        )
        for event in autoscale["scale_events"]:
            events.add_metric([self._model_name, event["direction"], event["reason"]], float(event["count"]))
        yield desired
        yield events
