"""Side-channel probes of `pagoda audit`. Tenant A is the victim's seat, B the observer's.

Each probe sends a bounded number of requests and returns a `Finding`: how well B can tell
two conditions of A's traffic apart, as an AUC (0.5: not at all, 1.0: always) with a bootstrap
confidence interval, plus the evidence behind it.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from pagoda.http_client.sse import aiter_sse_events
from pagoda.ops.stats import auc, bootstrap_auc_interval
from pagoda.ops.target import Target
from pagoda.stats import median, sorted_percentile

WORDS = (
    "alpha beta gamma delta river stone cloud maple orbit piano violet ember signal "
    "harbor quartz lantern meadow copper falcon glacier tunnel pepper saffron canyon "
    "willow marble comet thunder velvet cedar prism atlas beacon cobalt dune fjord "
    "garnet hollow ivory jasper kernel lagoon mosaic nectar onyx pylon quiver raven "
    "sable tundra umber vortex walnut yonder zephyr basalt cipher dynamo fable"
).split()


class BudgetExceeded(RuntimeError):
    pass


@dataclass
class Observation:
    """One streamed completion as B (or A) saw it."""

    status: int
    ttft: float | None = None
    itls: list[float] = field(default_factory=list)
    prompt_tokens: int | None = None
    completion_tokens: int | None = None
    cached_tokens: int | None = None
    chunk_texts: list[str] = field(default_factory=list)
    chunk_bytes: list[int] = field(default_factory=list)
    chunk_tokens: list[int] = field(default_factory=list)  # tokens per chunk, from logprobs
    error: str | None = None

    @property
    def ok(self) -> bool:
        return self.status == 200 and self.error is None


@dataclass
class Finding:
    probe: str
    title: str
    severity: str  # high | medium | low | none
    summary: str
    evidence: list[str]
    mitigation: str
    statistics: dict[str, Any] = field(default_factory=dict)
    rerun: dict[str, Any] | None = None

    @property
    def status(self) -> str:
        return "cleared" if self.severity == "none" else "finding"

    def to_json(self) -> dict[str, Any]:
        return {
            "probe": self.probe,
            "title": self.title,
            "severity": self.severity,
            "status": self.status,
            "summary": self.summary,
            "evidence": self.evidence,
            "mitigation": self.mitigation,
            "statistics": self.statistics,
            "rerun": self.rerun,
        }


class Session:
    """The audit's HTTP client, both tenants' keys, and the request budget."""

    def __init__(
        self, client: httpx.AsyncClient, target: Target, key_a: str | None, key_b: str | None, budget: int, seed: int
    ) -> None:
        self.client = client
        self.target = target
        self.keys = {"a": key_a, "b": key_b}
        self.budget = budget
        self.sent = 0
        self.rng = random.Random(seed)

    def random_prompt(self, num_words: int) -> str:
        return " ".join(self.rng.choice(WORDS) for _ in range(num_words))

    async def observe(
        self,
        tenant: str,
        prompt: str,
        max_tokens: int,
        *,
        logprobs: bool = False,
        on_first_token: Callable[[], None] | None = None,
    ) -> Observation:
        if self.sent >= self.budget:
            raise BudgetExceeded(f"the audit's budget of {self.budget} requests is spent")
        self.sent += 1
        body: dict[str, Any] = {
            "model": self.target.model,
            "prompt": prompt,
            "max_tokens": max_tokens,
            "temperature": 0.0,
            "stream": True,
            "stream_options": {"include_usage": True},
            "ignore_eos": True,
        }
        if logprobs:
            body["logprobs"] = 1
        sent = time.perf_counter()
        last = None
        try:
            async with self.client.stream(
                "POST", self.target.url("/v1/completions"), json=body, headers=self.target.headers(self.keys[tenant])
            ) as resp:
                result = Observation(resp.status_code)
                if resp.status_code != 200:
                    result.error = (await resp.aread()).decode(errors="replace")[:200]
                    return result
                async for event in aiter_sse_events(resp.aiter_lines()):
                    if event.done:
                        continue
                    chunk = event.json()
                    usage = chunk.get("usage")
                    if usage:
                        result.prompt_tokens = usage.get("prompt_tokens")
                        result.completion_tokens = usage.get("completion_tokens")
                        details = usage.get("prompt_tokens_details") or {}
                        result.cached_tokens = details.get("cached_tokens")
                    for choice in chunk.get("choices") or []:
                        now = time.perf_counter()
                        if last is None:
                            result.ttft = now - sent
                            if on_first_token is not None:
                                on_first_token()
                        else:
                            result.itls.append(now - last)
                        last = now
                        text = choice.get("text") or ""
                        result.chunk_texts.append(text)
                        result.chunk_bytes.append(len(event.line.encode()))
                        tokens = (choice.get("logprobs") or {}).get("tokens")
                        if tokens is not None:
                            result.chunk_tokens.append(len(tokens))
                return result
        except (httpx.HTTPError, json.JSONDecodeError) as exc:
            return Observation(0, error=f"{type(exc).__name__}: {exc}"[:200])


def distinguisher(positives: list[float], negatives: list[float], seed: int) -> dict[str, Any]:
    value = auc(positives, negatives)
    interval = bootstrap_auc_interval(positives, negatives, seed=seed)
    return {"auc": value, "ci95": list(interval) if interval else None, "n": [len(positives), len(negatives)]}


def severity_of(stat: dict[str, Any]) -> str:
    """high / medium / low when the AUC's whole interval clears 0.75 / 0.6 / 0.5."""
    if stat["auc"] is None or stat["ci95"] is None:
        return "none"
    low = min(stat["ci95"][0], stat["auc"])
    return "high" if low > 0.75 else "medium" if low > 0.6 else "low" if low > 0.5 else "none"


def _ms(values: list[float]) -> str:
    if not values:
        return "–"
    ordered = sorted(values)
    return f"{sorted_percentile(ordered, 50) * 1000:.1f} ms (p90 {sorted_percentile(ordered, 90) * 1000:.1f})"


def _auc_text(stat: dict[str, Any]) -> str:
    if stat["auc"] is None:
        return "AUC –"
    low, high = stat["ci95"]
    text = f"AUC {stat['auc']:.2f} [95% CI {low:.2f}-{high:.2f}]"
    if low <= 0.5 and stat["auc"] >= 0.65:
        text += " (inconclusive: the interval includes 0.5; more --trials would decide)"
    return text


# ---- cross-tenant prefix cache ------------------------------------------------------------


async def cache_probe(session: Session, trials: int, prompt_words: int, seed: int) -> Finding:
    """A sends a secret prompt; B then sends that prompt's prefix + its own tail ("hit") or a
    fresh prompt of the same length ("miss"). B tells them apart by cached_tokens or TTFT."""
    hits: list[Observation] = []
    misses: list[Observation] = []
    for trial in range(trials):
        secret = session.random_prompt(prompt_words)
        await session.observe("a", secret, 1)
        tail = session.random_prompt(8)
        probes = [("hit", f"{secret} {tail}"), ("miss", f"{session.random_prompt(prompt_words)} {tail}")]
        if trial % 2:
            probes.reverse()
        for kind, prompt in probes:
            observation = await session.observe("b", prompt, 1)
            if observation.ok:
                (hits if kind == "hit" else misses).append(observation)
    ttft = distinguisher(
        [-o.ttft for o in hits if o.ttft is not None], [-o.ttft for o in misses if o.ttft is not None], seed
    )
    reports_cache = any(o.cached_tokens is not None for o in hits + misses)
    cached = (
        distinguisher([float(o.cached_tokens or 0) for o in hits], [float(o.cached_tokens or 0) for o in misses], seed)
        if reports_cache
        else {"auc": None, "ci95": None, "n": [len(hits), len(misses)]}
    )
    # The server's own cached_tokens accounting is ground truth about reuse when it reports
    # it; the TTFT distinguisher is what an attacker uses when it does not.
    decisive = cached if reports_cache else ttft
    hit_cached = [o.cached_tokens or 0 for o in hits]
    prompt_tokens = median([float(o.prompt_tokens or 0) for o in hits]) or 0
    evidence = [
        f"{len(hits)} hit / {len(misses)} miss trials of ~{prompt_tokens:.0f}-token prompts "
        f"({prompt_words} words of A's secret + 8 of B's)",
        f"B's cached_tokens on hit probes: median {median([float(c) for c in hit_cached]) or 0:.0f}"
        f", max {max(hit_cached, default=0)}; on miss probes: max "
        f"{max((o.cached_tokens or 0 for o in misses), default=0)}"
        + ("" if reports_cache else " (the server reports no cached_tokens)"),
        f"B's TTFT on hits {_ms([o.ttft for o in hits if o.ttft])}, on misses "
        f"{_ms([o.ttft for o in misses if o.ttft])}; TTFT distinguisher {_auc_text(ttft)}",
    ]
    if reports_cache:
        evidence.append(f"cached_tokens distinguisher {_auc_text(cached)}")
    severity = severity_of(decisive)
    basis = "cached_tokens" if reports_cache else "TTFT"
    return Finding(
        "cache",
        "cross-tenant prefix-cache reuse",
        severity,
        f"B detects A's prompts by {basis}: {_auc_text(decisive)}"
        if severity != "none"
        else f"no cross-tenant reuse ({basis}): {_auc_text(decisive)}",
        evidence,
        "per-tenant prefix-cache salt (the default with --api-keys: every tenant gets its own "
        "salt; do not give tenants a shared cache_scope, and do not run an open server for "
        "several parties)",
        {"auc": decisive["auc"], "ci95": decisive["ci95"], "basis": basis, "ttft": ttft, "cached_tokens": cached},
    )


# ---- interference: prompt length and queueing ----------------------------------------------


async def _with_interference(
    session: Session, a_traffic: Callable[[], Awaitable[Any]], b_prompt: str, b_tokens: int
) -> Observation:
    """B streams; as soon as B's first token arrives, A's traffic starts. Returns B's view."""
    started = asyncio.Event()
    b_task = asyncio.create_task(session.observe("b", b_prompt, b_tokens, on_first_token=started.set))

    async def a_side() -> None:
        await started.wait()
        await a_traffic()

    a_task = asyncio.create_task(a_side())
    observation = await b_task
    started.set()  # B failed before its first token: let A's side finish
    await a_task
    return observation


async def length_probe(session: Session, trials: int, long_words: int, seed: int) -> Finding:
    """Does B's inter-token latency reveal the length of A's concurrent prompt?"""
    conditions = ["long", "short"] * (trials // 2)
    session.rng.shuffle(conditions)
    worst_itl: dict[str, list[float]] = {"long": [], "short": []}
    for condition in conditions:
        words = long_words if condition == "long" else 4
        prompt = session.random_prompt(words)

        async def a_traffic(prompt: str = prompt) -> None:
            await session.observe("a", prompt, 1)

        observation = await _with_interference(session, a_traffic, session.random_prompt(6), 12)
        if observation.ok and observation.itls:
            worst_itl[condition].append(max(observation.itls))
    stat = distinguisher(worst_itl["long"], worst_itl["short"], seed)
    severity = severity_of(stat)
    return Finding(
        "length",
        "prompt-length leakage through the other tenant's latency",
        severity,
        (
            f"B's worst inter-token gap tells A's long prompts ({long_words} words) from short ones: {_auc_text(stat)}"
            if severity != "none"
            else f"no measurable length leak: {_auc_text(stat)}"
        ),
        [
            f"B's max ITL while A sends a long prompt {_ms(worst_itl['long'])}, a short one {_ms(worst_itl['short'])}",
            f"{len(conditions)} trials",
        ],
        "chunked prefill with a small --max-num-batched-tokens bounds how much of A's prompt "
        "runs in one step (the ITL spike B sees); per-tenant max_prompt_tokens caps the "
        "signal's range. The channel remains while tenants share batches.",
        {"auc": stat["auc"], "ci95": stat["ci95"], "itl": stat},
    )


async def queue_probe(session: Session, trials: int, burst: int, seed: int) -> Finding:
    """Can B tell when A's burst of (priority) traffic arrives, from B's own TTFT?"""
    conditions = ["busy", "idle"] * (trials // 2)
    session.rng.shuffle(conditions)
    ttfts: dict[str, list[float]] = {"busy": [], "idle": []}
    for condition in conditions:
        a_tasks: list[asyncio.Task] = []
        if condition == "busy":
            a_tasks = [asyncio.create_task(session.observe("a", session.random_prompt(48), 16)) for _ in range(burst)]
            await asyncio.sleep(0.02)  # A's requests reach the server first
        observation = await session.observe("b", session.random_prompt(6), 2)
        await asyncio.gather(*a_tasks)
        if observation.ok and observation.ttft is not None:
            ttfts[condition].append(observation.ttft)
    stat = distinguisher(ttfts["busy"], ttfts["idle"], seed)
    severity = severity_of(stat)
    return Finding(
        "queue",
        "queue / priority leakage",
        severity,
        (
            f"B's TTFT reveals when A's burst of {burst} requests arrives: {_auc_text(stat)}"
            if severity != "none"
            else f"no measurable queueing leak: {_auc_text(stat)}"
        ),
        [
            f"B's TTFT during A's bursts {_ms(ttfts['busy'])}, when A is idle {_ms(ttfts['idle'])}",
            f"{len(conditions)} windows",
        ],
        "admission limits per tenant (max_concurrent_requests, tokens_per_minute) bound how "
        "much one tenant's burst can delay the others; with --scheduling-policy priority a "
        "higher-priority tenant's arrivals are visible to lower ones by design.",
        {"auc": stat["auc"], "ci95": stat["ci95"], "ttft": stat},
    )


# ---- streaming response size ------------------------------------------------------------


def _correlation(xs: list[float], ys: list[float]) -> float | None:
    if len(xs) < 3:
        return None
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    syy = sum((y - my) ** 2 for y in ys)
    if not sxx or not syy:
        return None
    return sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / (sxx * syy) ** 0.5


async def stream_probe(session: Session, max_tokens: int = 48) -> Finding:
    """Do streamed chunk sizes follow token lengths (the token-length side channel)?"""
    observation = await session.observe("b", session.random_prompt(12), max_tokens, logprobs=True)
    plain = await session.observe("b", session.random_prompt(12), max_tokens)
    content = [(t, b) for t, b in zip(plain.chunk_texts, plain.chunk_bytes)]
    tokens = plain.completion_tokens or 0
    per_chunk = tokens / len(content) if content else None
    one_token_chunks = (
        (sum(1 for n in observation.chunk_tokens if n == 1) / len(observation.chunk_tokens))
        if observation.chunk_tokens
        else None
    )
    corr = _correlation([len(t.encode()) for t, _ in content], [float(b) for _, b in content])
    # Byte-level tokens that end mid-character ride along with the next chunk, so a per-token
    # stream has slightly more tokens than chunks; the logprobs count is the exact measure.
    # A server that coalesces tokens only when its client lags still leaks most lengths.
    leaks = one_token_chunks >= 0.5 if one_token_chunks is not None else per_chunk is not None and per_chunk <= 1.25
    severity = "medium" if leaks else "none"
    evidence = [
        f"{tokens} tokens in {len(content)} content chunks ({per_chunk:.2f} tokens per chunk)"
        if per_chunk
        else "no chunks received"
    ]
    if one_token_chunks is not None:
        evidence.append(f"{one_token_chunks:.0%} of chunks carry exactly one token (logprobs)")
    if corr is not None:
        evidence.append(f"correlation of chunk size on the wire with its text's length: {corr:.2f}")
    return Finding(
        "stream",
        "response-size leakage in streaming",
        severity,
        "every streamed chunk is one token, so encrypted record sizes reveal token lengths"
        if leaks
        else "chunks batch several tokens",
        evidence,
        "not available in pagoda yet: chunks are sent per token. Batch tokens per chunk "
        "(vLLM's --stream-interval) or pad chunks to fixed sizes at a proxy; non-streamed "
        "responses do not leak per-token sizes.",
        {"tokens_per_chunk": per_chunk, "one_token_chunk_fraction": one_token_chunks, "size_correlation": corr},
    )
