"""`pagoda gate`: replay a suite against a baseline and a candidate server and compare.

Collection (`collect_side`) talks to one server; comparison functions turn the two sides'
results into metrics (numbers the policy judges) and evidence (lines a person reads).
"""

from __future__ import annotations

import re
import time
from dataclasses import dataclass, field
from typing import Any

import httpx
from tqdm import tqdm

from pagoda.ops import contract, latency
from pagoda.ops.calls import Completion, Tokenized, complete, provenance, tokenize
from pagoda.ops.policy import Rule, RuleResult, evaluate
from pagoda.ops.schema_check import validate_text
from pagoda.ops.suite import Suite, SuiteCase
from pagoda.ops.target import Target, resolve_model
from pagoda.serve.observability.drift import Comparison, compare_outputs, compare_tokenization


@dataclass
class SideResult:
    target: Target
    tokenized: dict[str, Tokenized] = field(default_factory=dict)
    greedy: dict[str, Completion] = field(default_factory=dict)
    structured: dict[str, Completion] = field(default_factory=dict)
    contract_failures: list[str] = field(default_factory=list)
    bad_statuses: dict[str, int] = field(default_factory=dict)
    no_tokenize: bool = False  # the server answered 404/405/501 to /tokenize
    # What served its answers (pagoda's provenance record of one of them); None: not reported.
    provenance: dict[str, Any] | None = None

    @property
    def has_tokenize(self) -> bool:
        return not self.no_tokenize and any(t.status == 200 for t in self.tokenized.values())


def structured_request(case: SuiteCase) -> dict[str, Any]:
    return {
        "response_format": {
            "type": "json_schema",
            "json_schema": {"name": re.sub(r"\W", "_", case.id), "schema": case.schema, "strict": True},
        }
    }


def collect_side(client: httpx.Client, target: Target, suite: Suite, *, progress: bool = True) -> SideResult:
    resolve_model(client, target)
    side = SideResult(target)
    steps = len(suite.cases) * 2 + sum(c.schema is not None for c in suite.cases) + 2
    with tqdm(total=steps, desc=f"gate {target.label}", unit="req", leave=False, disable=not progress) as bar:
        for case in suite.cases:
            if isinstance(case.prompt, list):
                side.tokenized[case.id] = Tokenized(0, error="token-id prompt")
            elif side.no_tokenize:  # the server said there is no /tokenize; do not ask again
                side.tokenized[case.id] = Tokenized(404, error="no /tokenize")
            else:
                side.tokenized[case.id] = tokenize(client, target, case)
                side.no_tokenize = not side.tokenized[case.id].supported
            bar.update(1)
            side.greedy[case.id] = complete(client, target, case)
            bar.update(1)
            if case.schema is not None:
                side.structured[case.id] = complete(client, target, case, structured_request(case), logprobs=False)
                bar.update(1)
        served = next((c.provenance_id for c in side.greedy.values() if c.provenance_id), None)
        if served is not None:
            side.provenance = provenance(client, target, served)
        for case in suite.cases:
            tokenized = side.tokenized[case.id]
            side.contract_failures += contract.usage_failures(
                case, side.greedy[case.id], tokenized if tokenized.status == 200 else None
            )
        streamed = [next((c for c in suite.cases if c.is_chat is chat), None) for chat in (False, True)]
        for stream_case in streamed:
            if stream_case is not None:
                side.contract_failures += contract.stream_failures(
                    client, target, stream_case, side.greedy[stream_case.id]
                )
            bar.update(1)
        side.bad_statuses = contract.bad_request_statuses(client, target, suite.bad_requests)
        side.contract_failures += contract.bad_request_failures(suite.bad_requests, side.bad_statuses)
    return side


def _validity(side: SideResult, suite: Suite) -> tuple[float | None, list[str]]:
    cases = [c for c in suite.cases if c.schema is not None]
    answers = [side.structured[c.id] for c in cases]
    if answers and all(a.status == 400 for a in answers):
        return None, [f"{side.target.label} rejects response_format json_schema ({answers[0].error})"]
    problems = []
    valid = 0
    for case, answer in zip(cases, answers):
        problem = (
            f"HTTP {answer.status}: {answer.error}" if not answer.ok else validate_text(answer.text, case.schema or {})
        )
        if problem is None:
            valid += 1
        else:
            problems.append(f"{side.target.label} {case.id}: {problem}")
    return valid / len(cases), problems


def compare_structured(suite: Suite, base: SideResult, cand: SideResult) -> Comparison:
    result = Comparison()
    if not any(c.schema is not None for c in suite.cases):
        result.notes.append("the suite has no schemas: structured output not compared")
        result.add("structured.validity_drop", None)
        return result
    base_rate, base_problems = _validity(base, suite)
    cand_rate, cand_problems = _validity(cand, suite)
    result.add("structured.validity_rate_baseline", base_rate, base_problems)
    result.add("structured.validity_rate_candidate", cand_rate, cand_problems)
    if base_rate is None and cand_rate is None:
        result.notes.append("neither side supports response_format json_schema: structured output skipped")
        result.add("structured.validity_drop", None)
    else:
        result.add("structured.validity_drop", (base_rate or 0.0) - (cand_rate or 0.0), cand_problems or base_problems)
    return result


def compare_contract(suite: Suite, base: SideResult, cand: SideResult) -> Comparison:
    result = Comparison()
    # A failure both sides share (a case over both models' context, say) is the suite's
    # problem, not a regression; `new_failures` is what the candidate breaks.
    known = set(base.contract_failures)
    new = [f for f in cand.contract_failures if f not in known]
    result.add("contract.new_failures", len(new), new)
    result.add("contract.candidate_failures", len(cand.contract_failures), cand.contract_failures)
    result.add("contract.baseline_failures", len(base.contract_failures), base.contract_failures)
    diffs = [
        f"{case.id}: baseline {base.bad_statuses[case.id]}, candidate {cand.bad_statuses[case.id]}"
        for case in suite.bad_requests
        if base.bad_statuses[case.id] != cand.bad_statuses[case.id]
    ]
    result.add("contract.status_diffs", len(diffs), diffs)
    result.details["candidate_failures"] = cand.contract_failures
    result.details["baseline_failures"] = base.contract_failures
    result.details["bad_requests"] = {
        case.id: {
            "expected": case.expect_status,
            "baseline": base.bad_statuses[case.id],
            "candidate": cand.bad_statuses[case.id],
        }
        for case in suite.bad_requests
    }
    return result


def _latency_value(metric: str, value: float | None) -> str:
    if value is None:
        return "–"
    return f"{value:.1f} tok/s" if metric == "throughput" else f"{value * 1000:.1f} ms"


def compare_latency(summary: dict[str, Any] | None) -> Comparison:
    result = Comparison()
    if summary is None:
        result.notes.append("latency profile skipped")
        return result
    for metric in latency.METRICS:
        ratio = summary["ratios"][metric]
        sides = summary["sides"]
        result.add(
            f"latency.{metric}_ratio",
            ratio,
            [
                f"baseline {_latency_value(metric, sides['baseline'][metric])}, candidate "
                f"{_latency_value(metric, sides['candidate'][metric])} (medians of "
                f"{len(sides['baseline']['repeats'])} runs each), noise band "
                f"±{summary['noise'][metric]:.3f}"
            ],
        )
    failed = summary["sides"]["candidate"]["failed_requests"]
    if failed:
        result.notes.append(f"{failed} candidate requests failed under load")
    result.details = summary
    return result


@dataclass
class GateResult:
    baseline: Target
    candidate: Target
    suite: Suite
    sections: dict[str, Comparison]
    rules: list[RuleResult]
    duration_s: float
    # Each side's provenance record ("baseline", "candidate"), None for a server without one.
    provenance: dict[str, dict[str, Any] | None] = field(default_factory=dict)

    @property
    def passed(self) -> bool:
        return all(r.status != "fail" for r in self.rules)

    def to_json(self) -> dict[str, Any]:
        return {
            "kind": "pagoda-gate-report",
            "version": 1,
            "passed": self.passed,
            "baseline": self.baseline.describe(),
            "candidate": self.candidate.describe(),
            "suite": {
                "name": self.suite.name,
                "cases": len(self.suite.cases),
                "bad_requests": len(self.suite.bad_requests),
            },
            "duration_s": round(self.duration_s, 2),
            "rules": [r.to_json() for r in self.rules],
            "provenance": self.provenance,
            "sections": {
                name: {"metrics": s.metrics, "evidence": s.evidence, "notes": s.notes, "details": s.details}
                for name, s in self.sections.items()
            },
        }


def run_gate(
    baseline: Target,
    candidate: Target,
    suite: Suite,
    rules: list[Rule],
    *,
    profile: latency.LoadProfile | None = None,
    progress: bool = True,
    timeout: float = 120.0,
) -> GateResult:
    start = time.monotonic()
    with httpx.Client(timeout=timeout, trust_env=False) as client:
        base = collect_side(client, baseline, suite, progress=progress)
        cand = collect_side(client, candidate, suite, progress=progress)
    summary = None
    if profile is not None:
        summary = latency.summarize(latency.measure(baseline, candidate, suite, profile, progress=progress))
    sections = {
        "tokenization": compare_tokenization(suite, base, cand),
        "outputs": compare_outputs(suite, base, cand),
        "structured": compare_structured(suite, base, cand),
        "contract": compare_contract(suite, base, cand),
        "latency": compare_latency(summary),
    }
    metrics = {k: v for s in sections.values() for k, v in s.metrics.items()}
    evidence = {k: v for s in sections.values() for k, v in s.evidence.items()}
    noise = {f"latency.{m}_ratio": summary["noise"][m] for m in latency.METRICS} if summary else {}
    results = evaluate(rules, metrics, evidence, noise)
    return GateResult(
        baseline,
        candidate,
        suite,
        sections,
        results,
        time.monotonic() - start,
        provenance={"baseline": base.provenance, "candidate": cand.provenance},
    )
