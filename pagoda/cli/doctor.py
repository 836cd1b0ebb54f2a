"""`pagoda doctor URL`: flags of the triage command; pagoda/ops/doctor.py does the work."""

from __future__ import annotations

import argparse
import json
import sys

DESCRIPTION = """\
Read a running server's /health and two /metrics scrapes --window seconds apart (and, with
--probe, a few cheap requests of its own), then print what looks wrong, most severe first, with
the figures read and the next checks. Works against pagoda and any server exporting vLLM's
metric names. Exit code: 0 nothing above info, 1 a warning, 2 a critical finding, 3 the server
could not be read."""


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "doctor",
        help="diagnose a running server from its metrics",
        description=DESCRIPTION,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("url", help="the server's base URL, e.g. http://127.0.0.1:8000")
    parser.add_argument(
        "--window", type=float, default=30.0, help="seconds between the two /metrics scrapes (default 30)"
    )
    parser.add_argument(
        "--probe", action="store_true", help="send a few short requests: prefix-cache reuse, chunk spacing at a client"
    )
    parser.add_argument(
        "--key",
        action="append",
        default=[],
        metavar="API_KEY",
        help="API key (repeatable: a second key's tenant is probed for prefix sharing)",
    )
    parser.add_argument("--model", default=None, help="model for the probe (default: the first of /v1/models)")
    parser.add_argument(
        "--ttft-target", type=float, default=1.0, help="time-to-first-token objective, seconds (default 1)"
    )
    parser.add_argument(
        "--itl-target", type=float, default=0.1, help="inter-token latency objective, seconds (default 0.1)"
    )
    parser.add_argument("--timeout", type=float, default=30.0, help="seconds per HTTP request (default 30)")
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print the report as JSON")
    output.add_argument("--markdown", action="store_true", help="print the report as Markdown")
    parser.set_defaults(func=run_doctor_cli)


def run_doctor_cli(args: argparse.Namespace) -> int:
    from pagoda.diagnosis import Targets
    from pagoda.ops.doctor import EXIT_COULD_NOT_RUN, DoctorError, DoctorOptions, run_doctor
    from pagoda.ops.doctor_report import render_markdown, render_text

    try:
        if args.ttft_target <= 0 or args.itl_target <= 0:
            raise ValueError("--ttft-target and --itl-target must be > 0")
        options = DoctorOptions(
            url=args.url,
            window_s=args.window,
            probe=args.probe,
            api_keys=args.key,
            model=args.model,
            targets=Targets(args.ttft_target, args.itl_target),
            timeout_s=args.timeout,
        )
        report = run_doctor(options)
    except (ValueError, DoctorError) as error:
        print(f"pagoda doctor: error: {error}", file=sys.stderr)
        return EXIT_COULD_NOT_RUN
    if args.json:
        print(json.dumps(report.to_dict(), indent=2, default=str))
    elif args.markdown:
        print(render_markdown(report))
    else:
        print(render_text(report), end="")
    return report.exit_code
