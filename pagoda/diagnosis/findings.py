"""A finding: what looks wrong, how bad, the numbers that say so, and what to check next."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal

Severity = Literal["info", "warning", "critical"]
SEVERITIES: tuple[Severity, ...] = ("info", "warning", "critical")  # mildest first


@dataclass
class Finding:
    """One diagnosis. `evidence` holds the figures read (name -> value, JSON-ready);
    `next_checks` the commands or settings to look at, most likely first."""

    id: str  # stable, for scripts: queue_wait, preemptions, ...
    severity: Severity
    title: str
    evidence: dict[str, Any] = field(default_factory=dict)
    next_checks: list[str] = field(default_factory=list)

    @property
    def rank(self) -> int:
        return SEVERITIES.index(self.severity)


def worst_severity(findings: list[Finding]) -> Severity | None:
    """The most severe of `findings`, None when there are none."""
    return max((f.severity for f in findings), key=SEVERITIES.index, default=None)


def ranked(findings: list[Finding]) -> list[Finding]:
    """Most severe first; equal severities keep their order (the runbook's)."""
    return sorted(findings, key=lambda f: -f.rank)
