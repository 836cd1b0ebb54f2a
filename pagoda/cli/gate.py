"""`pagoda gate` (release gate between two OpenAI-compatible servers) and `pagoda gate record`."""

from __future__ import annotations

import argparse
import contextlib
import sys
from pathlib import Path

GATE_DESCRIPTION = """\
Replay a suite against a BASELINE and a CANDIDATE server and compare tokenization and chat
templates (/tokenize), greedy outputs (exact match, first divergence, logprob drift, stop
reasons, refusals), structured output validity, the API contract (usage arithmetic, streaming
shape, error codes) and latency under a short load profile. A policy sets the thresholds;
the exit code is 0 only when every rule holds (1: a rule failed, 2: the gate could not run).

Each side is a base URL (http://host:port, with --baseline-model/--baseline-key ...) or
`pagoda:ARGS`, which launches `pagoda serve ARGS` on a free loopback port for the run.

`pagoda gate record (--from-text FILE | --from-log FILE) -o SUITE.jsonl` writes a suite from a
text file (one prompt per paragraph or line) or from a pagoda request log (prompts appear
there only when the server runs with --log-prompts)."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    gate = subparsers.add_parser(
        "gate",
        help="release gate: compare a candidate server against a baseline",
        description=GATE_DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    gate.add_argument(
        "sides", nargs="*", metavar="BASELINE CANDIDATE", help="base URLs or pagoda:ARGS; or `record` to write a suite"
    )
    gate.add_argument("--suite", default="default", help="suite JSONL file, or `default` (shipped with pagoda)")
    gate.add_argument("--policy", default=None, help="policy YAML (default: built-in rules)")
    gate.add_argument("--out", default="gate-report", help="directory for report.json/.md/.html")
    for side in ("baseline", "candidate"):
        gate.add_argument(f"--{side}-model", default=None, help=f"{side} model name (default: the first of /v1/models)")
        gate.add_argument(f"--{side}-key", default=None, help=f"{side} API key")
    gate.add_argument("--max-tokens", type=int, default=None, help="cap every case's max_tokens (shorter runs)")
    gate.add_argument("--no-latency", action="store_true", help="skip the latency profile")
    gate.add_argument("--load-requests", type=int, default=16, help="requests per latency run")
    gate.add_argument("--load-concurrency", type=int, default=4, help="clients per latency run")
    gate.add_argument(
        "--load-max-tokens", type=int, default=16, help="tokens generated per latency request (ignore_eos)"
    )
    gate.add_argument(
        "--load-repeats", type=int, default=3, help="latency runs per side, alternating sides (noise band)"
    )
    gate.add_argument("--timeout", type=float, default=120.0, help="per-request timeout, s")
    gate.add_argument(
        "--launch-timeout", type=float, default=300.0, help="seconds to wait for a launched pagoda to become healthy"
    )
    gate.add_argument("--no-progress", action="store_true", help="no progress bars")
    record = gate.add_argument_group("record (pagoda gate record ...)")
    record.add_argument(
        "--from-text", default=None, metavar="FILE", help="one prompt per paragraph (or per line with --by line)"
    )
    record.add_argument(
        "--from-log",
        default=None,
        metavar="FILE",
        help="a prompt-log file (prompts-*.jsonl that pagoda serve --log-prompts writes)",
    )
    record.add_argument("--by", choices=["paragraph", "line"], default="paragraph")
    record.add_argument("--chat", action="store_true", help="record text prompts as user messages")
    record.add_argument("-o", "--output", default=None, metavar="SUITE.jsonl")
    gate.set_defaults(func=run_gate_cli)


def _fail(command: str, message: str) -> int:
    print(f"pagoda {command}: {message}", file=sys.stderr)
    return 2


def run_record(args: argparse.Namespace) -> int:
    from pagoda.ops.suite import SuiteError, suite_from_request_log, suite_from_text

    if (args.from_text is None) == (args.from_log is None) or not args.output:
        return _fail("gate record", "give --from-text FILE or --from-log FILE, and -o SUITE.jsonl")
    source = args.from_text or args.from_log
    try:
        text = Path(source).read_text()
    except OSError as exc:
        return _fail("gate record", f"cannot read {source}: {exc.strerror or exc}")
    name = Path(args.output).stem
    try:
        if args.from_text:
            suite = suite_from_text(text, name, by=args.by, max_tokens=args.max_tokens or 32, chat=args.chat)
        else:
            suite, without = suite_from_request_log(text.splitlines(), name, max_tokens=args.max_tokens)
            if without:
                print(
                    f"pagoda gate record: {without} logged requests had no prompt text (logged without --log-prompts)",
                    file=sys.stderr,
                )
    except SuiteError as exc:
        return _fail("gate record", str(exc))
    suite.write(args.output)
    print(f"wrote {len(suite.cases)} cases to {args.output}")
    return 0


def run_gate_cli(args: argparse.Namespace) -> int:
    if args.sides[:1] == ["record"]:
        return run_record(args)
    if len(args.sides) != 2:
        return _fail("gate", "give BASELINE and CANDIDATE (URLs or pagoda:ARGS), or `record`")
    from pagoda.ops.gate import run_gate
    from pagoda.ops.latency import LoadProfile
    from pagoda.ops.policy import PolicyError, load_policy
    from pagoda.ops.report import gate_markdown, write_reports
    from pagoda.ops.suite import SuiteError, load_suite
    from pagoda.ops.target import TargetError, open_target

    try:
        suite = load_suite(args.suite).with_max_tokens(args.max_tokens)
        rules = load_policy(args.policy)
        profile = (
            None
            if args.no_latency
            else LoadProfile(args.load_requests, args.load_concurrency, args.load_max_tokens, args.load_repeats)
        )
        with contextlib.ExitStack() as stack:
            baseline = stack.enter_context(
                open_target(
                    args.sides[0],
                    "baseline",
                    model=args.baseline_model,
                    api_key=args.baseline_key,
                    launch_timeout=args.launch_timeout,
                )
            )
            candidate = stack.enter_context(
                open_target(
                    args.sides[1],
                    "candidate",
                    model=args.candidate_model,
                    api_key=args.candidate_key,
                    launch_timeout=args.launch_timeout,
                )
            )
            result = run_gate(
                baseline, candidate, suite, rules, profile=profile, progress=not args.no_progress, timeout=args.timeout
            )
    except (SuiteError, PolicyError, TargetError, ValueError) as exc:
        return _fail("gate", str(exc))
    report = result.to_json()
    paths = write_reports(args.out, "report", report)
    print(gate_markdown(report))
    print("reports: " + ", ".join(str(p) for p in paths))
    return 0 if result.passed else 1
