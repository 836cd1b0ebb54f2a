"""Server vs offline engine: does HTTP streaming cost throughput?

The offline engine's workload (prompts and outputs uniform in [32, 256] tokens, ignore_eos)
runs twice on one request list, back to back: in-process through `pagoda.LLM`, and through
`pagoda serve` (its default engine process) with 64 concurrent streaming clients. Both
engines run 64 sequences at most and the same number of torch threads, so the ratio is what
the HTTP side costs. Reports output tok/s of both, and TTFT / ITL p50 and p99 of the server.
With `--rounds N` the pair runs N times, who goes first alternating, and the median of the
per-round ratios is reported. Each server pass also records the CPU seconds of the HTTP
process, the engine process and this process (the load generator), read from /proc: on a
shared 2-core machine they say whether the engine was short of a core or had extra work.

    .venv/bin/python benchmarks/server_throughput.py --rounds 3
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (  # noqa: E402
    META_KEYS,
    REPO,
    RESULTS,
    bench,
    build_bench_model,
    load_results,
    metadata,
    pagoda_server_process,
    write_summary,
)

NAME = "server_throughput"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=str(REPO / "tmp" / "bench-model"))
    parser.add_argument("--out", default=str(RESULTS / NAME))
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--rounds", type=int, default=1, help="offline/server pairs, who goes first alternating")
    args = parser.parse_args(argv)

    model_dir = build_bench_model(Path(args.model_dir))
    out = Path(args.out)
    meta = {k: v for k, v in metadata(f"{NAME}.py", argv, model_dir).items() if k in META_KEYS}
    engine = ["--num-threads", str(args.threads), "--max-num-seqs", str(args.concurrency), "--max-model-len", "1024"]
    offline_label, server_label = "offline engine", f"server ({args.concurrency} streams)"
    rounds = []
    for round_index in range(args.rounds):
        round_out = out if args.rounds == 1 else out / f"round{round_index + 1}"
        with pagoda_server_process(model_dir, engine, round_out / "server.log") as (url, proc):
            targets = [
                f"--target=pagoda:max_num_seqs={args.concurrency},label={offline_label}",
                f"--target=http:url={url},model=bench,label={server_label}",
            ]
            if round_index % 2 == 1:
                targets.reverse()
            pids = {"http": proc.pid, "engine": _children(proc.pid), "load generator": os.getpid()}
            marks = [_cpu_mark(pids)]
            rc = bench(
                [
                    "compare",
                    "--model",
                    str(model_dir),
                    "--num-threads",
                    str(args.threads),
                    "--mix",
                    "chat",
                    "--param",
                    "chat.prompt=uniform:32:256",
                    "--param",
                    "chat.output=uniform:32:256",
                    "--max-model-len",
                    "1024",
                    "--num-requests",
                    str(args.num_requests),
                    "--warmup",
                    "4",
                    "--concurrency",
                    str(args.concurrency),
                    "--seed",
                    "0",
                    "--no-progress",
                    "--out",
                    str(round_out),
                    *targets,
                ]
            )
            marks.append(_cpu_mark(pids))
        (round_out / "server.log").unlink(missing_ok=True)
        if rc:
            return rc
        rows = {}
        for run in load_results(round_out / "results.json")["runs"]:
            summary = run["summary"]
            overall = summary["overall"]
            row = {
                "seconds": summary["duration"],
                "output_tok_per_s": overall["output_throughput"],
                "ttft_p50_s": overall["ttft"]["p50"],
                "ttft_p99_s": overall["ttft"]["p99"],
            }
            if overall.get("itl"):
                row.update(itl_p50_s=overall["itl"]["p50"], itl_p99_s=overall["itl"]["p99"])
            rows[summary["target"]] = row
        # CPU seconds of each process over the whole compare call; the HTTP process and the
        # engine process idle through the offline pass, so theirs are the server pass's.
        cpu = {name: marks[1][name] - marks[0][name] for name in pids}
        rows[server_label]["cpu_seconds"] = {"http process": cpu["http"], "engine process": cpu["engine"]}
        ratio = rows[server_label]["output_tok_per_s"] / rows[offline_label]["output_tok_per_s"]
        rounds.append(
            {
                "results": rows,
                "server_over_offline_throughput": ratio,
                "load_generator_cpu_seconds_both_passes": cpu["load generator"],
                "load_average": os.getloadavg()[0],
                "server_first": round_index % 2 == 1,
            }
        )
        print(
            f"round {round_index + 1}: server / offline output throughput {ratio:.2f} "
            f"(server CPU s: HTTP {cpu['http']:.1f}, engine {cpu['engine']:.1f}; load {os.getloadavg()[0]:.1f})",
            flush=True,
        )
    ratio = statistics.median(r["server_over_offline_throughput"] for r in rounds)
    payload = {
        **meta,
        "workload": {
            "requests": args.num_requests,
            "prompt": "uniform 32-256",
            "output": "uniform 32-256",
            "ignore_eos": True,
            "concurrency": args.concurrency,
            "max_num_seqs": args.concurrency,
            "threads": args.threads,
        },
        "server_over_offline_throughput": ratio,
    }
    if args.rounds == 1:
        payload["results"] = rounds[0]["results"]
    else:
        payload["rounds"] = rounds
    write_summary(out / "summary.json", payload)
    print(f"server / offline output throughput: {ratio:.2f}; wrote {out}/summary.json")
    return 0


def _children(pid: int) -> list[int]:
    """The server's child processes (its engine), from /proc."""
    children = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if int((entry / "stat").read_text().rsplit(")", 1)[1].split()[1]) == pid:
                    children.append(int(entry.name))
            except (OSError, IndexError, ValueError):
                continue
    return children


def _cpu_mark(pids: dict[str, int | list[int]]) -> dict[str, float]:
    """CPU seconds so far of each named process (or group of processes), and the wall clock."""
    return {name: sum(_cpu_seconds(pid) for pid in ([p] if isinstance(p, int) else p)) for name, p in pids.items()} | {
        "wall": time.perf_counter()
    }


def _cpu_seconds(pid: int) -> float:
    """User + system CPU seconds of a live process (Linux /proc; 0 where unreadable)."""
    try:
        fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


if __name__ == "__main__":
    sys.exit(main())
