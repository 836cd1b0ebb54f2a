"""The drift rules between two servings of the same prompts: tokenization (prompt and chat
template) and greedy output (exact match, first divergence, logprob drift, stop reasons,
refusals). `pagoda gate` applies them to a suite replayed against two servers (ops/gate.py);
the live canary (serve/routing/canary.py) to stable requests replayed to the candidate.

A side is anything with `tokenized` and `greedy` by case id (gate.py's `SideResult`), a case
anything with `id`, `is_chat`, `tags` and `expected` (ops/suite.py's `SuiteCase`).
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass, field
from typing import Any

MAX_EVIDENCE = 8  # lines of evidence kept per metric; counts are always complete
# Phrases of the usual refusal / guardrail answers (English; the decision change is what counts).
REFUSAL = re.compile(
    r"\b(I can(?:'|no)t|I cannot|I'm sorry|I am sorry|I won't|as an AI|"
    r"I'm not able to|I am unable)\b",
    re.IGNORECASE,
)


@dataclass
class Comparison:
    metrics: dict[str, float | None] = field(default_factory=dict)
    evidence: dict[str, list[str]] = field(default_factory=dict)
    notes: list[str] = field(default_factory=list)
    details: dict[str, Any] = field(default_factory=dict)

    def add(self, metric: str, value: float | None, evidence: list[str] | None = None) -> None:
        self.metrics[metric] = value
        if evidence:
            kept = evidence[:MAX_EVIDENCE]
            if len(evidence) > MAX_EVIDENCE:
                kept.append(f"... and {len(evidence) - MAX_EVIDENCE} more")
            self.evidence[metric] = kept


def _token_label(tokenized: Any, index: int) -> str:
    if index >= len(tokenized.tokens):
        return "<end>"
    token_id = tokenized.tokens[index]
    if tokenized.token_strs is not None and index < len(tokenized.token_strs):
        return f"{tokenized.token_strs[index]!r} (id {token_id})"
    return f"id {token_id}"


def first_difference(a: list[Any], b: list[Any]) -> int | None:
    for i, (x, y) in enumerate(zip(a, b)):
        if x != y:
            return i
    return None if len(a) == len(b) else min(len(a), len(b))


def compare_tokenization(suite: Any, base: Any, cand: Any) -> Comparison:
    result = Comparison()
    for side in (base, cand):
        if not side.has_tokenize:
            result.notes.append(
                f"{side.target.label} has no /tokenize: tokenization and chat-template comparison skipped"
            )
    if not (base.has_tokenize and cand.has_tokenize):
        result.add("tokenization.prompt_mismatches", None)
        result.add("tokenization.chat_mismatches", None)
        return result
    mismatches: dict[bool, list[str]] = {False: [], True: []}
    compared = 0
    for case in suite.cases:
        b, c = base.tokenized[case.id], cand.tokenized[case.id]
        if b.status != 200 or c.status != 200:
            if b.status != c.status and 0 not in (b.status, c.status):
                mismatches[case.is_chat].append(f"{case.id}: /tokenize answered {b.status} vs {c.status}")
            continue
        compared += 1
        index = first_difference(b.tokens, c.tokens)
        if index is not None:
            mismatches[case.is_chat].append(
                f"{case.id}: {len(b.tokens)} vs {len(c.tokens)} tokens, first difference at "
                f"position {index}: baseline {_token_label(b, index)} vs candidate "
                f"{_token_label(c, index)}"
            )
    result.add("tokenization.prompt_mismatches", len(mismatches[False]), mismatches[False])
    result.add("tokenization.chat_mismatches", len(mismatches[True]), mismatches[True])
    result.details["compared"] = compared
    return result


def is_refusal(completion: Any) -> bool:
    return completion.finish_reason == "content_filter" or bool(REFUSAL.search(completion.text))


def compare_outputs(suite: Any, base: Any, cand: Any) -> Comparison:
    result = Comparison()
    diverged, stop_changes, refusal_changes, drifts = [], [], [], []
    expected_hits = {"baseline": 0, "candidate": 0}
    num_expected = compared = 0
    per_case = []
    for case in suite.cases:
        b, c = base.greedy[case.id], cand.greedy[case.id]
        if not (b.ok and c.ok):
            continue  # HTTP failures are contract failures, listed there
        compared += 1
        row: dict[str, Any] = {"id": case.id, "tags": case.tags, "exact": b.text == c.text}
        if b.tokens is not None and c.tokens is not None:
            index = first_difference(b.tokens, c.tokens)
            shared = len(b.tokens) if index is None else index
            pairs = [
                (x, y)
                for x, y in zip((b.logprobs or [])[:shared], (c.logprobs or [])[:shared])
                if not (math.isnan(x) or math.isnan(y))
            ]
            deltas = [abs(x - y) for x, y in pairs]
            drifts += deltas
            row["max_drift"] = max(deltas) if deltas else 0.0
            where = (
                f"token {index}: baseline {b.tokens[index] if index < len(b.tokens) else '<end>'!r}"
                f" vs candidate {c.tokens[index] if index < len(c.tokens) else '<end>'!r}"
                if index is not None
                else ""
            )
        else:
            index = first_difference(list(b.text), list(c.text))
            where = f"character {index}" if index is not None else ""
        row["first_divergence"] = index
        if b.text != c.text:
            diverged.append(
                f"{case.id}: diverges at {where or 'the text'} (baseline {b.text[:60]!r}, candidate {c.text[:60]!r})"
            )
        if b.finish_reason != c.finish_reason:
            stop_changes.append(f"{case.id}: finish_reason {b.finish_reason!r} -> {c.finish_reason!r}")
        if is_refusal(b) != is_refusal(c):
            refusal_changes.append(f"{case.id}: refusal {is_refusal(b)} -> {is_refusal(c)} ({c.text[:60]!r})")
        if case.expected is not None:
            num_expected += 1
            expected_hits["baseline"] += b.text == case.expected
            expected_hits["candidate"] += c.text == case.expected
        per_case.append(row)
    result.add("outputs.exact_match_rate", (compared - len(diverged)) / compared if compared else None, diverged)
    result.add("outputs.logprob_drift_mean", sum(drifts) / len(drifts) if drifts else None)
    result.add("outputs.logprob_drift_max", max(drifts) if drifts else None)
    result.add("outputs.stop_reason_changes", len(stop_changes) if compared else None, stop_changes)
    result.add("outputs.refusal_changes", len(refusal_changes) if compared else None, refusal_changes)
    for side in ("baseline", "candidate"):
        result.add(f"outputs.expected_match_rate_{side}", expected_hits[side] / num_expected if num_expected else None)
    if not drifts and compared:
        result.notes.append("no logprobs from at least one side: logprob drift not measured")
    result.details.update(compared=compared, cases=per_case)
    return result
