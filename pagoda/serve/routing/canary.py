"""A live canary: a share of the stable model's traffic goes to a candidate model while both
stay loaded, and a controller rolls the candidate back, or promotes it, by what it sees.

Which requests: those that would go to `stable` (by its name, an alias or a route), of the
listed tenants and naming the listed routes when the canary lists any, each sent to the
candidate with probability `weight` (a seeded chooser makes the split reproducible). The
candidate's answers say so (`x-pagoda-route: canary:<candidate>`, provenance `route.canary`);
a candidate that cannot answer before its first token hands the request to stable, so clients
see no error of the candidate's.

What is compared: per-model rolling windows of the request log (5xx rate, TTFT p99, ITL p99,
guardrail block rate) and shadow replays (a sample of stable's requests run greedily on both
models and diffed with `pagoda gate`'s drift rules, serve/observability/drift.py). A broken rule rolls back at
once: every request goes to stable again (already loaded: nothing waits for a load), the event
is logged and counted in /metrics, and the candidate stays loaded for inspection. With
`promote_after_s`, a candidate that served at least `min_requests` in its window and broke no
rule for that long is promoted: stable's traffic all goes to it (stable stays loaded).
"""

from __future__ import annotations

import asyncio
import collections
import json
import logging
import random
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge

from pagoda.engine.client import generate_outputs
from pagoda.engine.engine_request import EngineRequest
from pagoda.sampling_params import SamplingParams
from pagoda.serve.model_registry import ModelRegistry, ServedModel
from pagoda.serve.models_file import CanarySpec
from pagoda.serve.observability.drift import compare_outputs, compare_tokenization
from pagoda.serve.observability.request_log import RequestLogRecord
from pagoda.stats import percentile

logger = logging.getLogger(__name__)

PREFIX = "pagoda:"
STATES = ("running", "rolled_back", "promoted")
CLIENT_CLOSED_REQUEST = 499
# Evaluation period of the controller's task (the live rules are also judged on every answer).
EVALUATE_EVERY_S = 1.0
MAX_PENDING_SHADOWS = 8  # replays waiting; a stable request sampled beyond them is not replayed
MAX_EVENTS = 50


@dataclass(frozen=True)
class Outcome:
    """What one answer of a model adds to its live window."""

    at: float
    error: bool  # a 5xx
    blocked: bool  # a guardrail refused the prompt or cut the output
    ttft_s: float | None
    itl_s: float | None

    @classmethod
    def of(cls, record: RequestLogRecord, at: float) -> Outcome:
        itl = None
        if record.ttft_s is not None and record.e2e_s is not None and record.output_tokens > 1:
            itl = max(record.e2e_s - record.ttft_s, 0.0) / (record.output_tokens - 1)
        blocked = (
            record.error_code == "content_filter"
            or "blocked_by" in record.extra
            or "content_filter" in (record.finish_reason or "").split(",")
        )
        return cls(at, record.status >= 500, blocked, record.ttft_s, itl)


@dataclass(frozen=True)
class WindowStats:
    requests: int
    error_rate: float | None
    block_rate: float | None
    ttft_p99: float | None
    itl_p99: float | None

    def as_dict(self) -> dict[str, Any]:
        return {
            "requests": self.requests,
            "error_rate": self.error_rate,
            "guardrail_block_rate": self.block_rate,
            "ttft_p99_s": self.ttft_p99,
            "itl_p99_s": self.itl_p99,
        }


class LiveWindow:
    """One model's answers of the last `window_s` seconds."""

    def __init__(self, window_s: float) -> None:
        self.window_s = window_s
        self._outcomes: collections.deque[Outcome] = collections.deque()

    def add(self, outcome: Outcome) -> None:
        self._outcomes.append(outcome)

    def stats(self, now: float) -> WindowStats:
        while self._outcomes and self._outcomes[0].at < now - self.window_s:
            self._outcomes.popleft()
        outcomes = list(self._outcomes)
        n = len(outcomes)
        return WindowStats(
            n,
            sum(o.error for o in outcomes) / n if n else None,
            sum(o.blocked for o in outcomes) / n if n else None,
            percentile([o.ttft_s for o in outcomes if o.ttft_s is not None], 99),
            percentile([o.itl_s for o in outcomes if o.itl_s is not None], 99),
        )


@dataclass(frozen=True)
class ShadowRequest:
    """A stable request to replay: its prompt (text or ids) or its chat messages."""

    endpoint: str
    prompt: str | list[int] | None = None
    messages: list[Any] | None = None


@dataclass(frozen=True)
class ShadowResult:
    at: float
    metrics: dict[str, float | None]
    evidence: list[str]


# Duck types of what serve/observability/drift.py compares: one case, two sides.
@dataclass(frozen=True)
class _Case:
    id: str
    is_chat: bool
    tags: tuple[str, ...] = ()
    expected: str | None = None


@dataclass(frozen=True)
class _Cases:
    cases: list[_Case]


@dataclass(frozen=True)
class _Label:
    label: str


@dataclass
class _Tokens:
    tokens: list[int]
    token_strs: list[str]
    status: int = 200


@dataclass
class _Greedy:
    text: str
    tokens: list[str]
    logprobs: list[float]
    finish_reason: str | None
    ok: bool = True


@dataclass
class _Side:
    target: _Label
    tokenized: dict[str, _Tokens]
    greedy: dict[str, _Greedy]
    has_tokenize: bool = True


class CanaryMetrics:
    def __init__(self, spec: CanarySpec) -> None:
        self.registry = CollectorRegistry(auto_describe=False)
        labels = {"stable": spec.stable, "candidate": spec.candidate}
        self._labels = labels
        self._state = Gauge(
            PREFIX + "canary_state",
            "1 for the canary's current state (running, rolled_back, promoted).",
            [*labels, "state"],
            registry=self.registry,
        )
        self._requests = Counter(
            PREFIX + "canary_requests",
            "Requests the canary sent to its candidate.",
            list(labels),
            registry=self.registry,
        )
        self._rollbacks = Counter(
            PREFIX + "canary_rollbacks",
            "Canary rollbacks, by the rule that broke (manual: an admin's).",
            [*labels, "rule"],
            registry=self.registry,
        )
        self._promotions = Counter(
            PREFIX + "canary_promotions",
            "Canary promotions (by: clean_period or manual).",
            [*labels, "by"],
            registry=self.registry,
        )
        self._shadows = Counter(
            PREFIX + "canary_shadow_replays",
            "Stable requests replayed to both models, by result (same, drift, failed, dropped).",
            [*labels, "result"],
            registry=self.registry,
        )

    def state(self, state: str) -> None:
        for name in STATES:
            self._state.labels(*self._labels.values(), name).set(1 if name == state else 0)

    def request(self) -> None:
        self._requests.labels(*self._labels.values()).inc()

    def rollback(self, rule: str) -> None:
        self._rollbacks.labels(*self._labels.values(), rule).inc()

    def promotion(self, by: str) -> None:
        self._promotions.labels(*self._labels.values(), by).inc()

    def shadow(self, result: str) -> None:
        self._shadows.labels(*self._labels.values(), result).inc()


@dataclass
class CanaryEvent:
    at: float  # time.time()
    action: str  # started, rolled_back, promoted
    by: str  # the rule that broke, clean_period or manual
    detail: str = ""

    def as_dict(self) -> dict[str, Any]:
        return {"at": self.at, "action": self.action, "by": self.by, "detail": self.detail}


@dataclass
class _Verdict:
    broken: list[tuple[str, str]] = field(default_factory=list)  # (rule, why)
    judged: dict[str, float | None] = field(default_factory=dict)  # rule -> the value judged


class CanaryController:
    """The canary's state, its choice per request, and the task that judges it."""

    def __init__(self, spec: CanarySpec, registry: ModelRegistry, clock: Callable[[], float] = time.monotonic) -> None:
        self.spec = spec
        self.stable = _model(registry, spec.stable)
        self.candidate = _model(registry, spec.candidate)
        self.metrics = CanaryMetrics(spec)
        self._clock = clock
        self._chooser = random.Random(spec.seed)
        self._sampler = random.Random(None if spec.seed is None else spec.seed + 1)
        self.state = "running"
        self.started = clock()
        self._windows = {name: LiveWindow(spec.window_s) for name in (self.stable.name, self.candidate.name)}
        self._shadows: collections.deque[ShadowResult] = collections.deque()
        self._pending: asyncio.Queue[ShadowRequest] | None = None
        self._task: asyncio.Task[None] | None = None
        self._replays = 0
        self.events: collections.deque[CanaryEvent] = collections.deque(maxlen=MAX_EVENTS)
        self._event("started", "config", f"weight {spec.weight}")
        self.metrics.state(self.state)

    # ---- per request ------------------------------------------------------------------------

    def chooses_candidate(self, model: ServedModel, requested: str | None, tenant: str) -> bool:
        """Whether a request that would go to `model` goes to the candidate instead."""
        if model is not self.stable or self.state == "rolled_back":
            return False
        if self.state == "promoted":
            self.metrics.request()
            return True
        if self.spec.tenants is not None and tenant not in self.spec.tenants:
            return False
        if self.spec.routes is not None and requested not in self.spec.routes:
            return False
        if self._chooser.random() >= self.spec.weight:
            return False
        self.metrics.request()
        return True

    def offer_shadow(self, request: ShadowRequest) -> None:
        """A request stable answers: replayed to both models when sampled."""
        if self.state != "running" or self.spec.shadow.sample <= 0:
            return
        if self._sampler.random() >= self.spec.shadow.sample:
            return
        self.ensure_running()
        assert self._pending is not None
        try:
            self._pending.put_nowait(request)
        except asyncio.QueueFull:
            self.metrics.shadow("dropped")

    def observe(self, record: RequestLogRecord) -> None:
        """A request log listener: every answer of stable or the candidate joins its window."""
        name = record.extra.get("base_model") or record.model
        window = self._windows.get(str(name))
        if window is None or record.status == CLIENT_CLOSED_REQUEST:
            return
        window.add(Outcome.of(record, self._clock()))
        if name == self.candidate.name and self.state == "running":
            self.evaluate()

    # ---- judging ----------------------------------------------------------------------------

    def verdict(self) -> _Verdict:
        now = self._clock()
        stable = self._windows[self.stable.name].stats(now)
        candidate = self._windows[self.candidate.name].stats(now)
        while self._shadows and self._shadows[0].at < now - self.spec.window_s:
            self._shadows.popleft()
        shadows = list(self._shadows)
        verdict = _Verdict()
        enough = candidate.requests >= self.spec.min_requests
        compared = enough and stable.requests >= self.spec.min_requests
        for rule, threshold in self.spec.rules:
            value: float | None = None
            if rule == "error_rate" and enough:
                value = (candidate.error_rate or 0.0) - (stable.error_rate or 0.0)
            elif rule == "guardrail_block_rate" and enough:
                value = (candidate.block_rate or 0.0) - (stable.block_rate or 0.0)
            elif rule in ("ttft_p99_ratio", "itl_p99_ratio") and compared:
                key = rule.removesuffix("_ratio")
                ours, theirs = getattr(candidate, key), getattr(stable, key)
                value = ours / theirs if ours is not None and theirs else None
            elif shadows:
                value = _shadow_value(rule, shadows)
            verdict.judged[rule] = value
            if value is not None and value > threshold:
                evidence = (
                    "; ".join(e for s in shadows for e in s.evidence)[:500]
                    if rule not in ("error_rate", "guardrail_block_rate", "ttft_p99_ratio", "itl_p99_ratio")
                    else ""
                )
                verdict.broken.append(
                    (rule, f"{rule} = {value:.4g} > {threshold:g}" + (f" ({evidence})" if evidence else ""))
                )
        return verdict

    def evaluate(self) -> None:
        """Roll back on a broken rule; promote after a clean period."""
        if self.state != "running":
            return
        verdict = self.verdict()
        if verdict.broken:
            rule, why = verdict.broken[0]
            self.rollback(rule, why)
            return
        period = self.spec.promote_after_s
        now = self._clock()
        if (
            period is not None
            and now - self.started >= period
            and self._windows[self.candidate.name].stats(now).requests >= self.spec.min_requests
        ):
            self.promote("clean_period", f"no rule broken for {period:g} s")

    def rollback(self, by: str, detail: str = "") -> None:
        """Every request to stable again; the candidate stays loaded."""
        self.state = "rolled_back"
        self.metrics.rollback(by)
        self.metrics.state(self.state)
        self._event("rolled_back", by, detail)

    def promote(self, by: str, detail: str = "") -> None:
        """Every request for stable to the candidate."""
        self.state = "promoted"
        self.metrics.promotion(by)
        self.metrics.state(self.state)
        self._event("promoted", by, detail)

    def _event(self, action: str, by: str, detail: str) -> None:
        event = CanaryEvent(time.time(), action, by, detail)
        self.events.append(event)
        logger.warning(
            "canary %s",
            json.dumps(
                {
                    "event": f"canary_{action}",
                    "stable": self.stable.name,
                    "candidate": self.candidate.name,
                    "by": by,
                    "detail": detail,
                }
            ),
        )

    def status(self) -> dict[str, Any]:
        now = self._clock()
        verdict = self.verdict()
        spec = self.spec
        return {
            "stable": self.stable.name,
            "candidate": self.candidate.name,
            "state": self.state,
            "weight": spec.weight,
            "tenants": sorted(spec.tenants) if spec.tenants is not None else None,
            "routes": sorted(spec.routes) if spec.routes is not None else None,
            "running_s": now - self.started,
            "window_s": spec.window_s,
            "min_requests": spec.min_requests,
            "promote_after_s": spec.promote_after_s,
            "windows": {name: window.stats(now).as_dict() for name, window in self._windows.items()},
            "shadow": {"sample": spec.shadow.sample, "replayed": self._replays, "in_window": len(self._shadows)},
            "rules": [
                {"rule": rule, "threshold": threshold, "value": verdict.judged.get(rule)}
                for rule, threshold in spec.rules
            ],
            "loaded": {model.name: model.llm.is_alive for model in (self.stable, self.candidate)},
            "events": [event.as_dict() for event in self.events],
        }

    # ---- the task ---------------------------------------------------------------------------

    def ensure_running(self) -> None:
        """Start the controller's task on the running event loop (the app has no lifespan)."""
        if self._task is None or self._task.done():
            self._pending = asyncio.Queue(MAX_PENDING_SHADOWS)
            self._task = asyncio.get_running_loop().create_task(self._run(), name="canary")

    async def _run(self) -> None:
        assert self._pending is not None
        while True:
            try:
                request = await asyncio.wait_for(self._pending.get(), EVALUATE_EVERY_S)
            except asyncio.TimeoutError:
                self.evaluate()
                continue
            if self.state != "running":
                continue
            try:
                result = await self._replay(request)
            except Exception as exc:  # a replay that cannot run is no evidence either way
                logger.info("canary shadow replay failed: %s", exc)
                self.metrics.shadow("failed")
                continue
            self._shadows.append(result)
            self.metrics.shadow("same" if not result.evidence else "drift")
            self.evaluate()

    async def _replay(self, request: ShadowRequest) -> ShadowResult:
        self._replays += 1
        case = _Case(f"shadow-{self._replays}", request.messages is not None)
        sides = [await self._side(model, request, case.id) for model in (self.stable, self.candidate)]
        cases = _Cases([case])
        metrics: dict[str, float | None] = {}
        evidence: list[str] = []
        for comparison in (compare_tokenization(cases, *sides), compare_outputs(cases, *sides)):
            metrics.update(comparison.metrics)
            evidence += [line for lines in comparison.evidence.values() for line in lines]
        return ShadowResult(self._clock(), metrics, evidence)

    async def _side(self, model: ServedModel, request: ShadowRequest, case_id: str) -> _Side:
        tokenizer = model.llm.tokenizer

        def tokenize() -> _Tokens:
            if request.messages is not None:
                from pagoda.serve.api.messages import template_messages

                ids = tokenizer.encode_chat(template_messages(request.messages, tokenizer))
            elif isinstance(request.prompt, str):
                ids = tokenizer.encode(request.prompt)
            else:
                ids = list(request.prompt or [])
            return _Tokens(ids, [tokenizer.decode_token(t) for t in ids])

        tokens = await asyncio.to_thread(tokenize)
        params = SamplingParams(temperature=0.0, max_tokens=self.spec.shadow.max_tokens, logprobs=0)
        final = None
        request_id = f"canary-shadow-{model.name}-{case_id}"
        async for output in generate_outputs(model.llm, EngineRequest(request_id, tokens.tokens, params)):
            final = output
        assert final is not None and final.outputs
        sample = final.outputs[0]
        logprobs = [
            position[token].logprob if token in position else float("nan")
            for token, position in zip(sample.token_ids, sample.logprobs or [])
        ]
        greedy = _Greedy(
            sample.text, [tokenizer.decode_token(t) for t in sample.token_ids], logprobs, sample.finish_reason
        )
        return _Side(_Label(model.name), {case_id: tokens}, {case_id: greedy})


def _model(registry: ModelRegistry, name: str) -> ServedModel:
    model = registry.model(name)
    if model is None:
        raise ValueError(f"the canary names {name!r}, which is not served here")
    return model


def _shadow_value(rule: str, shadows: list[ShadowResult]) -> float | None:
    """A shadow rule's value over the window's replays."""

    def values(metric: str) -> list[float]:
        return [v for s in shadows if (v := s.metrics.get(metric)) is not None]

    if rule == "tokenization_mismatches":
        return sum(values("tokenization.prompt_mismatches") + values("tokenization.chat_mismatches"))
    if rule == "output_mismatch_rate":
        rates = values("outputs.exact_match_rate")
        return 1 - sum(rates) / len(rates) if rates else None
    if rule in ("stop_reason_changes", "refusal_changes"):
        return sum(values(f"outputs.{rule}"))
    if rule == "logprob_drift_max":
        drifts = values("outputs.logprob_drift_max")
        return max(drifts) if drifts else None
    return None
