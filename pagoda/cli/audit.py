"""`pagoda audit`: side-channel audit of one OpenAI-compatible deployment from two tenants' seats."""

from __future__ import annotations

import argparse
import sys

AUDIT_DESCRIPTION = """\
Probe a deployment from two tenants' seats (API keys A and B) for side channels: cross-tenant
prefix-cache reuse (cached_tokens and a TTFT hit/miss distinguisher, as AUC with a bootstrap
confidence interval), prompt-length leakage through the other tenant's latency, queue /
priority leakage, and response-size leakage in streaming. Each finding has a severity, its
evidence and pagoda's mitigation; when the target is `pagoda:ARGS` the audit re-runs the probe
with the mitigation applied. Traffic is bounded (--budget) and goes only to the given URL."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    audit = subparsers.add_parser(
        "audit",
        help="side-channel audit of a deployment from two tenants' seats",
        description=AUDIT_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    audit.add_argument("url", metavar="URL", help="base URL, or pagoda:ARGS to launch one")
    audit.add_argument("--key-a", default=None, help="tenant A's API key (the victim's seat)")
    audit.add_argument("--key-b", default=None, help="tenant B's API key (the observer's seat)")
    audit.add_argument("--model", default=None, help="model name (default: first of /v1/models)")
    audit.add_argument("--out", default="audit-report", help="directory for the report files")
    audit.add_argument(
        "--probes", default="cache,length,queue,stream", help="comma-separated subset of cache,length,queue,stream"
    )
    audit.add_argument("--trials", type=int, default=24, help="hit and miss trials each for the cache probe")
    audit.add_argument("--budget", type=int, default=600, help="most requests the audit may send in total")
    audit.add_argument(
        "--no-rerun", action="store_true", help="do not re-run probes with mitigations on a launched pagoda"
    )
    audit.add_argument("--seed", type=int, default=0, help="seed of the random probe prompts")
    audit.add_argument("--timeout", type=float, default=120.0, help="per-request timeout, s")
    audit.add_argument("--launch-timeout", type=float, default=300.0)
    audit.add_argument("--no-progress", action="store_true", help="no progress bars")
    audit.set_defaults(func=run_audit_cli)


def _fail(command: str, message: str) -> int:
    print(f"pagoda {command}: {message}", file=sys.stderr)
    return 2


def run_audit_cli(args: argparse.Namespace) -> int:
    from pagoda.ops.audit import AuditOptions, run_audit
    from pagoda.ops.report import audit_markdown, write_reports
    from pagoda.ops.target import TargetError, parse_target

    try:
        options = AuditOptions.from_args(args)
        parsed = parse_target(args.url, "audit", model=args.model, api_key=args.key_a)
        report = run_audit(parsed, options)
    except (TargetError, ValueError) as exc:
        return _fail("audit", str(exc))
    paths = write_reports(args.out, "audit", report)
    print(audit_markdown(report))
    print("reports: " + ", ".join(str(p) for p in paths))
    return 0
