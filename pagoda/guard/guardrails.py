"""Checking text against the rules: `InputGuard` before prefill, `OutputFilter` on the text
deltas of one generated sample.

Streaming output is held back so that what reaches the client has been checked:
- pattern rules: text from the start of a match that the next characters could still
  complete or extend (a partial match at the end, e.g. the current word for the email
  detector) stays pending, at most the last `output_hold_chars` characters: a match longer
  than that is caught only from the release point on. Ordinary text passes at once.
- classifier rules: text is released only after the window it belongs to was labelled
  (`classifier_window_chars` per window, the previous window as context), so at most one
  window is pending; the rest of the text is labelled when the sample ends.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass, field

from pagoda.guard.classifier import GuardModelError
from pagoda.guard.config import GuardrailsConfig
from pagoda.guard.decision import Decision, RuleHit
from pagoda.guard.pii import Span
from pagoda.guard.rules import ClassifierRule, PatternRule, Rule

logger = logging.getLogger(__name__)

ROLE_OF_STAGE = {"input": "User", "output": "Agent"}


def _scan(rules: list[PatternRule], text: str) -> list[tuple[PatternRule, Span]]:
    found = [(rule, span) for rule in rules for span in rule.find(text)]
    return sorted(found, key=lambda pair: (pair[1].start, -pair[1].end))


def _apply(text: str, found: list[tuple[PatternRule, Span]], stage: str) -> Decision:
    """Block, redact and flag the matches found in `text` (spans relative to it)."""
    counts: dict[PatternRule, dict[str, int]] = {}
    for rule, span in found:
        labels = counts.setdefault(rule, {})
        labels[span.label] = labels.get(span.label, 0) + 1
    hits = [
        RuleHit(rule.name, rule.kind, rule.action, stage, count, label if rule.kind == "pii" else None)
        for rule, labels in counts.items()
        for label, count in labels.items()
    ]
    blocking = [rule for rule, _ in found if rule.action == "block"]
    if blocking:
        return Decision("", hits, blocked_by=blocking[0].name)
    pieces, position = [], 0
    for rule, span in found:
        if rule.action != "redact" or span.start < position:  # overlapping: already covered
            continue
        pieces.append(text[position : span.start])
        pieces.append(rule.replacement_for(span))
        position = span.end
    pieces.append(text[position:])
    return Decision("".join(pieces), hits)


@dataclass
class _RuleSet:
    patterns: list[PatternRule]
    classifiers: list[ClassifierRule]

    def __bool__(self) -> bool:
        return bool(self.patterns or self.classifiers)


async def _classify(rules: list[ClassifierRule], text: str, stage: str, fail_mode: str, context: str = "") -> Decision:
    """Every classifier rule's verdict on `context + text`; failures follow `fail_mode`."""
    decision = Decision(text)
    for rule in rules:
        assert rule.model is not None  # set by the config parser
        try:
            verdict = await rule.model.classify_async(context + text, ROLE_OF_STAGE[stage])
        except GuardModelError as exc:
            logger.warning(
                "guardrail rule %r could not run (%s); failing %s: the %s is %s",
                rule.name,
                exc,
                fail_mode,
                stage,
                "blocked" if fail_mode == "closed" else "allowed",
            )
            action = "block" if fail_mode == "closed" else "fail_open"
            decision.merge(
                Decision(
                    text,
                    [RuleHit(rule.name, rule.kind, action, stage, label="guard_error")],
                    blocked_by=rule.name if fail_mode == "closed" else None,
                )
            )
            continue
        if verdict.unsafe:
            decision.merge(
                Decision(
                    text,
                    [RuleHit(rule.name, rule.kind, rule.action, stage, label=verdict.categories or "unsafe")],
                    blocked_by=rule.name if rule.action == "block" else None,
                )
            )
    return decision


class Guardrails:
    """The rules of one server, split per tenant and stage."""

    def __init__(self, config: GuardrailsConfig) -> None:
        self.config = config
        self._cache: dict[tuple[str, str], _RuleSet] = {}

    def rules_for(self, tenant: str, stage: str) -> _RuleSet:
        key = (tenant, stage)
        if key not in self._cache:
            rules: list[Rule] = [r for r in self.config.rules if r.applies(tenant, stage)]
            self._cache[key] = _RuleSet(
                [r for r in rules if isinstance(r, PatternRule)], [r for r in rules if isinstance(r, ClassifierRule)]
            )
        return self._cache[key]

    def input_guard(self) -> InputGuard:
        return InputGuard(self)

    def output_filter(self, tenant: str) -> OutputFilter | None:
        """A filter for one generated sample, or None when no output rule applies."""
        rules = self.rules_for(tenant, "output")
        if not rules:
            return None
        return OutputFilter(
            rules.patterns,
            rules.classifiers,
            self.config.output_hold_chars,
            self.config.classifier_window_chars,
            self.config.fail_mode,
        )


class InputGuard:
    """Checks a prompt before it is tokenized and prefilled."""

    def __init__(self, guardrails: Guardrails) -> None:
        self._guardrails = guardrails

    async def check(self, tenant: str, text: str) -> Decision:
        """Pattern rules first (a block there spares the classifier call), then classifiers
        on the redacted text."""
        rules = self._guardrails.rules_for(tenant, "input")
        decision = _apply(text, _scan(rules.patterns, text), "input")
        if decision.blocked or not rules.classifiers:
            return decision
        verdicts = await _classify(rules.classifiers, decision.text, "input", self._guardrails.config.fail_mode)
        decision.merge(verdicts)
        return decision

    async def check_messages(
        self, tenant: str, messages: list[dict[str, str]]
    ) -> tuple[list[dict[str, str]], Decision]:
        """Each message's content through the pattern rules, the whole conversation once
        through the classifiers. Returns the (redacted) messages and the decision."""
        rules = self._guardrails.rules_for(tenant, "input")
        decision = Decision("")
        checked = []
        for message in messages:
            content = message["content"]
            one = _apply(content, _scan(rules.patterns, content), "input")
            decision.merge(one)
            if decision.blocked:
                return messages, decision
            checked.append({**message, "content": one.text})
        if rules.classifiers:
            transcript = "\n\n".join(f"{m['role']}: {m['content']}" for m in checked)
            decision.merge(await _classify(rules.classifiers, transcript, "input", self._guardrails.config.fail_mode))
        return checked, decision


@dataclass
class OutputFilter:
    """One sample's text deltas in, checked (held back, redacted) text out.

    `feed` returns what may be sent now; `finish` releases the rest when the sample ends.
    After a block nothing more is released and `decision.blocked_by` names the rule.
    """

    patterns: list[PatternRule]
    classifiers: list[ClassifierRule]
    hold_chars: int
    window_chars: int
    fail_mode: str
    decision: Decision = field(default_factory=lambda: Decision(""))
    on_hit: Callable[[RuleHit], None] | None = None
    _pending: str = field(default="", init=False)
    _classified: int = field(default=0, init=False)  # chars of _pending already labelled
    _context: str = field(default="", init=False)  # the last labelled window

    @property
    def blocked(self) -> bool:
        return self.decision.blocked

    async def feed(self, delta: str) -> str:
        if self.blocked:
            return ""
        self._pending += delta
        return await self._release(final=False)

    async def finish(self) -> str:
        if self.blocked:
            return ""
        return await self._release(final=True)

    def _record(self, decision: Decision) -> None:
        for hit in decision.hits:
            if self.on_hit is not None:
                self.on_hit(hit)
        self.decision.merge(decision)

    async def _label_windows(self, final: bool) -> bool:
        """Label every complete window (and the remainder when final); False if blocked."""
        while self._classified < len(self._pending):
            end = self._classified + self.window_chars
            if end > len(self._pending):
                if not final:
                    break
                end = len(self._pending)
            window = self._pending[self._classified : end]
            verdicts = await _classify(self.classifiers, window, "output", self.fail_mode, context=self._context)
            self._record(Decision("", verdicts.hits, verdicts.blocked_by))
            if verdicts.blocked:
                return False
            self._context = window
            self._classified = end
        return True

    async def _release(self, final: bool) -> str:
        pending = self._pending
        cut = len(pending)
        if not final:
            starts = [s for s in (r.unfinished_start(pending) for r in self.patterns) if s is not None]
            if starts:
                cut = max(min(starts), len(pending) - self.hold_chars)
        if self.classifiers:
            if not await self._label_windows(final):
                self._pending = ""
                return ""
            cut = min(cut, self._classified)
        found = _scan(self.patterns, pending)
        moved = True
        while moved:  # a match overlapping the release point is held back whole
            moved = False
            for _, span in found:
                if span.start < cut < span.end:
                    cut, moved = span.start, True
        if cut == 0:
            return ""
        decision = _apply(pending[:cut], [(r, s) for r, s in found if s.end <= cut], "output")
        self._record(Decision("", decision.hits, decision.blocked_by))
        if decision.blocked:
            self._pending = ""
            return ""
        self._pending = pending[cut:]
        self._classified -= cut
        self.decision.text += decision.text
        return decision.text
