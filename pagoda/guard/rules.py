"""Guardrail rules: pattern rules (regex, blocklist, pii) that find spans of text, and
classifier rules that ask a guard model for a verdict. Each rule names its action, the
stages (input, output) it checks and the tenants it applies to."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

import regex

from pagoda.guard.pii import PATTERNS, PII_TYPES, Span, find_pii, unfinished_start

if TYPE_CHECKING:
    from pagoda.guard.classifier import GuardModel

DEFAULT_REPLACEMENT = "[REDACTED]"


@dataclass(frozen=True)
class Rule:
    name: str
    kind: str
    action: str
    stages: frozenset[str]
    tenants: frozenset[str] | None  # None: every tenant

    def applies(self, tenant: str, stage: str) -> bool:
        return stage in self.stages and (self.tenants is None or tenant in self.tenants)


@dataclass(frozen=True)
class PatternRule(Rule):
    """regex, blocklist and pii rules: spans of the text, each replaced when redacting."""

    pattern: regex.Pattern[str] | None = None  # regex and blocklist
    pii_types: tuple[str, ...] = PII_TYPES
    replacement: str | None = None  # None: "[REDACTED_<LABEL>]" for pii, "[REDACTED]" else

    def find(self, text: str) -> list[Span]:
        if self.kind == "pii":
            return find_pii(text, self.pii_types)
        assert self.pattern is not None  # set for every non-pii kind by the config parser
        return [Span(m.start(), m.end(), self.name) for m in self.pattern.finditer(text) if m.end() > m.start()]

    def unfinished_start(self, text: str) -> int | None:
        """Where a match that the next characters could complete or extend begins."""
        if self.kind == "pii":
            patterns = [PATTERNS[t] for t in self.pii_types]
        else:
            assert self.pattern is not None  # set for every non-pii kind by the config parser
            patterns = [self.pattern]
        starts = [s for s in (unfinished_start(p, text) for p in patterns) if s is not None]
        return min(starts, default=None)

    def replacement_for(self, span: Span) -> str:
        if self.replacement is not None:
            return self.replacement
        if self.kind == "pii":
            return f"[REDACTED_{span.label.upper()}]"
        return DEFAULT_REPLACEMENT


@dataclass(frozen=True)
class ClassifierRule(Rule):
    """A guard model's verdict on the whole input, and on the output window by window."""

    model: GuardModel | None = None


def blocklist_pattern(words: list[str], case_sensitive: bool) -> regex.Pattern[str]:
    """Whole-word matches of any of `words` (longest first, so overlapping entries prefer
    the longer one)."""
    escaped = [regex.escape(w) for w in sorted(words, key=len, reverse=True)]
    # \b only where the word starts/ends with a word character: "c++" still matches.
    parts = [
        (r"\b" if w[0].isalnum() or w[0] == "_" else "") + e + (r"\b" if w[-1].isalnum() or w[-1] == "_" else "")
        for w, e in zip(sorted(words, key=len, reverse=True), escaped)
    ]
    return regex.compile("|".join(parts), 0 if case_sensitive else regex.IGNORECASE)
