"""Latency under a short load profile, run on both gate sides in alternation so slow drift of
the machine hits both equally, repeated so each side's own spread (the noise band) is known.

The load generator is `pagoda bench`'s (HTTP only); the request classes are the suite's tags.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field
from typing import Any

from pagoda.bench.loadgen import LoadConfig, run_load_async
from pagoda.bench.records import BenchRequest, RunResult
from pagoda.ops.suite import Suite
from pagoda.ops.target import Target
from pagoda.stats import median, percentile

METRICS = ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99", "throughput")


@dataclass
class LoadProfile:
    num_requests: int = 16
    concurrency: int = 4
    max_tokens: int = 16
    repeats: int = 3

    def __post_init__(self) -> None:
        for name in ("num_requests", "concurrency", "max_tokens", "repeats"):
            if getattr(self, name) < 1:
                raise ValueError(f"latency {name} must be >= 1, got {getattr(self, name)}")


@dataclass
class RunStats:
    ttft_p50: float | None
    ttft_p99: float | None
    itl_p50: float | None
    itl_p99: float | None
    throughput: float  # output tokens per second
    num_failed: int
    ttfts: list[float] = field(default_factory=list)


def requests_for(suite: Suite, profile: LoadProfile) -> list[BenchRequest]:
    """The suite's prompts, cycled to num_requests, each a request class named by its first tag."""
    requests = []
    for index in range(profile.num_requests):
        case = suite.cases[index % len(suite.cases)]
        if case.is_chat:
            messages = case.messages or []
            text = "\n".join(m["content"] for m in messages)
        else:
            text = case.prompt if isinstance(case.prompt, str) else ""
            messages = [{"role": "user", "content": text}]
        if not text:  # token-id prompts have no text to send in the load profile
            continue
        requests.append(
            BenchRequest(
                index, (case.tags or ["untagged"])[0], text, messages, prompt_len=0, output_len=profile.max_tokens
            )
        )
    return requests


def run_stats(result: RunResult) -> RunStats:
    ok = [r for r in result.records if r.ok]
    ttfts = [r.ttft for r in ok if r.ttft is not None]
    itls = [x for r in ok for x in r.itls]
    tokens = sum(r.output_tokens for r in ok)
    return RunStats(
        percentile(ttfts, 50),
        percentile(ttfts, 99),
        percentile(itls, 50),
        percentile(itls, 99),
        tokens / result.duration if result.duration else 0.0,
        len(result.records) - len(ok),
        ttfts,
    )


async def _one_run(target: Target, requests: list[BenchRequest], profile: LoadProfile, progress: bool) -> RunStats:
    config = LoadConfig(
        base_url=target.base_url,
        model=str(target.model),
        concurrency=profile.concurrency,
        num_requests=len(requests),
        ignore_eos=True,
        api_key=target.api_key,
        timeout=120.0,
    )
    result = await run_load_async(config, requests, progress=progress, warmup_requests=requests[:1])
    return run_stats(result)


def measure(
    baseline: Target, candidate: Target, suite: Suite, profile: LoadProfile, *, progress: bool = True
) -> dict[str, list[RunStats]]:
    requests = requests_for(suite, profile)
    runs: dict[str, list[RunStats]] = {"baseline": [], "candidate": []}
    for _ in range(profile.repeats):
        for name, target in (("baseline", baseline), ("candidate", candidate)):
            runs[name].append(asyncio.run(_one_run(target, requests, profile, progress)))
    return runs


def _spread(values: list[float]) -> float:
    """The relative range of one side's repeats, (max - min) / median: how far it disagrees
    with itself. For three runs that is about 1.5 standard deviations of the ratio of two
    medians under pure noise: a regression outside it is unlikely to be noise."""
    mid = median(values)
    if not values or not mid:
        return 0.0
    return (max(values) - min(values)) / mid


def summarize(runs: dict[str, list[RunStats]]) -> dict[str, Any]:
    """Per-metric medians of both sides, candidate/baseline ratios and noise bands."""
    summary: dict[str, Any] = {"sides": {}, "ratios": {}, "noise": {}}
    for side, stats in runs.items():
        summary["sides"][side] = {
            metric: median([v for s in stats if (v := getattr(s, metric)) is not None]) for metric in METRICS
        }
        summary["sides"][side]["failed_requests"] = sum(s.num_failed for s in stats)
        summary["sides"][side]["repeats"] = [{metric: getattr(s, metric) for metric in METRICS} for s in stats]
    for metric in METRICS:
        base = summary["sides"]["baseline"][metric]
        cand = summary["sides"]["candidate"][metric]
        summary["ratios"][metric] = cand / base if base and cand is not None else None
        # The band is the baseline's disagreement with itself: the measurement noise of this
        # machine and load. The candidate's own spread is reported but never widens its
        # tolerance (an erratic candidate must not pass more easily).
        spreads = {
            side: _spread([v for s in stats if (v := getattr(s, metric)) is not None]) for side, stats in runs.items()
        }
        summary["noise"][metric] = spreads["baseline"]
        summary.setdefault("candidate_spread", {})[metric] = spreads["candidate"]
    return summary
