"""The runbook's rules: each reads `Observations` and returns the findings it supports.

Rules only fire on what the window shows; a figure the server does not export (or that saw no
traffic) makes its rule stay silent rather than guess. Thresholds are the `Targets` (the
latency objectives an operator sets) and the named constants below (what counts as "mostly",
"high", "thrashing").
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from pagoda.diagnosis.findings import Finding, ranked
from pagoda.diagnosis.observations import Observations

QUEUE_SHARE = 0.5  # queue time as a share of TTFT above which waiting, not computing, is the cause
MIN_QUEUE_S = 0.05  # mean queue time below which nobody notices the queue
PREFILL_SHARE = 0.5
KV_HIGH = 0.9  # KV pool usage that leaves no headroom for the next long prompt
LOW_HIT_RATE = 0.2
MIN_PREFIX_QUERIES = 256  # prompt tokens looked up before a hit rate means anything
LOW_ACCEPTANCE = 0.3
MIN_DRAFT_TOKENS = 32
CLIENT_GAP_FACTOR = 2.0  # client chunk spacing over the server's ITL that points at the path between
CLIENT_GAP_SLACK_S = 0.02
LOW_OCCUPANCY = 0.25  # running sequences as a share of max_num_seqs
IMBALANCE = 2.0  # the busiest replica over the mean
MIN_IMBALANCE_LOAD = 4
SLOT_LOADS_PER_REQUEST = 0.5


@dataclass(frozen=True)
class Targets:
    """The latency objectives findings are judged against, seconds."""

    ttft_s: float = 1.0
    itl_s: float = 0.1


def _round(value: float | None, digits: int = 4) -> float | None:
    return None if value is None else round(value, digits)


def _latency(obs: Observations, key: str) -> dict[str, Any]:
    window = obs.histogram(key)
    if window is None:
        return {}
    return {
        f"{key}_p50_s": _round(window.quantile(0.5)),
        f"{key}_p95_s": _round(window.quantile(0.95)),
        f"{key}_mean_s": _round(window.mean),
        f"{key}_count": window.count,
    }


def _health(obs: Observations, targets: Targets) -> list[Finding]:
    health = obs.health
    if not health:
        return []
    if health.get("status") == "dead":
        return [
            Finding(
                "server_dead",
                "critical",
                "the engine is dead: /health answers 503",
                {"error": health.get("error")},
                [
                    "the server log: the engine's error and what preceded it",
                    "restart the server; with --num-replicas the supervisor restarts replicas",
                ],
            )
        ]
    replicas = health.get("replicas") or []
    down = [r for r in replicas if not r.get("alive", True)]
    if not down:
        return []
    return [
        Finding(
            "dead_replica",
            "critical",
            f"{len(down)} of {len(replicas)} replicas are down; the rest carry their load",
            {
                "status": health.get("status"),
                "down": [{"replica": r.get("replica"), "error": r.get("error")} for r in down],
                "alive_requests": {str(r.get("replica")): r.get("requests") for r in replicas if r.get("alive", True)},
            },
            [
                "the server log around the replica's exit (out of memory? a crash?)",
                "whether the supervisor is restarting it (/health again in a minute)",
                "the live replicas' queues: they now take all the traffic",
            ],
        )
    ]


def _imbalance(obs: Observations, targets: Targets) -> list[Finding]:
    alive = {
        str(r.get("replica")): float(r.get("requests") or 0)
        for r in (obs.health or {}).get("replicas") or []
        if r.get("alive", True)
    }
    load = alive or obs.replica_load
    if len(load) < 2:
        return []
    mean = sum(load.values()) / len(load)
    busiest = max(load.values())
    if busiest < MIN_IMBALANCE_LOAD or busiest < IMBALANCE * mean:
        return []
    return [
        Finding(
            "router_imbalance",
            "warning",
            "one replica carries most of the requests",
            {"requests_by_replica": load, "max_over_mean": round(busiest / mean, 2)},
            [
                "--router: least_load spreads by outstanding tokens, cache_aware follows prefixes",
                "a dominant tenant or shared prefix pinning traffic to one replica (cache_aware)",
            ],
        )
    ]


def _queue(obs: Observations, targets: Targets) -> list[Finding]:
    queue, ttft = obs.histogram("queue"), obs.histogram("ttft")
    if queue is None or queue.mean is None or queue.mean < MIN_QUEUE_S:
        return []
    share = queue.mean / ttft.mean if ttft is not None and ttft.mean else None
    if share is not None and share < QUEUE_SHARE:
        return []
    running = max(v for v in (obs.running_before, obs.running_now, 0.0) if v is not None)
    evidence = {
        **_latency(obs, "queue"),
        "ttft_mean_s": _round(ttft.mean if ttft else None),
        "queue_share_of_ttft": _round(share, 3),
        "running_max": running,
        "waiting_now": obs.waiting_now,
        "max_num_seqs": obs.max_num_seqs,
        "kv_usage_now": _round(obs.kv_usage_now, 3),
        "rejected": obs.rejected or None,
    }
    full = obs.max_num_seqs is not None and running >= obs.max_num_seqs
    if full or obs.max_num_seqs is None:
        return [
            Finding(
                "queue_wait",
                "warning",
                "time to first token is mostly queueing: the batch is full"
                if full
                else "time to first token is mostly queueing",
                evidence,
                [
                    "--max-num-seqs: raise it if `pagoda plan` says the KV pool holds more",
                    "more replicas (--num-replicas) or a lower request rate",
                    "per-tenant max_concurrent_requests if one tenant fills the batch",
                ],
            )
        ]
    return [
        Finding(
            "queue_engine_idle",
            "warning",
            "requests queue while the batch has room: admission holds them back",
            evidence,
            [
                "KV pool usage: a full pool admits nothing new (see the memory findings)",
                "the step budget: --max-num-batched-tokens against the prompt sizes",
                "tenant limits and refusals (request_rejected by reason)",
                "/health: dead or restarting replicas",
            ],
        )
    ]


def _slow_prefill(obs: Observations, targets: Targets) -> list[Finding]:
    ttft, prefill = obs.histogram("ttft"), obs.histogram("prefill")
    if ttft is None or prefill is None or prefill.mean is None:
        return []
    p95 = ttft.quantile(0.95)
    if p95 is None or p95 <= targets.ttft_s:
        return []
    share = prefill.mean / ttft.mean if ttft.mean else None
    if share is None or share < PREFILL_SHARE:
        return []
    prompts, steps = obs.histogram("prompt_len"), obs.histogram("iteration_tokens")
    return [
        Finding(
            "slow_prefill",
            "warning",
            f"time to first token p95 is over {targets.ttft_s:g}s and mostly prefill",
            {
                "ttft_p95_s": _round(p95),
                **_latency(obs, "prefill"),
                "prefill_share_of_ttft": _round(share, 3),
                "prompt_tokens_p95": _round(prompts.quantile(0.95) if prompts else None, 0),
                "step_tokens_p95": _round(steps.quantile(0.95) if steps else None, 0),
                "prefix_cache_hit_rate": _round(obs.prefix_hit_rate, 3),
            },
            [
                "long prompts: the prefix cache hit rate (shared system prompts should hit)",
                "--max-num-batched-tokens: a small step budget splits a prompt over many steps",
                "prefill/decode disaggregation (--replica-roles) when long prompts stall decodes",
            ],
        )
    ]


def _memory(obs: Observations, targets: Targets) -> list[Finding]:
    preempted = obs.total_preemptions
    usage = obs.kv_usage_now
    evidence = {
        "preemptions_by_mode": obs.preemptions or None,
        "kv_usage_before": _round(obs.kv_usage_before, 3),
        "kv_usage_now": _round(usage, 3),
        "swapped_now": obs.swapped_now,
        "swap_bytes": obs.swap_bytes or None,
        "running_now": obs.running_now,
        "max_num_seqs": obs.max_num_seqs,
        "finished": obs.finished,
    }
    if obs.running_now and usage:
        # Sequences the pool would hold at the running mix: what `pagoda plan` computes from lengths.
        evidence["sequences_the_pool_holds_at_this_mix"] = int(obs.running_now / usage)
    checks = [
        "`pagoda plan --model M --memory ... --classes ...`: the concurrency the KV pool holds "
        "for your prompt/output lengths, against --max-num-seqs",
        "--max-num-seqs lower, or a bigger pool (--kv-cache-memory), or --kv-cache-dtype fp8",
        "--kv-offload-memory with --preemption-mode swap/auto: swap instead of recomputing",
        "`pagoda bench oom-lab` to measure where preemption starts",
    ]
    if preempted > 0:
        severe = obs.finished is not None and preempted >= max(obs.finished, 1)
        return [
            Finding(
                "preemptions",
                "critical" if severe else "warning",
                "the KV pool is too small for the running batch: requests are preempted",
                evidence,
                checks,
            )
        ]
    if usage is not None and usage >= KV_HIGH:
        return [
            Finding("kv_pool_full", "warning", "the KV pool is nearly full: preemptions are next", evidence, checks)
        ]
    return []


def _refusals(obs: Observations, targets: Targets) -> list[Finding]:
    if obs.total_rejected <= 0:
        return []
    reasons = obs.rejected
    checks = []
    if "rate_limited" in reasons:
        checks.append("tenant limits (--api-keys file): requests/tokens per minute, max_concurrent_requests")
    if "overloaded" in reasons:
        checks.append("the admission queue (--max-queued-requests, --max-queued-tokens): the server sheds load")
    if "engine_dead" in reasons:
        checks.append("/health: requests were refused because an engine is dead")
    if "invalid_request" in reasons or "too_large" in reasons:
        checks.append("client requests over the context or body limits (400/413): the request log")
    checks.append("the request log (its tenant, endpoint and status per request) for who is refused")
    refused_share = obs.total_rejected / (obs.total_rejected + (obs.finished or 0))
    return [
        Finding(
            "refusals",
            "warning" if refused_share < 0.5 else "critical",
            "requests are refused before they run",
            {"rejected_by_reason": reasons, "finished": obs.finished, "refused_share": round(refused_share, 3)},
            checks,
        )
    ]


def _slow_streaming(obs: Observations, targets: Targets) -> list[Finding]:
    findings = []
    itl = obs.histogram("itl")
    server_p50 = itl.quantile(0.5) if itl else None
    probe = obs.probe
    if server_p50 is not None and server_p50 > targets.itl_s:
        steps = obs.histogram("iteration_tokens")
        findings.append(
            Finding(
                "slow_streaming",
                "warning",
                f"inter-token latency p50 is over {targets.itl_s:g}s at the server",
                {
                    **_latency(obs, "itl"),
                    "running_now": obs.running_now,
                    "step_tokens_mean": _round(steps.mean if steps else None, 1),
                    "kv_usage_now": _round(obs.kv_usage_now, 3),
                    "preemptions": obs.total_preemptions,
                    "spec_acceptance": _round(_acceptance(obs), 3),
                },
                [
                    "the batch size: decode step time grows with running sequences (--max-num-seqs-itl-ms)",
                    "long prefills sharing steps with decodes (--max-num-batched-tokens, disaggregation)",
                    "preemptions (memory findings) and speculation acceptance",
                ],
            )
        )
    if (
        probe is not None
        and probe.client_itl_p50 is not None
        and server_p50 is not None
        and probe.client_itl_p50 > CLIENT_GAP_FACTOR * server_p50 + CLIENT_GAP_SLACK_S
    ):
        findings.append(
            Finding(
                "slow_stream_path",
                "warning",
                "the stream is slower at the client than at the server: the network or a proxy",
                {"client_chunk_gap_p50_s": _round(probe.client_itl_p50), "server_itl_p50_s": _round(server_p50)},
                [
                    "a proxy buffering server-sent events (nginx: proxy_buffering off)",
                    "the network path and the client's own event loop",
                ],
            )
        )
    return findings


def _occupancy(obs: Observations, targets: Targets) -> list[Finding]:
    running = obs.running_mean
    if not obs.generation_tokens or running is None or not obs.max_num_seqs:
        return []
    if (obs.waiting_now or 0) > 0 or (obs.waiting_before or 0) > 0:
        return []
    if running >= LOW_OCCUPANCY * obs.max_num_seqs:
        return []
    steps = obs.histogram("iteration_tokens")
    return [
        Finding(
            "low_occupancy",
            "info",
            "the batch runs well below --max-num-seqs: throughput is limited by the offered load",
            {
                "running_mean": running,
                "max_num_seqs": obs.max_num_seqs,
                "output_tokens_per_s": round(obs.generation_tokens / obs.window_s, 1),
                "step_tokens_mean": _round(steps.mean if steps else None, 1),
            },
            [
                "more concurrent clients, or batch endpoints for offline work",
                "client-side limits (connection pools, sequential agents)",
            ],
        )
    ]


def _acceptance(obs: Observations) -> float | None:
    if not obs.spec_draft_tokens or obs.spec_accepted is None:
        return None
    return obs.spec_accepted / obs.spec_draft_tokens


def _speculation(obs: Observations, targets: Targets) -> list[Finding]:
    rate, drafted, accepted = _acceptance(obs), obs.spec_draft_tokens, obs.spec_accepted
    if rate is None or drafted is None or accepted is None or drafted < MIN_DRAFT_TOKENS or rate >= LOW_ACCEPTANCE:
        return []
    per_step = 1 + accepted / obs.spec_drafts if obs.spec_drafts else None
    return [
        Finding(
            "speculation_no_gain",
            "warning",
            "speculation rarely hits: drafted tokens are mostly rejected",
            {
                "acceptance_rate": round(rate, 3),
                "draft_tokens": drafted,
                "accepted_tokens": accepted,
                "tokens_per_verify_step": _round(per_step, 2),
                "draft_tokens_per_step": _round(drafted / obs.spec_drafts if obs.spec_drafts else None, 2),
            },
            [
                "turn --speculative off for this traffic, or --num-speculative-tokens lower",
                "ngram drafting pays on text that repeats its prompt (code edits, RAG quotes), "
                "not on sampled text at high temperature",
                "a draft model trained on the target's outputs (--speculative draft)",
                "benchmarks/spec_decode.py for the step-cost trade-off",
            ],
        )
    ]


def _prefix_cache(obs: Observations, targets: Targets) -> list[Finding]:
    rate = obs.prefix_hit_rate
    low = rate is not None and (obs.prefix_queries or 0) >= MIN_PREFIX_QUERIES and rate < LOW_HIT_RATE
    evidence = {"window_hit_rate": _round(rate, 3), "window_tokens_looked_up": obs.prefix_queries}
    probe = obs.probe
    if probe is not None:
        evidence.update(
            {
                "probe_prompt_tokens": probe.prompt_tokens,
                "probe_cached_same_key": probe.cached_same_tenant,
                "probe_cached_second_key": probe.cached_other_tenant,
                "probe_cached_chat_repeat": probe.cached_chat_repeat,
            }
        )
    if probe is not None and probe.cached_same_tenant == 0:
        return [
            Finding(
                "prefix_cache_no_gain",
                "warning",
                "a repeated prompt found nothing in the prefix cache",
                evidence,
                [
                    "--enable-prefix-caching: is it off?",
                    "eviction: a KV pool too small to keep prefixes between requests",
                    "an adapter or a cache_salt on the requests (they key the cache apart)",
                ],
            )
        ]
    if probe is not None and probe.cached_same_tenant and probe.cached_other_tenant == 0:
        return [
            Finding(
                "prefix_cache_tenant_salt",
                "warning" if low else "info",
                "tenants never share cached prefixes: each key's cache is salted apart"
                + ("; the window's hit rate is low" if low else ""),
                evidence,
                [
                    "by design cached blocks never cross tenants; keys of one organisation can "
                    "share them with the same `cache_scope` in the --api-keys file",
                    "`pagoda audit` reports a shared cache scope as a side channel",
                ],
            )
        ]
    if probe is not None and probe.cached_same_tenant and probe.cached_chat_repeat == 0:
        return [
            Finding(
                "prefix_cache_template_drift",
                "warning",
                "the same chat messages twice are not cached: the chat template's output changes",
                evidence,
                [
                    "the chat template: dates, random ids or tool lists rendered per request",
                    "POST /tokenize the same messages twice and compare",
                ],
            )
        ]
    if low:
        return [
            Finding(
                "prefix_cache_low_hits",
                "info",
                "the prefix cache hits little in this window",
                evidence,
                [
                    "`pagoda doctor --probe` to tell template drift, tenant salt and eviction apart",
                    "whether the traffic shares prefixes at all",
                ],
            )
        ]
    return []


def _adapters(obs: Observations, targets: Targets) -> list[Finding]:
    loads = obs.lora_slot_loads or 0
    finished = obs.finished or 0
    if loads < MIN_IMBALANCE_LOAD or loads < SLOT_LOADS_PER_REQUEST * max(finished, 1):
        return []
    return [
        Finding(
            "adapter_slot_thrash",
            "warning",
            "LoRA adapters are loaded into compute slots again and again",
            {"slot_loads": loads, "finished": finished, "slot_loads_per_request": round(loads / max(finished, 1), 2)},
            [
                "--max-loras: more slots than the adapters used at once",
                "the router keeping an adapter's traffic on one replica (cache_aware)",
            ],
        )
    ]


RULES: tuple[Callable[[Observations, Targets], list[Finding]], ...] = (
    _health,
    _imbalance,
    _queue,
    _slow_prefill,
    _memory,
    _refusals,
    _slow_streaming,
    _speculation,
    _prefix_cache,
    _adapters,
    _occupancy,
)


def diagnose(obs: Observations, targets: Targets = Targets()) -> list[Finding]:
    """Every rule's findings, most severe first."""
    return ranked([finding for rule in RULES for finding in rule(obs, targets)])
