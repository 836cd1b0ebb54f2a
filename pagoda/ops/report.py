"""Report files of `pagoda gate` and `pagoda audit`: JSON (everything, for machines), a
Markdown summary (for a pull request) and a self-contained HTML page (tables and inline SVG
latency plots; no scripts, no external assets)."""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

STATUS_MARK = {"pass": "✅ pass", "fail": "❌ fail", "skipped": "⚪ skipped", "cleared": "✅ cleared"}


def _fmt(value: Any) -> str:
    if value is None:
        return "–"
    if isinstance(value, float):
        return f"{value:.4g}"
    return str(value)


def _md_escape(text: str) -> str:
    return text.replace("|", "\\|").replace("\n", " ")


# ---- gate ------------------------------------------------------------------------------------


def _side(info: dict[str, Any]) -> str:
    """`pagoda serve ARGS` for a side the gate launched, else its URL; and the model."""
    return f"`{info.get('launched') or info['base_url']}` ({info['model']})"


def gate_markdown(report: dict[str, Any]) -> str:
    verdict = "PASSED" if report["passed"] else "FAILED"
    lines = [
        f"## pagoda gate: {verdict}",
        "",
        f"baseline {_side(report['baseline'])} vs candidate {_side(report['candidate'])}, "
        f"suite `{report['suite']['name']}` ({report['suite']['cases']} cases, "
        f"{report['suite']['bad_requests']} bad requests), {report['duration_s']} s",
        "",
        "| rule | value | threshold | result |",
        "|---|---|---|---|",
    ]
    for rule in report["rules"]:
        lines.append(
            f"| `{rule['metric']}` | {_fmt(rule['value'])} | {rule['threshold']} | {STATUS_MARK[rule['status']]} |"
        )
    failing = [r for r in report["rules"] if r["status"] == "fail" and r["evidence"]]
    if failing:
        lines += ["", "### Evidence", ""]
        for rule in failing:
            lines.append(f"- **{rule['metric']}**")
            lines += [f"  - {_md_escape(e)}" for e in rule["evidence"]]
    provenance = provenance_rows(report)
    if provenance:
        lines += ["", "### Provenance", "", "| | baseline | candidate |", "|---|---|---|"]
        lines += [
            f"| {f'**{name}**' if base != cand else name} | {_md_escape(base)} | {_md_escape(cand)} |"
            for name, base, cand in provenance
        ]
    notes = [n for s in report["sections"].values() for n in s["notes"]]
    if notes:
        lines += ["", "### Notes", ""] + [f"- {_md_escape(n)}" for n in notes]
    return "\n".join(lines) + "\n"


def provenance_rows(report: dict[str, Any]) -> list[tuple[str, str, str]]:
    """(field, baseline, candidate) of the two sides' provenance records (the route's fields as
    route.*); empty when neither side reported one."""
    sides = report.get("provenance") or {}
    if not any(sides.values()):
        return []

    def flat(record: dict[str, Any] | None) -> dict[str, str]:
        if record is None:
            return {"id": "not reported"}
        fields = {k: v for k, v in record.items() if k != "route"}
        fields.update({f"route.{k}": v for k, v in (record.get("route") or {}).items()})
        return {k: _fmt(v) for k, v in fields.items()}

    base, cand = flat(sides.get("baseline")), flat(sides.get("candidate"))
    names = list(dict.fromkeys([*base, *cand]))
    return [(name, base.get(name, "–"), cand.get(name, "–")) for name in names]


def _bar_chart(
    title: str,
    groups: dict[str, dict[str, float | None]],
    errors: dict[str, dict[str, tuple[float, float]]] | None = None,
    unit: str = "ms",
    scale: float = 1000.0,
) -> str:
    """Grouped horizontal-free SVG bar chart: one group per metric, a bar per side."""
    colors = {"baseline": "#4c78a8", "candidate": "#f58518"}
    values = [v * scale for g in groups.values() for v in g.values() if v is not None]
    top = max(values + [1e-9]) * 1.15
    width, height, left, bottom = 520, 220, 50, 30
    plot_h = height - bottom - 20
    group_w = (width - left - 10) / max(1, len(groups))
    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{width}" height="{height}" '
        f'role="img" aria-label="{html.escape(title)}">',
        f'<text x="{left}" y="14" font-size="12">{html.escape(title)} ({unit})</text>',
    ]
    for i, (name, sides) in enumerate(groups.items()):
        x0 = left + i * group_w + 8
        for j, (side, value) in enumerate(sides.items()):
            if value is None:
                continue
            bar_h = value * scale / top * plot_h
            x = x0 + j * (group_w - 16) / 2
            y = height - bottom - bar_h
            parts.append(
                f'<rect x="{x:.1f}" y="{y:.1f}" width="{(group_w - 20) / 2:.1f}" '
                f'height="{bar_h:.1f}" fill="{colors.get(side, "#999")}">'
                f"<title>{side} {name}: {value * scale:.2f} {unit}</title></rect>"
            )
            if errors and name in errors.get(side, {}):
                lo, hi = errors[side][name]
                cx = x + (group_w - 20) / 4
                y_lo = height - bottom - lo * scale / top * plot_h
                y_hi = height - bottom - hi * scale / top * plot_h
                parts.append(f'<line x1="{cx:.1f}" x2="{cx:.1f}" y1="{y_lo:.1f}" y2="{y_hi:.1f}" stroke="black"/>')
        parts.append(f'<text x="{x0:.1f}" y="{height - 12}" font-size="11">{html.escape(name)}</text>')
    parts.append(f'<line x1="{left}" x2="{width - 10}" y1="{height - bottom}" y2="{height - bottom}" stroke="#333"/>')
    legend_x = width - 170
    for k, (side, color) in enumerate(colors.items()):
        parts.append(
            f'<rect x="{legend_x + k * 85}" y="4" width="10" height="10" '
            f'fill="{color}"/><text x="{legend_x + k * 85 + 14}" y="13" '
            f'font-size="11">{side}</text>'
        )
    parts.append("</svg>")
    return "".join(parts)


def _latency_plots(latency: dict[str, Any]) -> str:
    sides = latency.get("sides")
    if not sides:
        return "<p>latency profile skipped</p>"
    groups: dict[str, dict[str, float | None]] = {}
    errors: dict[str, dict[str, tuple[float, float]]] = {}
    for metric in ("ttft_p50", "ttft_p99", "itl_p50", "itl_p99"):
        groups[metric] = {side: sides[side][metric] for side in ("baseline", "candidate")}
    for side in ("baseline", "candidate"):
        errors[side] = {}
        for metric in groups:
            runs = [r[metric] for r in sides[side]["repeats"] if r[metric] is not None]
            if runs:
                errors[side][metric] = (min(runs), max(runs))
    throughput = {"throughput": {s: sides[s]["throughput"] for s in ("baseline", "candidate")}}
    return _bar_chart("latency: medians of repeated runs, whiskers min-max", groups, errors) + _bar_chart(
        "output throughput", throughput, unit="tok/s", scale=1.0
    )


HTML_STYLE = """body{font-family:system-ui,sans-serif;margin:2em;max-width:1100px}
table{border-collapse:collapse;margin:1em 0}td,th{border:1px solid #ccc;padding:4px 8px;
text-align:left;vertical-align:top;font-size:13px}th{background:#f3f3f3}.pass,.cleared{color:#080}
.fail{color:#b00;font-weight:bold}.skipped{color:#777}code{font-size:12px}
.high{color:#b00;font-weight:bold}.medium{color:#c60}.low{color:#777}"""


def _table(header: list[str], rows: list[list[str]]) -> str:
    head = "".join(f"<th>{html.escape(h)}</th>" for h in header)
    body = "".join("<tr>" + "".join(f"<td>{c}</td>" for c in row) + "</tr>" for row in rows)
    return f"<table><tr>{head}</tr>{body}</table>"


def _evidence_html(lines: list[str]) -> str:
    return "<br>".join(html.escape(line) for line in lines)


def gate_html(report: dict[str, Any]) -> str:
    esc = html.escape
    verdict = "PASSED" if report["passed"] else "FAILED"
    rules = _table(
        ["rule", "value", "threshold", "result", "evidence"],
        [
            [
                f"<code>{esc(r['metric'])}</code>",
                esc(_fmt(r["value"])),
                esc(r["threshold"]),
                f'<span class="{r["status"]}">{r["status"]}</span>',
                _evidence_html(r["evidence"]),
            ]
            for r in report["rules"]
        ],
    )
    metrics_rows = [
        [esc(name), f"<code>{esc(k)}</code>", esc(_fmt(v))]
        for name, s in report["sections"].items()
        for k, v in s["metrics"].items()
    ]
    cases = report["sections"]["outputs"]["details"].get("cases", [])
    case_rows = [
        [
            esc(c["id"]),
            esc(", ".join(c["tags"])),
            "yes" if c["exact"] else "no",
            esc(_fmt(c["first_divergence"])),
            esc(_fmt(c.get("max_drift"))),
        ]
        for c in cases
    ]
    bad = report["sections"]["contract"]["details"].get("bad_requests", {})
    bad_rows = [[esc(k), str(v["expected"]), str(v["baseline"]), str(v["candidate"])] for k, v in bad.items()]
    notes = "".join(f"<li>{esc(n)}</li>" for s in report["sections"].values() for n in s["notes"])
    provenance = [
        [f"<b>{esc(name)}</b>" if base != cand else esc(name), esc(base), esc(cand)]
        for name, base, cand in provenance_rows(report)
    ]
    provenance_html = (
        _table(["", "baseline", "candidate"], provenance) if provenance else "<p>neither server reports provenance</p>"
    )
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>pagoda gate: {verdict}</title>
<style>{HTML_STYLE}</style></head><body>
<h1>pagoda gate: <span class="{"pass" if report["passed"] else "fail"}">{verdict}</span></h1>
<p>baseline <code>{esc(json.dumps(report["baseline"]))}</code><br>
candidate <code>{esc(json.dumps(report["candidate"]))}</code><br>
suite {esc(report["suite"]["name"])}: {report["suite"]["cases"]} cases,
{report["suite"]["bad_requests"]} bad requests; {report["duration_s"]} s</p>
<h2>Rules</h2>{rules}
<h2>Latency</h2>{_latency_plots(report["sections"]["latency"]["details"])}
<h2>Outputs per case</h2>{_table(["case", "tags", "exact match", "first divergence", "max |Δ logprob|"], case_rows)}
<h2>Bad requests (HTTP status)</h2>{_table(["case", "expected", "baseline", "candidate"], bad_rows)}
<h2>Provenance</h2>{provenance_html}
<h2>All metrics</h2>{_table(["section", "metric", "value"], metrics_rows)}
<h2>Notes</h2><ul>{notes or "<li>none</li>"}</ul>
</body></html>
"""


# ---- audit ------------------------------------------------------------------------------------


def audit_markdown(report: dict[str, Any]) -> str:
    lines = [
        f"## pagoda audit of {_side(report['target'])}",
        "",
        f"{report['requests_sent']} requests, {report['duration_s']} s",
        "",
        "| probe | severity | statistic | mitigation | with mitigation |",
        "|---|---|---|---|---|",
    ]
    for finding in report["findings"]:
        rerun = finding.get("rerun")
        after = "–" if not rerun else f"{rerun['severity']}: {_md_escape(rerun['summary'])}"
        lines.append(
            f"| {finding['probe']} | {finding['severity']} | "
            f"{_md_escape(finding['summary'])} | {_md_escape(finding['mitigation'])} | "
            f"{after} |"
        )
    lines += ["", "### Evidence", ""]
    for finding in report["findings"]:
        lines.append(f"- **{finding['probe']}** ({finding['severity']})")
        lines += [f"  - {_md_escape(e)}" for e in finding["evidence"]]
    if report["notes"]:
        lines += ["", "### Notes", ""] + [f"- {_md_escape(n)}" for n in report["notes"]]
    return "\n".join(lines) + "\n"


def audit_html(report: dict[str, Any]) -> str:
    esc = html.escape
    rows = []
    for f in report["findings"]:
        rerun = f.get("rerun")
        after = (
            "–"
            if not rerun
            else (f'<span class="{esc(rerun["severity"])}">{esc(rerun["severity"])}</span>: {esc(rerun["summary"])}')
        )
        rows.append(
            [
                esc(f["probe"]),
                f'<span class="{esc(f["severity"])}">{esc(f["severity"])}</span>',
                esc(f["summary"]),
                _evidence_html(f["evidence"]),
                esc(f["mitigation"]),
                after,
            ]
        )
    notes = "".join(f"<li>{esc(n)}</li>" for n in report["notes"])
    return f"""<!doctype html><html><head><meta charset="utf-8"><title>pagoda audit</title>
<style>{HTML_STYLE}</style></head><body>
<h1>pagoda audit</h1>
<p>target <code>{esc(json.dumps(report["target"]))}</code>; {report["requests_sent"]} requests,
{report["duration_s"]} s</p>
{_table(["probe", "severity", "statistic", "evidence", "mitigation", "with mitigation"], rows)}
<h2>Notes</h2><ul>{notes or "<li>none</li>"}</ul>
</body></html>
"""


def write_reports(out_dir: str | Path, stem: str, report: dict[str, Any]) -> list[Path]:
    """report JSON + Markdown + HTML under out_dir; returns the paths written."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    is_gate = report.get("kind") == "pagoda-gate-report"
    paths = [out / f"{stem}.json", out / f"{stem}.md", out / f"{stem}.html"]
    paths[0].write_text(json.dumps(report, indent=2, ensure_ascii=False) + "\n")
    paths[1].write_text(gate_markdown(report) if is_gate else audit_markdown(report))
    paths[2].write_text(gate_html(report) if is_gate else audit_html(report))
    return paths
