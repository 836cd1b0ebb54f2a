"""Prometheus metrics, on a registry owned by one app (several apps can share a process).

Engine-level numbers (running/waiting, KV usage, prefix cache, preemptions, token totals,
tokens per step) are read from the engine's latest stats snapshot at scrape time; per-request
numbers (latencies, phases, token counts, outcomes) are recorded by the handlers as requests end.

Names follow vLLM's under `pagoda:`. With `metrics_compat="vllm"` every series is exported a
second time under `vllm:` (plus vLLM's older `gpu_cache_usage_perc` and
`time_per_output_token_seconds` names), so an existing vLLM Grafana dashboard works unchanged.
"""

from __future__ import annotations

import bisect
import copy
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any, get_args

from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.registry import Collector
from prometheus_client.utils import floatToGoString

from pagoda.config import MetricsCompat

# Tokens per engine step and per request share the engine's bounds.
from pagoda.engine.token_histogram import TOKEN_BUCKETS
from pagoda.serve.metrics.disaggregation import disagg_families
from pagoda.serve.metrics.label_policy import public_registry
from pagoda.serve.metrics.lora import lora_families
from pagoda.serve.metrics.media import encoder_families
from pagoda.serve.metrics.moe import moe_families
from pagoda.serve.metrics.replicas import AutoscaleCollector, ReplicaLabelledCollector, SupervisionCollector
from pagoda.serve.metrics.structured import structured_output_families

if TYPE_CHECKING:
    from pagoda.engine.llm_engine import EngineStats
    from pagoda.outputs import RequestMetrics

PREFIX = "pagoda:"
VLLM_PREFIX = "vllm:"
# vLLM's older names for two series, still read by many dashboards.
VLLM_ALIASES = {
    "kv_cache_usage_perc": "gpu_cache_usage_perc",
    "inter_token_latency_seconds": "time_per_output_token_seconds",
}

TTFT_BUCKETS = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)
ITL_BUCKETS = (
    0.001,
    0.0025,
    0.005,
    0.01,
    0.015,
    0.02,
    0.025,
    0.03,
    0.04,
    0.05,
    0.075,
    0.1,
    0.15,
    0.2,
    0.3,
    0.4,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
)
# A refusal should cost well under a millisecond of the server's time.
REFUSAL_BUCKETS = (0.0001, 0.00025, 0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
REQUEST_BUCKETS = (
    0.01,
    0.05,
    0.1,
    0.3,
    0.5,
    0.8,
    1.0,
    1.5,
    2.0,
    2.5,
    5.0,
    10.0,
    15.0,
    20.0,
    30.0,
    40.0,
    50.0,
    60.0,
    120.0,
    240.0,
    480.0,
    960.0,
)


class _EngineStatsCollector(Collector):
    def __init__(self, model_name: str, stats: Callable[[], EngineStats | None]) -> None:
        self._model_name = model_name
        self._stats = stats

    def collect(self) -> Iterator[Any]:
        stats = self._stats()
        labels = ["model_name"]
        values = [self._model_name]

        def gauge(name: str, doc: str, value: float) -> GaugeMetricFamily:
            family = GaugeMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        def counter(name: str, doc: str, value: float) -> CounterMetricFamily:
            family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric(values, value)
            return family

        get = (lambda field: getattr(stats, field)) if stats is not None else (lambda field: 0)
        yield gauge("num_requests_running", "Requests in the engine's running set.", get("num_running"))
        yield gauge("num_requests_waiting", "Requests waiting to be scheduled.", get("num_waiting"))
        yield gauge("kv_cache_usage_perc", "Fraction of KV cache blocks in use (0..1).", get("kv_cache_usage"))
        yield counter(
            "prefix_cache_queries", "Prompt tokens looked up in the prefix cache.", get("prefix_cache_queries")
        )
        yield counter("prefix_cache_hits", "Prompt tokens found in the prefix cache.", get("prefix_cache_hits"))
        preemptions = CounterMetricFamily(
            PREFIX + "num_preemptions", "Requests preempted to free KV blocks, by mode.", labels=labels + ["mode"]
        )
        tiers = getattr(stats, "kv_tiers", None)  # None without a host tier (or no stats yet)
        for mode, count in tiers.preemptions.items() if tiers else [("recompute", get("num_preemptions"))]:
            preemptions.add_metric(values + [mode], count)
        yield preemptions
        yield counter("prompt_tokens", "Prompt tokens processed.", get("num_prompt_tokens"))
        yield counter("generation_tokens", "Tokens generated.", get("num_generation_tokens"))
        yield self._iteration_tokens(stats, labels, values)
        yield from self._spec_decode(stats, labels, values)
        yield from structured_output_families(getattr(stats, "structured_output", None), PREFIX, labels, values)
        yield from self._kv_tiers(stats, labels, values)
        yield from lora_families(getattr(stats, "lora", None), PREFIX, labels, values)
        yield from disagg_families(getattr(stats, "disaggregation", None), PREFIX, labels, values)
        yield from moe_families(getattr(stats, "moe", None), PREFIX, labels, values)
        yield from encoder_families(getattr(stats, "encoder", None), PREFIX, labels, values)

    @staticmethod
    def _iteration_tokens(stats: EngineStats | None, labels: list[str], values: list[str]) -> Any:
        """Tokens computed per engine step (prompt chunks + decodes + verified drafts)."""
        family = HistogramMetricFamily(
            PREFIX + "iteration_tokens_total", "Tokens computed per engine step.", labels=labels
        )
        histogram = getattr(stats, "iteration_tokens", None)
        counts = list(histogram.counts) if histogram is not None else [0] * (len(TOKEN_BUCKETS) + 1)
        total = histogram.sum if histogram is not None else 0
        family.add_metric(values, _cumulative_buckets(TOKEN_BUCKETS, counts), total)
        return family

    @staticmethod
    def _spec_decode(stats: EngineStats | None, labels: list[str], values: list[str]) -> Iterator[Any]:
        """Speculative decoding counters (vLLM's names under pagoda:); zero when it is off."""
        spec = stats.spec_decode if stats is not None else None
        for name, doc, field in (
            ("spec_decode_num_drafts", "Request-steps that verified drafted tokens.", "num_drafts"),
            ("spec_decode_num_draft_tokens", "Drafted tokens verified by the target.", "num_draft_tokens"),
            ("spec_decode_num_accepted_tokens", "Drafted tokens accepted.", "num_accepted_tokens"),
        ):
            family = CounterMetricFamily(PREFIX + name, doc, labels=labels)
            family.add_metric(values, getattr(spec, field) if spec is not None else 0)
            yield family
        per_position = CounterMetricFamily(
            PREFIX + "spec_decode_num_accepted_tokens_per_pos",
            "Drafted tokens accepted, by position in the draft.",
            labels=labels + ["position"],
        )
        for position, accepted in enumerate(spec.accepted_per_position if spec is not None else []):
            per_position.add_metric(values + [str(position)], accepted)
        yield per_position

    @staticmethod
    def _kv_tiers(stats: EngineStats | None, labels: list[str], values: list[str]) -> Iterator[Any]:
        """KV tier metrics (pagoda/core/kv_tiers.py); zero when no host tier is configured."""
        tiers = getattr(stats, "kv_tiers", None)  # None without a host tier (or no stats yet)
        swapped = GaugeMetricFamily(
            PREFIX + "num_requests_swapped", "Requests whose KV is swapped out to the host tier.", labels=labels
        )
        swapped.add_metric(values, tiers.num_swapped if tiers else 0)
        yield swapped
        for name, doc, label, kind, field in (
            ("kv_offload_usage_perc", "Fraction of a KV tier's blocks in use (0..1).", "tier", "gauge", "usage"),
            ("kv_offload_hits", "Prompt tokens found in the prefix cache, per tier.", "tier", "counter", "hits"),
            ("kv_transfer_bytes", "KV bytes copied between tiers.", "direction", "counter", "transfer_bytes"),
        ):
            family_type = GaugeMetricFamily if kind == "gauge" else CounterMetricFamily
            family = family_type(PREFIX + name, doc, labels=labels + [label])
            for key, value in getattr(tiers, field).items() if tiers else ():
                family.add_metric(values + [key], value)
            yield family


class _WeightedHistogram(Collector):
    """A histogram whose observations carry a count: one call for k equal inter-token gaps.

    prometheus_client's Histogram costs a lock and a bucket search per observation, which at
    one observation per token is a visible share of the event loop's work under load.
    """

    def __init__(self, name: str, doc: str, model_name: str, buckets: tuple[float, ...]) -> None:
        self._name = name
        self._doc = doc
        self._model_name = model_name
        self._bounds = list(buckets)
        self._counts = [0] * (len(buckets) + 1)
        self._sum = 0.0

    def observe(self, value: float, count: int = 1) -> None:
        self._counts[bisect.bisect_left(self._bounds, value)] += count
        self._sum += value * count

    def collect(self) -> Iterator[Any]:
        family = HistogramMetricFamily(self._name, self._doc, labels=["model_name"])
        family.add_metric([self._model_name], _cumulative_buckets(self._bounds, self._counts), self._sum)
        yield family


def _cumulative_buckets(bounds: tuple[float, ...] | list[float], counts: list[int]) -> list[tuple[str, int]]:
    """Per-bucket counts (one more than bounds, the last for +Inf) -> Prometheus' cumulative pairs."""
    cumulative, buckets = 0, []
    for bound, count in zip([*map(floatToGoString, bounds), "+Inf"], counts):
        cumulative += count
        buckets.append((bound, cumulative))
    return buckets


class _RenamedCollector(Collector):
    """Every family of `source` again under `prefix` (and aliases): vLLM-compatible names."""

    def __init__(self, source: CollectorRegistry, prefix: str, aliases: dict[str, str]) -> None:
        self._source = source
        self._prefix = prefix
        self._aliases = aliases

    def collect(self) -> Iterator[Any]:
        for family in self._source.collect():
            if not family.name.startswith(PREFIX):
                continue
            short = family.name[len(PREFIX) :]
            for new_short in (short, self._aliases.get(short)):
                if new_short is not None:
                    yield _renamed(family, PREFIX + short, self._prefix + new_short)


def _renamed(family: Any, old: str, new: str) -> Any:
    renamed = copy.copy(family)
    renamed.name = new
    renamed.samples = [sample._replace(name=new + sample.name[len(old) :]) for sample in family.samples]
    return renamed


class ServerMetrics:
    """The metrics of one app, labelled with its served model name."""

    def __init__(
        self,
        model_name: str,
        stats: Callable[[], EngineStats | None],
        *,
        compat: MetricsCompat = "none",
        replica_stats: Callable[[], dict[str, EngineStats | None]] = dict,
        tenant_labels: bool = False,
        health: Callable[[], dict[str, Any]] | None = None,
    ) -> None:
        """`replica_stats`: each replica's stats by label (EngineClient.replica_stats); while
        there are replicas, the engine series carry a `replica` label instead of reading `stats`.
        `tenant_labels`: render tenant ids and adapter names in label values (label_policy.py).
        `health`: the engine client's /health body, for the engines' up and restart series."""
        if compat not in get_args(MetricsCompat):
            raise ValueError(f"metrics_compat must be none or vllm, got {compat!r}")
        self.model_name = model_name
        self.registry = CollectorRegistry(auto_describe=False)
        self.registry.register(
            ReplicaLabelledCollector(stats, replica_stats, lambda one: _EngineStatsCollector(model_name, one))
        )
        if health is not None:
            self.registry.register(SupervisionCollector(PREFIX, model_name, health))
            self.registry.register(AutoscaleCollector(PREFIX, model_name, health))
        labels = ["model_name"]
        self._success = Counter(
            PREFIX + "request_success", "Requests that finished.", labels + ["finished_reason"], registry=self.registry
        )
        self._rejected = Counter(
            PREFIX + "request_rejected",
            "Requests refused before running, or failed in the server "
            "(reason engine_dead: the engine died under them).",
            labels + ["reason"],
            registry=self.registry,
        )
        self._refusal_time = Histogram(
            PREFIX + "request_refusal_seconds",
            "Server time to refuse a generation request: from its endpoint's start (key checked, "
            "body parsed) to the refusal.",
            labels + ["reason"],
            buckets=REFUSAL_BUCKETS,
            registry=self.registry,
        )
        self._ttft = Histogram(
            PREFIX + "time_to_first_token_seconds",
            "Time to first token.",
            labels,
            buckets=TTFT_BUCKETS,
            registry=self.registry,
        )
        self._itl = _WeightedHistogram(
            PREFIX + "inter_token_latency_seconds", "Time between tokens.", model_name, ITL_BUCKETS
        )
        self.registry.register(self._itl)
        self._e2e = Histogram(
            PREFIX + "e2e_request_latency_seconds",
            "Arrival to finish.",
            labels,
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self._queue = Histogram(
            PREFIX + "request_queue_time_seconds",
            "Arrival to first scheduling.",
            labels,
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self._prefill = Histogram(
            PREFIX + "request_prefill_time_seconds",
            "First scheduling to first token (the prompt's computation).",
            labels,
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self._decode = Histogram(
            PREFIX + "request_decode_time_seconds",
            "First token to finish.",
            labels,
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self._inference = Histogram(
            PREFIX + "request_inference_time_seconds",
            "First scheduling to finish (prefill + decode).",
            labels,
            buckets=REQUEST_BUCKETS,
            registry=self.registry,
        )
        self._prompt_tokens = Histogram(
            PREFIX + "request_prompt_tokens",
            "Prompt tokens per request.",
            labels,
            buckets=TOKEN_BUCKETS,
            registry=self.registry,
        )
        self._generation_tokens = Histogram(
            PREFIX + "request_generation_tokens",
            "Generated tokens per request (all samples).",
            labels,
            buckets=TOKEN_BUCKETS,
            registry=self.registry,
        )
        self._ttft_child = self._ttft.labels(model_name)
        self._e2e_child = self._e2e.labels(model_name)
        self._queue_child = self._queue.labels(model_name)
        self._prefill_child = self._prefill.labels(model_name)
        self._decode_child = self._decode.labels(model_name)
        self._inference_child = self._inference.labels(model_name)
        self._prompt_tokens_child = self._prompt_tokens.labels(model_name)
        self._generation_tokens_child = self._generation_tokens.labels(model_name)
        self._public_registry = public_registry(self.registry, tenant_labels)
        self._compat_registry: CollectorRegistry | None = None
        if compat == "vllm":
            self._compat_registry = CollectorRegistry(auto_describe=False)
            self._compat_registry.register(_RenamedCollector(self._public_registry, VLLM_PREFIX, VLLM_ALIASES))

    def record_rejected(self, reason: str) -> None:
        self._rejected.labels(self.model_name, reason).inc()

    def record_refusal_time(self, reason: str, seconds: float) -> None:
        self._refusal_time.labels(self.model_name, reason).observe(seconds)

    def record_inter_token(self, seconds: float, num_tokens: int = 1) -> None:
        """`num_tokens` arrived `seconds` after the previous ones: that many equal gaps."""
        if num_tokens <= 0 or seconds < 0:
            return
        self._itl.observe(seconds / num_tokens, num_tokens)

    def record_finished(
        self,
        finish_reason: str,
        metrics: RequestMetrics | None,
        *,
        num_prompt_tokens: int | None = None,
        num_generation_tokens: int | None = None,
    ) -> None:
        self._success.labels(self.model_name, finish_reason).inc()
        if num_prompt_tokens is not None:
            self._prompt_tokens_child.observe(num_prompt_tokens)
        if num_generation_tokens is not None:
            self._generation_tokens_child.observe(num_generation_tokens)
        if metrics is None:
            return
        if metrics.time_to_first_token is not None:
            self._ttft_child.observe(metrics.time_to_first_token)
        if metrics.queue_time is not None:
            self._queue_child.observe(metrics.queue_time)
        if metrics.e2e_latency is not None:
            self._e2e_child.observe(metrics.e2e_latency)
        scheduled, first_token, finished = (
            metrics.first_scheduled_time,
            metrics.first_token_time,
            metrics.finished_time,
        )
        if scheduled is not None and first_token is not None:
            self._prefill_child.observe(max(first_token - scheduled, 0.0))
        if first_token is not None and finished is not None:
            self._decode_child.observe(max(finished - first_token, 0.0))
        if scheduled is not None and finished is not None:
            self._inference_child.observe(max(finished - scheduled, 0.0))

    def rendered_registries(self) -> list[CollectorRegistry]:
        """What /metrics renders, in order (a server of several models merges each model's)."""
        return [self._public_registry] + ([self._compat_registry] if self._compat_registry is not None else [])

    def render(self) -> tuple[bytes, str]:
        """The /metrics body (tenant-scoped label values emptied unless tenant_labels)."""
        body = b"".join(generate_latest(registry) for registry in self.rendered_registries())
        return body, CONTENT_TYPE_LATEST
