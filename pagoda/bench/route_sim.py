"""`pagoda bench route-sim`: replay a trace against N simulated replicas, once per router
policy, and report prefix hit rate, load imbalance and TTFT. How the router holds at fleet
scale without a fleet.

The router is the real one (pagoda/replicas/policies.py: the same policy objects the server
runs); the replicas are simulated, each a small model of the engine:
- continuous batching as the scheduler does it: every running request decodes one token per
  step, prompts are computed in chunks within `max_num_batched_tokens`, waiting requests are
  admitted first come first served up to `max_num_seqs`;
- a prefix cache of `cache_blocks` blocks per replica, LRU, keyed like the engine's (chained
  block hashes salted by tenant): an admitted request skips its cached leading blocks;
- a clock from the step cost model (step_cost.py), fitted to the real engine's step times.
The router sees each replica's outstanding tokens (prompt tokens not yet computed plus tokens
still to generate), as the live ReplicaSet counts them.

Reported per policy and fleet size: prefix hit rate (cached / all prompt tokens), load
imbalance (each replica's outstanding tokens averaged over the run, then the most loaded
replica's average over the fleet's mean: a policy that keeps piling onto hot replicas shows
here, momentary noise does not), TTFT p50 / p99, and requests per second served.
"""

from __future__ import annotations

import heapq
import json
import math
import statistics
from collections import OrderedDict, deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pagoda.bench.route_traces import TraceRequest, generate_trace, load_trace, trace_summary
from pagoda.bench.step_cost import DEFAULT_STEP_COST, StepCost
from pagoda.replicas.policies import ReplicaLoad, RouteRequest, RouterPolicy, make_policy
from pagoda.stats import percentile

POLICIES = ("round_robin", "least_load", "cache_aware")


@dataclass(frozen=True)
class ReplicaModel:
    """What each simulated replica is: its scheduler limits and its prefix cache size."""

    block_size: int = 16
    cache_blocks: int = 2048
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048
    cost: StepCost = DEFAULT_STEP_COST


@dataclass
class _Request:
    trace: TraceRequest
    route: RouteRequest
    hashes: list[int]
    remaining_prefill: int = 0  # prompt tokens still to compute (after the cache)
    generated: int = 0
    cached_tokens: int = 0
    first_token_s: float | None = None
    admitted: bool = False

    @property
    def prompt_len(self) -> int:
        return len(self.trace.prompt_token_ids)

    def outstanding(self) -> int:
        return self.remaining_prefill + self.trace.output_tokens - self.generated


class _Replica:
    def __init__(self, index: int, model: ReplicaModel) -> None:
        self.index = index
        self.model = model
        self.waiting: deque[_Request] = deque()
        self.running: list[_Request] = []
        self.cache: OrderedDict[int, None] = OrderedDict()
        self.outstanding = 0
        self.busy = False
        self.step: list[tuple[_Request, int]] = []  # (request, prompt tokens) of the step running

    def cached_prefix(self, hashes: Sequence[int]) -> int:
        depth = 0
        for block_hash in hashes:
            if block_hash not in self.cache:
                break
            depth += 1
        return depth

    def touch(self, hashes: Sequence[int]) -> None:
        # Leading blocks touched last, so they are evicted last (as the engine frees tails first).
        for block_hash in reversed(hashes):
            if block_hash in self.cache:
                self.cache.move_to_end(block_hash)
            else:
                self.cache[block_hash] = None
        while len(self.cache) > self.model.cache_blocks:
            self.cache.popitem(last=False)

    def add(self, request: _Request) -> None:
        # Estimated as the router would: the prompt minus what is cached now.
        cached = min(self.cached_prefix(request.hashes) * self.model.block_size, request.prompt_len - 1)
        request.remaining_prefill = request.prompt_len - cached
        self.outstanding += request.outstanding()
        self.waiting.append(request)

    def start_step(self) -> float | None:
        """Schedule one step; its duration, or None when there is nothing to do."""
        model = self.model
        budget = model.max_num_batched_tokens
        decoding = [r for r in self.running if r.remaining_prefill == 0]
        budget -= len(decoding)
        self.step = [(r, 0) for r in decoding]
        prefill = 0
        for request in self.running:
            if request.remaining_prefill and budget > 0:
                chunk = min(request.remaining_prefill, budget)
                self.step.append((request, chunk))
                budget -= chunk
                prefill += chunk
        while self.waiting and budget > 0 and len(self.running) < model.max_num_seqs:
            request = self.waiting.popleft()
            self._admit(request)
            self.running.append(request)
            chunk = min(request.remaining_prefill, budget)
            self.step.append((request, chunk))
            budget -= chunk
            prefill += chunk
        if not self.step:
            return None
        context = sum(r.prompt_len + r.generated for r in decoding)
        return model.cost.seconds(prefill, len(decoding), context)

    def _admit(self, request: _Request) -> None:
        before = request.outstanding()
        depth = self.cached_prefix(request.hashes)
        cached = min(depth * self.model.block_size, request.prompt_len - 1)
        request.cached_tokens = cached
        request.remaining_prefill = request.prompt_len - cached
        request.admitted = True
        self.touch(request.hashes[:depth])
        self.outstanding += request.outstanding() - before

    def finish_step(self, now: float) -> list[_Request]:
        """Apply the step's progress; returns the requests that finished."""
        finished = []
        for request, chunk in self.step:
            before = request.outstanding()
            if chunk:
                request.remaining_prefill -= chunk
                if request.remaining_prefill == 0:
                    request.first_token_s = now
                    request.generated = 1
                    self.touch(request.hashes)
            else:
                request.generated += 1
            self.outstanding += request.outstanding() - before
            if request.remaining_prefill == 0 and request.generated >= request.trace.output_tokens:
                finished.append(request)
        if finished:
            done = {id(r) for r in finished}
            self.running = [r for r in self.running if id(r) not in done]
        self.step = []
        return finished


@dataclass
class PolicyResult:
    policy: str
    num_replicas: int
    hit_rate: float
    imbalance: float
    ttft_p50_s: float
    ttft_p99_s: float
    throughput_rps: float
    routed_by_prefix: float  # share of requests the policy sent for a cached prefix

    def row(self) -> list[str]:
        return [
            self.policy,
            str(self.num_replicas),
            f"{self.hit_rate:.1%}",
            f"{self.imbalance:.2f}",
            f"{self.ttft_p50_s * 1000:.0f}",
            f"{self.ttft_p99_s * 1000:.0f}",
            f"{self.throughput_rps:.0f}",
        ]


def simulate(
    trace: Sequence[TraceRequest], policy: RouterPolicy, num_replicas: int, model: ReplicaModel = ReplicaModel()
) -> PolicyResult:
    """Replay `trace` through `policy` onto `num_replicas` simulated replicas."""
    replicas = [_Replica(i, model) for i in range(num_replicas)]
    events: list[tuple[float, int, int, int]] = []  # (time, order, kind, replica or request)
    ARRIVAL, STEP_DONE = 0, 1
    order = 0
    for index, traced in enumerate(trace):
        events.append((traced.arrival_s, order, ARRIVAL, index))
        order += 1
    heapq.heapify(events)
    all_requests: list[_Request] = []
    load_sums = [0] * num_replicas  # each replica's outstanding tokens, summed over arrivals
    by_prefix = 0
    now = 0.0

    def kick(replica: _Replica) -> None:
        nonlocal order
        if replica.busy:
            return
        duration = replica.start_step()
        if duration is not None:
            replica.busy = True
            heapq.heappush(events, (now + duration, order, STEP_DONE, replica.index))
            order += 1

    while events:
        now, _, kind, which = heapq.heappop(events)
        if kind == ARRIVAL:
            traced = trace[which]
            route = RouteRequest(traced.prompt_token_ids, traced.output_tokens, traced.tenant, traced.tenant)
            loads = [ReplicaLoad(r.index, r.outstanding) for r in replicas]
            for r in replicas:
                load_sums[r.index] += r.outstanding
            choice = policy.choose(route, loads)
            policy.routed(route, choice.replica)
            by_prefix += choice.reason == "prefix"
            request = _Request(traced, route, route.block_hashes(model.block_size))
            all_requests.append(request)
            replica = replicas[choice.replica]
            replica.add(request)
            kick(replica)
        else:
            replica = replicas[which]
            replica.busy = False
            replica.finish_step(now)
            kick(replica)
    ttfts = [r.first_token_s - r.trace.arrival_s for r in all_requests if r.first_token_s is not None]
    prompt_tokens = sum(r.prompt_len for r in all_requests)
    cached = sum(r.cached_tokens for r in all_requests)
    return PolicyResult(
        policy=policy.name,
        num_replicas=num_replicas,
        hit_rate=cached / prompt_tokens if prompt_tokens else 0.0,
        # Poisson arrivals see time averages (PASTA): load_sums / arrivals is each replica's
        # mean outstanding tokens over the run.
        imbalance=max(load_sums) / statistics.fmean(load_sums) if any(load_sums) else 1.0,
        ttft_p50_s=_percentile_or_nan(ttfts, 50),
        ttft_p99_s=_percentile_or_nan(ttfts, 99),
        throughput_rps=len(all_requests) / now if now > 0 else 0.0,
        routed_by_prefix=by_prefix / max(len(all_requests), 1),
    )


def _percentile_or_nan(values: list[float], q: float) -> float:
    value = percentile(values, q)
    return math.nan if value is None else value


@dataclass
class RouteSimOptions:
    trace: str = "chat"  # chat, rag, or a JSON-lines file
    replicas: list[int] = field(default_factory=lambda: [2, 8, 32, 64])
    policies: list[str] = field(default_factory=lambda: list(POLICIES))
    requests_per_replica: int = 150
    rate_per_replica: float = 2.0  # requests per second per replica
    tenants_per_replica: int | None = None  # generated traces: the shape's default
    model: ReplicaModel = ReplicaModel()
    tokenizer: str | None = None  # to tokenize text prompts of a trace file
    seed: int = 0
    out: str | None = None  # write results.json here


def route_sim(options: RouteSimOptions) -> dict[str, Any]:
    """Every policy at every fleet size; returns the report (and prints its table)."""
    for name in options.policies:
        make_policy(name)  # an unknown name fails before any work
    results: list[PolicyResult] = []
    traces: dict[int, dict[str, Any]] = {}
    fixed_trace = None
    if options.trace not in ("chat", "rag"):
        tokenize = None
        if options.tokenizer:
            from pagoda.tokenizer import Tokenizer

            tokenize = Tokenizer.from_pretrained(options.tokenizer).encode
        fixed_trace = load_trace(
            options.trace, rate=options.rate_per_replica * max(options.replicas), tokenize=tokenize
        )
    for n in options.replicas:
        trace = (
            fixed_trace
            if fixed_trace is not None
            else generate_trace(
                options.trace,
                n,
                requests_per_replica=options.requests_per_replica,
                rate_per_replica=options.rate_per_replica,
                seed=options.seed,
                tenants_per_replica=options.tenants_per_replica,
            )
        )
        traces[n] = trace_summary(trace)
        for name in options.policies:
            policy = make_policy(name, block_size=options.model.block_size, capacity_blocks=options.model.cache_blocks)
            results.append(simulate(trace, policy, n, options.model))
    report = {
        "trace": options.trace,
        "traces": traces,
        "replica_model": {**asdict(options.model), "cost": options.model.cost.to_dict()},
        "requests_per_replica": options.requests_per_replica,
        "rate_per_replica": options.rate_per_replica,
        "tenants_per_replica": options.tenants_per_replica,
        "results": [asdict(r) for r in results],
    }
    if options.out:
        out = Path(options.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.json").write_text(json.dumps(report, indent=2) + "\n")
    return report


def render_table(report: dict[str, Any]) -> str:
    headers = ["policy", "replicas", "prefix hit", "imbalance", "TTFT p50 ms", "TTFT p99 ms", "req/s"]
    rows = [PolicyResult(**r).row() for r in report["results"]]
    widths = [max(len(h), *(len(row[i]) for row in rows)) for i, h in enumerate(headers)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(headers, widths)), "  ".join("-" * w for w in widths)]
    lines += ["  ".join(c.ljust(w) for c, w in zip(row, widths)) for row in rows]
    return "\n".join(lines)
