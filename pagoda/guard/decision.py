"""What a guardrail check concluded: the text that may pass on and which rules fired."""

from __future__ import annotations

from dataclasses import dataclass, field

ACTIONS = ("block", "redact", "flag")
STAGES = ("input", "output")


@dataclass(frozen=True)
class RuleHit:
    """One rule firing on one stage: `count` matches (or one classifier verdict)."""

    rule: str
    kind: str
    action: str  # block | redact | flag; "error" when the rule could not run
    stage: str
    count: int = 1
    # What was found ("email", a classifier's categories, ...): never the matched text.
    label: str | None = None


@dataclass
class Decision:
    """The outcome of checking one text. `text` is what may be passed on (redacted where a
    redact rule matched); meaningless when `blocked`."""

    text: str
    hits: list[RuleHit] = field(default_factory=list)
    blocked_by: str | None = None

    @property
    def blocked(self) -> bool:
        return self.blocked_by is not None

    @property
    def redacted(self) -> bool:
        return any(h.action == "redact" for h in self.hits)

    def merge(self, other: Decision) -> None:
        """Fold the hits (and block) of `other` into this decision; `text` is left alone."""
        self.hits.extend(other.hits)
        if self.blocked_by is None:
            self.blocked_by = other.blocked_by
