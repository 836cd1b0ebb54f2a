"""The dashboard's sliding window over the server's own metric state.

Twice-removed from the engine on purpose: every figure is read from the same Prometheus
registry that /metrics renders (so the page and a scrape never disagree) plus the request
log's records (for per-tenant rates and request timelines). No Prometheus server is needed.

A sample is taken at most once per `sample_interval` and only when somebody asks for a
snapshot, so an unwatched dashboard costs nothing. Rates come from the difference of two
samples; latency percentiles from the difference of two histograms `window_s` apart,
interpolated inside the bucket like PromQL's histogram_quantile.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import asdict, dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry

from pagoda.diagnosis import MetricSamples, diagnose, observe
from pagoda.serve.observability.request_log import RequestLogRecord
from pagoda.stats import histogram_quantile

PREFIX = "pagoda:"

# (key in a sample, metric family without the prefix). Counters and gauges are summed over
# every label but model_name, so e.g. request_rejected is all reasons together; a fraction
# (_AVERAGED) is averaged instead: with data-parallel replicas each has its own, labelled
# `replica`, and the replicas' pools are the same size.
_SCALARS = {
    "running": "num_requests_running",
    "waiting": "num_requests_waiting",
    "kv_usage": "kv_cache_usage_perc",
    "prefix_queries": "prefix_cache_queries",
    "prefix_hits": "prefix_cache_hits",
    "preemptions": "num_preemptions",
    "prompt_tokens": "prompt_tokens",
    "generation_tokens": "generation_tokens",
    "spec_draft_tokens": "spec_decode_num_draft_tokens",
    "spec_accepted_tokens": "spec_decode_num_accepted_tokens",
    "requests_finished": "request_success",
    "requests_rejected": "request_rejected",
}
_AVERAGED = {"kv_usage"}
# Counters of one label value, present only when their family is (None otherwise).
_LABELLED = {
    "guard_blocks": ("guardrail_decisions", "action", "block"),
    "guard_redactions": ("guardrail_decisions", "action", "redact"),
    "guard_flags": ("guardrail_decisions", "action", "flag"),
}
_HISTOGRAMS = {
    "ttft": "time_to_first_token_seconds",
    "itl": "inter_token_latency_seconds",
    "queue": "request_queue_time_seconds",
    "e2e": "e2e_request_latency_seconds",
}


@dataclass
class Histogram:
    """Cumulative bucket counts (upper bounds ascending, +Inf last) and their sum."""

    bounds: list[float]
    cumulative: list[float]
    total: float = 0.0

    @property
    def count(self) -> float:
        return self.cumulative[-1] if self.cumulative else 0.0

    def minus(self, older: Histogram | None) -> Histogram:
        if older is None or older.bounds != self.bounds:
            return self
        return Histogram(
            self.bounds, [a - b for a, b in zip(self.cumulative, older.cumulative)], self.total - older.total
        )

    def quantile(self, q: float) -> float | None:
        return histogram_quantile(q, list(zip(self.bounds, self.cumulative)))


@dataclass
class Sample:
    time: float
    scalars: dict[str, float | None]
    histograms: dict[str, Histogram]
    labeled: MetricSamples = field(default_factory=dict)  # every series, for the diagnosis rules

    def scalar(self, key: str) -> float:
        """One of the _SCALARS figures: read_registry gives each a value (only _LABELLED ones may be None)."""
        value = self.scalars[key]
        assert value is not None, f"{key} is a labelled counter, not one of the dashboard's scalars"
        return value


def read_registry(registry: CollectorRegistry, now: float) -> Sample:
    """One reading of the pagoda:* families the dashboard shows."""
    scalar_keys = {PREFIX + family: key for key, family in _SCALARS.items()}
    histogram_keys = {PREFIX + family: key for key, family in _HISTOGRAMS.items()}
    scalars: dict[str, float | None] = {key: 0.0 for key in _SCALARS}
    scalars.update({key: None for key in _LABELLED})
    histograms: dict[str, Histogram] = {}
    labeled: MetricSamples = {}
    for family in registry.collect():
        for s in family.samples:
            labeled[(s.name, frozenset(s.labels.items()))] = s.value
        for key, (name, label, value) in _LABELLED.items():
            if family.name == PREFIX + name:
                scalars[key] = sum(
                    s.value for s in family.samples if s.name.endswith("_total") and s.labels.get(label) == value
                )
        if family.name in scalar_keys:
            key = scalar_keys[family.name]
            values = [s.value for s in family.samples if s.name in (family.name, family.name + "_total")]
            scalars[key] = (sum(values) / len(values) if values else 0.0) if key in _AVERAGED else sum(values)
        elif family.name in histogram_keys:
            buckets: dict[float, float] = {}
            total = 0.0
            for s in family.samples:
                if s.name.endswith("_bucket"):
                    bound = float(s.labels["le"])
                    buckets[bound] = buckets.get(bound, 0.0) + s.value
                elif s.name.endswith("_sum"):
                    total += s.value
            bounds = sorted(buckets)
            histograms[histogram_keys[family.name]] = Histogram(bounds, [buckets[b] for b in bounds], total)
    return Sample(now, scalars, histograms, labeled)


_MOE_TOKENS = PREFIX + "moe_expert_tokens_total"
_MOE_IMBALANCE = {"expert_imbalance": PREFIX + "moe_expert_imbalance", "rank_imbalance": PREFIX + "moe_rank_imbalance"}


def _expert_tokens(sample: Sample) -> dict[int, dict[int, float]]:
    """layer -> expert -> tokens routed since start, summed over the other labels (replicas)."""
    tokens: dict[int, dict[int, float]] = {}
    for (name, labels), value in sample.labeled.items():
        if name == _MOE_TOKENS:
            label = dict(labels)
            layer = tokens.setdefault(int(label["layer"]), {})
            layer[int(label["expert"])] = layer.get(int(label["expert"]), 0.0) + value
    return tokens


def moe_load(sample: Sample, start: Sample | None) -> list[dict[str, Any]] | None:
    """Per MoE layer (--moe-metrics): tokens routed to each expert since the server started and
    over the window (None while the window has one sample), the window's max / mean, and the
    engine's last-step imbalance gauges (the largest over replicas). None when the server
    exports no MoE figures."""
    totals = _expert_tokens(sample)
    if not totals:
        return None
    before = _expert_tokens(start) if start is not None else None
    gauges: dict[tuple[str, int], float] = {}
    for (name, labels), value in sample.labeled.items():
        for key, family in _MOE_IMBALANCE.items():
            if name == family:
                layer_key = (key, int(dict(labels)["layer"]))
                gauges[layer_key] = max(value, gauges.get(layer_key, value))
    layers = []
    for layer in sorted(totals):
        experts = range(max(totals[layer]) + 1)
        counts = [totals[layer].get(expert, 0.0) for expert in experts]
        window = (
            None
            if before is None
            else [max(0.0, count - before.get(layer, {}).get(expert, 0.0)) for expert, count in zip(experts, counts)]
        )
        routed = sum(window) if window is not None else 0.0
        layers.append(
            {
                "layer": layer,
                "expert_tokens": counts,
                "window_tokens": window,
                "window_imbalance": max(window) * len(window) / routed if window and routed else None,
                **{key: gauges.get((key, layer)) for key in _MOE_IMBALANCE},
            }
        )
    return layers


@dataclass
class TenantRates:
    requests: int = 0
    prompt_tokens: int = 0
    output_tokens: int = 0
    rejected: int = 0
    cost_usd: float | None = None  # None while no request of the tenant was priced (--price-table)


@dataclass
class DashboardWindow:
    """Samples of one app's registry and its recent request records."""

    registry: CollectorRegistry
    window_s: float = 60.0
    sample_interval: float = 1.0
    history_points: int = 120
    max_timelines: int = 30
    max_records: int = 100_000  # a hard bound on the records kept for the window
    clock: Callable[[], float] = time.time
    # /health's body and the /v1/models figures the diagnosis rules read (max_num_seqs, ...).
    server_info: Callable[[], dict[str, Any]] = dict
    _samples: deque[Sample] = field(default_factory=deque, init=False)
    _history: deque[dict[str, Any]] = field(default_factory=deque, init=False)
    _records: deque[tuple[float, RequestLogRecord]] = field(default_factory=deque, init=False)
    _started: float = field(default=0.0, init=False)

    def __post_init__(self) -> None:
        self._started = self.clock()

    # ---- inputs -------------------------------------------------------------------------------

    def observe_request(self, record: RequestLogRecord) -> None:
        """A request ended (or was refused): its log record, as the request log got it."""
        self._records.append((self.clock(), record))
        # Kept for the window and at least the last `max_timelines` requests.
        horizon = self.clock() - self.window_s
        while (
            len(self._records) > self.max_timelines
            and self._records[0][0] < horizon
            or len(self._records) > self.max_records
        ):
            self._records.popleft()

    def sample(self) -> Sample:
        """The newest sample, taking a new one when the last is `sample_interval` old."""
        now = self.clock()
        if self._samples and now - self._samples[-1].time < self.sample_interval * 0.9:
            return self._samples[-1]
        sample = read_registry(self.registry, now)
        previous = self._samples[-1] if self._samples else None
        self._samples.append(sample)
        while len(self._samples) > 2 and self._samples[1].time <= now - self.window_s:
            self._samples.popleft()
        self._history.append(self._point(sample, previous))
        while len(self._history) > self.history_points:
            self._history.popleft()
        return sample

    # ---- derived figures ----------------------------------------------------------------------

    def _window_start(self) -> Sample | None:
        """The oldest sample still inside the window (None with fewer than two samples)."""
        return self._samples[0] if len(self._samples) > 1 else None

    def _point(self, sample: Sample, previous: Sample | None) -> dict[str, Any]:
        """One point of the charts: rates since the previous sample, percentiles over the window."""
        s = sample.scalars
        elapsed = sample.time - previous.time if previous is not None else 0.0

        def rate(key: str) -> float:
            if previous is None or elapsed <= 0:
                return 0.0
            return max(0.0, sample.scalar(key) - previous.scalar(key)) / elapsed

        start = self._window_start()
        point: dict[str, Any] = {
            "t": round(sample.time, 3),
            "running": s["running"],
            "waiting": s["waiting"],
            "kv_usage": s["kv_usage"],
            "output_tok_s": rate("generation_tokens"),
            "prompt_tok_s": rate("prompt_tokens"),
            "rejected_s": rate("requests_rejected"),
            "finished_s": rate("requests_finished"),
        }
        for key in ("ttft", "itl", "queue"):
            histogram = sample.histograms.get(key)
            if histogram is None:
                continue
            recent = histogram.minus(start.histograms.get(key) if start else None)
            point[key + "_p50"] = recent.quantile(0.5)
            point[key + "_p99"] = recent.quantile(0.99)
        return point

    def _totals(self, sample: Sample) -> dict[str, Any]:
        s = sample.scalars
        start = self._window_start()

        def delta(key: str) -> float:
            return sample.scalar(key) - start.scalar(key) if start is not None else sample.scalar(key)

        queries, draft = delta("prefix_queries"), delta("spec_draft_tokens")
        return {
            "requests_finished": s["requests_finished"],
            "requests_rejected": s["requests_rejected"],
            "generation_tokens": s["generation_tokens"],
            "prompt_tokens": s["prompt_tokens"],
            "preemptions": s["preemptions"],
            "preemptions_window": delta("preemptions"),
            "prefix_hit_rate": delta("prefix_hits") / queries if queries > 0 else None,
            "spec_acceptance_rate": delta("spec_accepted_tokens") / draft if draft > 0 else None,
            # None when the server runs without --guardrails.
            **{key: s[key] for key in _LABELLED},
        }

    def _tenants(self, visible: Callable[[str | None], bool], now: float) -> dict[str, Any]:
        rates: dict[str, TenantRates] = {}
        for ended, record in self._records:
            if ended < now - self.window_s or not visible(record.tenant):
                continue
            tenant = rates.setdefault(record.tenant or "-", TenantRates())
            if record.status >= 400 and record.output_tokens == 0:
                tenant.rejected += 1
                continue
            tenant.requests += 1
            tenant.prompt_tokens += record.prompt_tokens
            tenant.output_tokens += record.output_tokens
            if record.cost_usd is not None:
                tenant.cost_usd = (tenant.cost_usd or 0.0) + record.cost_usd
        # Rates over the window, or over the server's life while that is shorter.
        span = max(1.0, min(self.window_s, now - self._started))
        return {
            name: {
                "requests_per_s": r.requests / span,
                "tokens_per_s": (r.prompt_tokens + r.output_tokens) / span,
                "output_tokens_per_s": r.output_tokens / span,
                "requests": r.requests,
                "rejected": r.rejected,
                "cost_usd": r.cost_usd,
            }
            for name, r in sorted(rates.items())
        }

    def _timelines(self, visible: Callable[[str | None], bool]) -> list[dict[str, Any]]:
        """The last requests as queue -> prefill -> decode durations (seconds)."""
        timelines: list[dict[str, Any]] = []
        for ended, record in reversed(self._records):
            if len(timelines) >= self.max_timelines:
                break
            if not visible(record.tenant):
                continue
            e2e = record.e2e_s or 0.0
            queue = record.queue_time_s or 0.0
            ttft = record.ttft_s if record.ttft_s is not None else e2e
            timelines.append(
                {
                    "id": record.request_id,
                    "tenant": record.tenant,
                    "endpoint": record.endpoint,
                    "status": record.status,
                    "finish_reason": record.finish_reason,
                    "ended": round(ended, 3),
                    "queue_s": queue,
                    "prefill_s": max(0.0, ttft - queue),
                    "decode_s": max(0.0, e2e - ttft),
                    "prompt_tokens": record.prompt_tokens,
                    "output_tokens": record.output_tokens,
                }
            )
        return timelines

    def _diagnosis(self, sample: Sample) -> list[dict[str, Any]]:
        """The triage rules (pagoda doctor's) over the window: server-wide figures only."""
        start = self._window_start()
        if start is None:
            return []
        info = self.server_info()
        observations = observe(
            start.labeled,
            sample.labeled,
            max(sample.time - start.time, 1e-3),
            health=info.get("health"),
            max_num_seqs=info.get("max_num_seqs"),
            max_model_len=info.get("max_model_len"),
        )
        return [asdict(finding) for finding in diagnose(observations)]

    def snapshot(self, visible_tenants: Iterable[str] | None = None) -> dict[str, Any]:
        """Everything the page shows. `visible_tenants`: None for all (an admin key), else the
        only tenants whose per-tenant figures and requests may be shown. Server-wide figures
        (the same ones /metrics publishes) are always shown."""
        sample = self.sample()
        allowed = None if visible_tenants is None else set(visible_tenants)

        def visible(tenant: str | None) -> bool:
            return allowed is None or tenant in allowed

        return {
            "time": sample.time,
            "window_s": self.window_s,
            "scope": "all" if allowed is None else sorted(allowed),
            "now": self._history[-1] if self._history else {},
            "totals": self._totals(sample),
            "history": list(self._history),
            "tenants": self._tenants(visible, sample.time),
            "requests": self._timelines(visible),
            "diagnosis": self._diagnosis(sample),
            "moe": moe_load(sample, self._window_start()),
        }
