"""The doctor's report as text (a terminal) and Markdown (a ticket or a CI summary); JSON is
`DoctorReport.to_dict`."""

from __future__ import annotations

import json
from typing import Any

from pagoda.ops.doctor import DoctorReport

_MARK = {"critical": "CRITICAL", "warning": "WARNING", "info": "info"}


def _value(value: Any) -> str:
    if isinstance(value, float):
        return f"{value:.4g}"
    if isinstance(value, (dict, list)):
        return json.dumps(value, separators=(", ", ": "), default=str)
    return str(value)


def _evidence(evidence: dict[str, Any]) -> list[tuple[str, str]]:
    return [(key, _value(value)) for key, value in evidence.items() if value is not None]


def _headline(report: DoctorReport) -> str:
    status = (report.health or {}).get("status", "?")
    worst = report.worst or "none"
    return (
        f"pagoda doctor {report.url} (model {report.model or '?'}): health {status}, "
        f"{report.window_s:g}s window, worst finding: {worst}"
    )


def render_text(report: DoctorReport) -> str:
    lines = [_headline(report), ""]
    for finding in report.findings:
        lines.append(f"[{_MARK[finding.severity]}] {finding.id}: {finding.title}")
        for key, value in _evidence(finding.evidence):
            lines.append(f"    {key} = {value}")
        for check in finding.next_checks:
            lines.append(f"    -> {check}")
        lines.append("")
    return "\n".join(lines).rstrip() + "\n"


def render_markdown(report: DoctorReport) -> str:
    lines = [f"# {_headline(report)}", ""]
    if not any(f.severity != "info" for f in report.findings):
        lines += ["No finding above info.", ""]
    for finding in report.findings:
        lines += [f"## {_MARK[finding.severity]}: {finding.title} (`{finding.id}`)", ""]
        evidence = _evidence(finding.evidence)
        if evidence:
            lines += ["| evidence | value |", "|---|---|"]
            lines += [f"| {key} | {value.replace('|', '/')} |" for key, value in evidence]
            lines.append("")
        if finding.next_checks:
            lines += ["Next checks:", ""] + [f"- {check}" for check in finding.next_checks] + [""]
    return "\n".join(lines)
