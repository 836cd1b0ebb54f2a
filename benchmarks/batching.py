"""Static vs continuous batching, and pagoda vs transformers, on one mixed-length request list.

Three targets run back to back on the same requests (all arriving at once), each with room for
16 sequences at a time:
  - pagoda, continuous batching (a finished request's slot is refilled at the next step);
  - pagoda, static batching (16 at a time, each group run until its longest request ends);
  - transformers `generate`, static batches of 16 (left padding, greedy, exact lengths).
Lengths are lognormal: prompts p50 32 / p95 128 tokens, outputs p50 32 / p95 512 tokens. The
long tail of output lengths is what static batching wastes: a group runs as long as its longest
member while finished slots sit idle.

    .venv/bin/python benchmarks/batching.py
"""

from __future__ import annotations

import argparse
import sys
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
    replot_compare,
    write_summary,
)

NAME = "batching"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=str(REPO / "tmp" / "bench-model"))
    parser.add_argument("--out", default=str(RESULTS / NAME))
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--batch", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--no-transformers", action="store_true")
    parser.add_argument("--replot", action="store_true", help="only redo summary.json and plots from results")
    args = parser.parse_args(argv)

    model_dir = build_bench_model(Path(args.model_dir))
    out = Path(args.out)
    meta = load_results(out / "summary.json") if args.replot else metadata(f"{NAME}.py", argv, model_dir)
    meta = {k: meta[k] for k in META_KEYS if k in meta}
    targets = [
        f"pagoda:max_num_seqs={args.batch},label=pagoda continuous",
        f"pagoda-static:batch={args.batch},label=pagoda static",
    ]
    if not args.no_transformers:
        targets.append(f"hf:batch_size={args.batch},label=transformers static")
    command = [
        "compare",
        "--model",
        str(model_dir),
        "--num-threads",
        str(args.threads),
        "--mix",
        "chat",
        "--param",
        "chat.prompt=lognormal:32:128",
        "--param",
        "chat.output=lognormal:32:512",
        "--max-model-len",
        "1024",
        "--num-requests",
        str(args.num_requests),
        "--warmup",
        "4",
        "--no-progress",
        "--out",
        str(out),
        *[f"--target={t}" for t in targets],
    ]
    rc = 0 if args.replot else bench(command)
    if rc:
        return rc

    runs = load_results(out / "results.json")["runs"]
    rows = {}
    for run in runs:
        s = run["summary"]
        o = s["overall"]
        rows[s["target"]] = {
            "seconds": s["duration"],
            "output_tok_per_s": o["output_throughput"],
            "e2e_p50_s": o["e2e"]["p50"],
            "e2e_p99_s": o["e2e"]["p99"],
            "ttft_p50_s": o["ttft"]["p50"],
            "ttft_p99_s": o["ttft"]["p99"],
            "output_tokens": o["output_tokens"],
        }
    base = rows["pagoda continuous"]
    for row in rows.values():
        row["throughput_vs_continuous"] = row["output_tok_per_s"] / base["output_tok_per_s"]
        row["e2e_p50_vs_continuous"] = row["e2e_p50_s"] / base["e2e_p50_s"]
        row["e2e_p99_vs_continuous"] = row["e2e_p99_s"] / base["e2e_p99_s"]
    write_summary(
        out / "summary.json",
        {
            **meta,
            "workload": {
                "requests": args.num_requests,
                "prompt": "lognormal p50 32 / p95 128",
                "output": "lognormal p50 32 / p95 512",
                "arrival": "all at once",
                "batch": args.batch,
                "threads": args.threads,
            },
            "results": rows,
        },
    )
    if args.replot:
        replot_compare(out)
    print(f"wrote {out}/summary.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
