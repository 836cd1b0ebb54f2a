"""Prefix caching on vs off on the `rag` class, through `pagoda serve` over HTTP.

RAG traffic: every prompt is one of 4 shared documents (512 tokens) plus a short question
(16-48 tokens); outputs are 16 tokens. Requests arrive open-loop (Poisson) at the same rate
against two servers that differ only in --enable-prefix-caching, one after the other, with
the same request list. Reports TTFT p50/p99 and the server's prefix-cache hit rate (from
/metrics).

    .venv/bin/python benchmarks/prefix_caching.py
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
    pagoda_server,
    write_summary,
)

NAME = "prefix_caching"
CONFIGS = {"prefix caching on": ["--enable-prefix-caching"], "prefix caching off": ["--no-enable-prefix-caching"]}
SUBDIRS = ("on", "off")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=str(REPO / "tmp" / "bench-model"))
    parser.add_argument("--out", default=str(RESULTS / NAME))
    parser.add_argument("--num-requests", type=int, default=60)
    parser.add_argument("--request-rate", type=float, default=1.5)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--replot", action="store_true", help="only redo summary.json and plots from results")
    args = parser.parse_args(argv)

    model_dir = build_bench_model(Path(args.model_dir))
    out = Path(args.out)
    meta = load_results(out / "summary.json") if args.replot else metadata(f"{NAME}.py", argv, model_dir)
    meta = {k: meta[k] for k in META_KEYS if k in meta}
    for i, (label, flags) in enumerate(CONFIGS.items()):
        if args.replot:
            break
        run_dir = out / SUBDIRS[i]
        engine = ["--num-threads", str(args.threads), "--max-model-len", "2048", *flags]
        with pagoda_server(model_dir, engine, run_dir / "server.log") as url:
            rc = bench(
                [
                    "serve",
                    "--base-url",
                    url,
                    "--model",
                    "bench",
                    "--tokenizer",
                    str(model_dir),
                    "--mix",
                    "rag",
                    "--param",
                    "rag.docs=4",
                    "--param",
                    "rag.doc=512",
                    "--param",
                    "rag.question=uniform:16:48",
                    "--param",
                    "rag.output=16",
                    "--ignore-eos",
                    "--request-rate",
                    str(args.request_rate),
                    "--num-requests",
                    str(args.num_requests),
                    "--warmup",
                    "2",
                    "--seed",
                    "0",
                    "--label",
                    label,
                    "--no-progress",
                    "--out",
                    str(run_dir),
                ]
            )
        (run_dir / "server.log").unlink(missing_ok=True)
        if rc:
            return rc

    rows = {}
    for label, sub in zip(CONFIGS, SUBDIRS):
        s = load_results(out / sub / "results.json")["summary"]
        o = s["overall"]
        rows[label] = {
            "ttft_p50_s": o["ttft"]["p50"],
            "ttft_p99_s": o["ttft"]["p99"],
            "e2e_p50_s": o["e2e"]["p50"],
            "e2e_p99_s": o["e2e"]["p99"],
            "output_tok_per_s": o["output_throughput"],
            "ok": o["num_ok"],
            "prefix_cache_hit_rate": s["server"]["prefix_cache_hit_rate"] if s["server"] else None,
            "queue_time_mean_s": s["server"]["queue_time_mean"] if s["server"] else None,
        }
    on, off = rows["prefix caching on"], rows["prefix caching off"]
    speedup = {"ttft_p50": off["ttft_p50_s"] / on["ttft_p50_s"], "ttft_p99": off["ttft_p99_s"] / on["ttft_p99_s"]}
    write_summary(
        out / "summary.json",
        {
            **meta,
            "workload": {
                "class": "rag",
                "documents": 4,
                "document_tokens": 512,
                "question_tokens": "uniform 16-48",
                "output_tokens": 16,
                "arrival": f"Poisson {args.request_rate} req/s",
                "requests": args.num_requests,
                "threads": args.threads,
            },
            "results": rows,
            "ttft_off_over_on": speedup,
        },
    )
    _plot(out, rows)
    print(f"wrote {out}/summary.json, ttft.png, cdf.png")
    return 0


def _plot(out: Path, rows: dict[str, dict]) -> None:
    from pagoda.bench.plots import plot_bars, plot_target_cdfs
    from pagoda.bench.records import records_from_json

    plot_bars(
        {
            "TTFT p50 (ms)": {k: v["ttft_p50_s"] * 1000 for k, v in rows.items()},
            "TTFT p99 (ms)": {k: v["ttft_p99_s"] * 1000 for k, v in rows.items()},
            "prefix cache hit rate": {k: v["prefix_cache_hit_rate"] or 0.0 for k, v in rows.items()},
        },
        out / "ttft.png",
        "rag class: 4 shared 512-token documents, Poisson arrivals",
    )

    runs = {
        label: records_from_json(load_results(out / sub / "results.json")["requests"])
        for label, sub in zip(rows, SUBDIRS)
    }
    plot_target_cdfs(runs, out / "cdf.png", "rag class: latency CDFs, prefix caching on vs off")


if __name__ == "__main__":
    sys.exit(main())
