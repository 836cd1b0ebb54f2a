"""Server vs offline engine: does HTTP streaming cost throughput?

The offline engine's workload (prompts and outputs uniform in [32, 256] tokens, ignore_eos)
runs twice on one request list, back to back: in-process through `pagoda.LLM`, and through
`pagoda serve` (its default engine process) with 64 concurrent streaming clients. Both
engines run 64 sequences at most and the same number of torch threads, so the ratio is what
the HTTP side costs. Reports output tok/s of both, and TTFT / ITL p50 and p99 of the server.

    .venv/bin/python benchmarks/server_throughput.py
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import (META_KEYS, REPO, RESULTS, bench, build_bench_model, load_results, metadata,  # noqa: E402
                    pagoda_server, write_summary)

NAME = "server_throughput"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=str(REPO / "tmp" / "bench-model"))
    parser.add_argument("--out", default=str(RESULTS / NAME))
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    model_dir = build_bench_model(Path(args.model_dir))
    out = Path(args.out)
    meta = {k: v for k, v in metadata(f"{NAME}.py", argv, model_dir).items() if k in META_KEYS}
    engine = ["--num-threads", str(args.threads), "--max-num-seqs", str(args.concurrency), "--max-model-len", "1024"]
    with pagoda_server(model_dir, engine, out / "server.log") as url:
        rc = bench(["compare", "--model", str(model_dir), "--num-threads", str(args.threads),
                    "--mix", "chat", "--param", "chat.prompt=uniform:32:256", "--param", "chat.output=uniform:32:256",
                    "--max-model-len", "1024", "--num-requests", str(args.num_requests), "--warmup", "4",
                    "--concurrency", str(args.concurrency), "--seed", "0", "--no-progress", "--out", str(out),
                    f"--target=pagoda:max_num_seqs={args.concurrency},label=offline engine",
                    f"--target=http:url={url},model=bench,label=server ({args.concurrency} streams)"])
    (out / "server.log").unlink(missing_ok=True)
    if rc:
        return rc

    rows = {}
    for run in load_results(out / "results.json")["runs"]:
        summary = run["summary"]
        overall = summary["overall"]
        row = {"seconds": summary["duration"], "output_tok_per_s": overall["output_throughput"],
               "ttft_p50_s": overall["ttft"]["p50"], "ttft_p99_s": overall["ttft"]["p99"]}
        if overall.get("itl"):
            row.update(itl_p50_s=overall["itl"]["p50"], itl_p99_s=overall["itl"]["p99"])
        rows[summary["target"]] = row
    offline, server = rows["offline engine"], rows[f"server ({args.concurrency} streams)"]
    ratio = server["output_tok_per_s"] / offline["output_tok_per_s"]
    write_summary(out / "summary.json", {**meta, "workload": {
        "requests": args.num_requests, "prompt": "uniform 32-256", "output": "uniform 32-256", "ignore_eos": True,
        "concurrency": args.concurrency, "max_num_seqs": args.concurrency, "threads": args.threads},
        "results": rows, "server_over_offline_throughput": ratio})
    print(f"server / offline output throughput: {ratio:.2f}; wrote {out}/summary.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
