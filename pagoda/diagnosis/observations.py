"""From two samples of a server's Prometheus families to the figures the rules read.

A sample is every series with its labels, `(name, frozenset of (label, value)) -> value`: what
`pagoda.bench.server_metrics.parse_labeled` returns for a scrape's text, and what the dashboard
builds from its registry. Counters and histograms are read as the difference between the two
samples (what happened in the window); gauges at both ends. pagoda's names come first, vLLM's
(`vllm:`, with its older aliases) where a server exports only those.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from pagoda.stats import histogram_quantile

MetricSamples = dict[tuple[str, frozenset[tuple[str, str]]], float]
PREFIXES = ("pagoda:", "vllm:")

# Each figure's family names without the prefix, the current name first.
_NAMES = {
    "running": ("num_requests_running",),
    "waiting": ("num_requests_waiting",),
    "kv_usage": ("kv_cache_usage_perc", "gpu_cache_usage_perc"),
    "swapped": ("num_requests_swapped",),
    "finished": ("request_success",),
    "rejected": ("request_rejected",),
    "preemptions": ("num_preemptions",),
    "swap_bytes": ("kv_transfer_bytes",),
    "prefix_queries": ("prefix_cache_queries", "gpu_prefix_cache_queries"),
    "prefix_hits": ("prefix_cache_hits", "gpu_prefix_cache_hits"),
    "spec_drafts": ("spec_decode_num_drafts",),
    "spec_draft_tokens": ("spec_decode_num_draft_tokens",),
    "spec_accepted": ("spec_decode_num_accepted_tokens",),
    "prompt_tokens": ("prompt_tokens",),
    "generation_tokens": ("generation_tokens",),
    "lora_slot_loads": ("lora_slot_loads",),
    "ttft": ("time_to_first_token_seconds",),
    "itl": ("inter_token_latency_seconds", "time_per_output_token_seconds"),
    "queue": ("request_queue_time_seconds",),
    "prefill": ("request_prefill_time_seconds",),
    "decode": ("request_decode_time_seconds",),
    "e2e": ("e2e_request_latency_seconds",),
    "prompt_len": ("request_prompt_tokens",),
    "iteration_tokens": ("iteration_tokens_total",),
}
REPLICA_LABEL = "replica"


@dataclass
class HistogramWindow:
    """A histogram's observations inside the window: cumulative (upper bound, count), +Inf last."""

    buckets: list[tuple[float, float]]
    total: float

    @property
    def count(self) -> float:
        return self.buckets[-1][1] if self.buckets else 0.0

    @property
    def mean(self) -> float | None:
        return self.total / self.count if self.count > 0 else None

    def quantile(self, q: float) -> float | None:
        return histogram_quantile(q, self.buckets)


@dataclass
class ProbeReadings:
    """What the doctor's own requests saw. None: that probe was not run (or could not be)."""

    prompt_tokens: int | None = None
    cached_same_tenant: int | None = None  # the same prompt again, same key
    cached_other_tenant: int | None = None  # the same prompt again, a second key
    cached_chat_repeat: int | None = None  # the same chat messages again (the template's output)
    client_itl_p50: float | None = None  # gaps between the stream's content chunks, seconds
    client_ttft: float | None = None
    errors: list[str] = field(default_factory=list)


@dataclass
class Observations:
    """The window's figures. Counts are deltas over the window; `*_now`/`*_before` are gauges
    at its ends; None where the server does not export the figure."""

    window_s: float
    source: str | None = None  # "pagoda:" or "vllm:"
    running_before: float | None = None
    running_now: float | None = None
    waiting_before: float | None = None
    waiting_now: float | None = None
    kv_usage_before: float | None = None
    kv_usage_now: float | None = None
    swapped_now: float | None = None
    finished: float | None = None
    rejected: dict[str, float] = field(default_factory=dict)  # by reason
    preemptions: dict[str, float] = field(default_factory=dict)  # by mode
    swap_bytes: dict[str, float] = field(default_factory=dict)  # by direction
    prefix_queries: float | None = None
    prefix_hits: float | None = None
    spec_drafts: float | None = None
    spec_draft_tokens: float | None = None
    spec_accepted: float | None = None
    prompt_tokens: float | None = None
    generation_tokens: float | None = None
    lora_slot_loads: float | None = None
    histograms: dict[str, HistogramWindow] = field(default_factory=dict)
    replica_load: dict[str, float] = field(default_factory=dict)  # running + waiting now
    health: dict[str, Any] | None = None  # the /health body
    max_num_seqs: int | None = None
    max_model_len: int | None = None
    probe: ProbeReadings | None = None

    @property
    def total_preemptions(self) -> float:
        return sum(self.preemptions.values())

    @property
    def total_rejected(self) -> float:
        return sum(self.rejected.values())

    @property
    def prefix_hit_rate(self) -> float | None:
        if not self.prefix_queries or self.prefix_hits is None:
            return None
        return self.prefix_hits / self.prefix_queries

    @property
    def running_mean(self) -> float | None:
        ends = [v for v in (self.running_before, self.running_now) if v is not None]
        return sum(ends) / len(ends) if ends else None

    def histogram(self, key: str) -> HistogramWindow | None:
        """The window's histogram, None when the server has none or nothing was observed."""
        window = self.histograms.get(key)
        return window if window is not None and window.count > 0 else None


def _prefix_of(samples: MetricSamples) -> str | None:
    return next((p for p in PREFIXES if any(name.startswith(p) for name, _ in samples)), None)


def _family(samples: MetricSamples, prefix: str, key: str, suffixes: tuple[str, ...]) -> str | None:
    """The first of the figure's names the sample has (with one of `suffixes`)."""
    names = {name for name, _ in samples}
    for short in _NAMES[key]:
        if any(prefix + short + suffix in names for suffix in suffixes):
            return prefix + short
    return None


def _values(
    samples: MetricSamples,
    name: str,
    suffixes: tuple[str, ...],
    keep: Callable[[dict[str, str]], bool] = lambda labels: True,
) -> list[tuple[dict[str, str], float]]:
    return [
        (dict(labels), value)
        for (sample_name, labels), value in samples.items()
        if sample_name in {name + s for s in suffixes} and keep(dict(labels))
    ]


_COUNTER = ("", "_total")
_GAUGE = ("",)


def _total(samples: MetricSamples, name: str | None, suffixes: tuple[str, ...]) -> float | None:
    if name is None:
        return None
    return sum(value for _, value in _values(samples, name, suffixes))


def _by_label(samples: MetricSamples, name: str | None, label: str) -> dict[str, float]:
    out: dict[str, float] = {}
    if name is None:
        return out
    for labels, value in _values(samples, name, _COUNTER):
        key = labels.get(label, "")
        out[key] = out.get(key, 0.0) + value
    return out


def _histogram(samples: MetricSamples, name: str) -> tuple[dict[float, float], float]:
    buckets: dict[float, float] = {}
    for labels, value in _values(samples, name, ("_bucket",)):
        bound = float(labels["le"])
        buckets[bound] = buckets.get(bound, 0.0) + value
    return buckets, _total(samples, name, ("_sum",)) or 0.0


def observe(
    before: MetricSamples,
    after: MetricSamples,
    window_s: float,
    *,
    health: dict[str, Any] | None = None,
    max_num_seqs: int | None = None,
    max_model_len: int | None = None,
    probe: ProbeReadings | None = None,
) -> Observations:
    """The figures of the window between two samples (`before` may be empty: since the start)."""
    obs = Observations(
        window_s=window_s, health=health, max_num_seqs=max_num_seqs, max_model_len=max_model_len, probe=probe
    )
    prefix = _prefix_of(after)
    obs.source = prefix
    if prefix is None:
        return obs

    def name(key: str, suffixes: tuple[str, ...]) -> str | None:
        return _family(after, prefix, key, suffixes)

    def gauge_pair(key: str, average: bool = False) -> tuple[float | None, float | None]:
        family = name(key, _GAUGE)
        if family is None:
            return None, None
        ends = []
        for sample in (before, after):
            values = [v for _, v in _values(sample, family, _GAUGE)]
            ends.append((sum(values) / len(values) if average else sum(values)) if values else None)
        return ends[0], ends[1]

    def delta(key: str) -> float | None:
        family = name(key, _COUNTER)
        now = _total(after, family, _COUNTER)
        return None if now is None else max(0.0, now - (_total(before, family, _COUNTER) or 0.0))

    def delta_by(key: str, label: str) -> dict[str, float]:
        family = name(key, _COUNTER)
        now, then = _by_label(after, family, label), _by_label(before, family, label)
        return {k: v - then.get(k, 0.0) for k, v in now.items() if v - then.get(k, 0.0) > 0}

    obs.running_before, obs.running_now = gauge_pair("running")
    obs.waiting_before, obs.waiting_now = gauge_pair("waiting")
    obs.kv_usage_before, obs.kv_usage_now = gauge_pair("kv_usage", average=True)
    obs.swapped_now = gauge_pair("swapped")[1]
    for key in (
        "finished",
        "prefix_queries",
        "prefix_hits",
        "spec_drafts",
        "spec_draft_tokens",
        "spec_accepted",
        "prompt_tokens",
        "generation_tokens",
        "lora_slot_loads",
    ):
        setattr(obs, key, delta(key))
    obs.rejected = delta_by("rejected", "reason")
    obs.preemptions = delta_by("preemptions", "mode")
    obs.swap_bytes = delta_by("swap_bytes", "direction")
    for key in ("ttft", "itl", "queue", "prefill", "decode", "e2e", "prompt_len", "iteration_tokens"):
        family = name(key, ("_bucket",))
        if family is None:
            continue
        now, now_sum = _histogram(after, family)
        then, then_sum = _histogram(before, family)
        obs.histograms[key] = HistogramWindow(
            [(bound, now[bound] - then.get(bound, 0.0)) for bound in sorted(now)], now_sum - then_sum
        )
    load: dict[str, float] = {}
    for key in ("running", "waiting"):
        family = name(key, _GAUGE)
        for labels, value in _values(after, family, _GAUGE) if family else []:
            if REPLICA_LABEL in labels:
                load[labels[REPLICA_LABEL]] = load.get(labels[REPLICA_LABEL], 0.0) + value
    obs.replica_load = load
    return obs
