"""Latency-aware admission under overload: the same offered load with and without targets.

Open-loop Poisson arrivals at several times the server's capacity (chat class: 32-128-token
prompts, 64 output tokens) against three `pagoda serve` processes that share
`--max-queued-requests 16`: the old fixed `--max-num-seqs 256`, the measured default
(pagoda/engine/max_num_seqs.py; the value each server chose is read from `/v1/models`), and the
measured default with `--target-ttft-ms` / `--target-itl-ms`. Reports, for each: requests
admitted and refused (503), the admitted requests' p50/p99 TTFT and TPOT against the targets,
output tok/s, and goodput — requests per second that met both targets (TTFT and mean time per
output token), counting refused ones as missed.

    .venv/bin/python benchmarks/admission_targets.py
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

NAME = "admission_targets"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=str(REPO / "tmp" / "bench-model"))
    parser.add_argument("--out", default=str(RESULTS / NAME))
    parser.add_argument("--num-requests", type=int, default=300)
    parser.add_argument("--request-rate", type=float, default=20.0)
    parser.add_argument("--target-ttft-ms", type=float, default=500.0)
    parser.add_argument("--target-itl-ms", type=float, default=60.0)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    model_dir = build_bench_model(Path(args.model_dir))
    out = Path(args.out)
    meta = {k: v for k, v in metadata(f"{NAME}.py", argv, model_dir).items() if k in META_KEYS}
    targets = ["--target-ttft-ms", str(args.target_ttft_ms), "--target-itl-ms", str(args.target_itl_ms)]
    configs = {"max-num-seqs 256": ["--max-num-seqs", "256"], "no targets": [], "targets": targets}
    slo = f"ttft={args.target_ttft_ms}ms,tpot={args.target_itl_ms}ms"
    rows = {}
    for label, flags in configs.items():
        run_dir = out / label.replace(" ", "_")
        engine = ["--num-threads", str(args.threads), "--max-model-len", "1024", "--max-queued-requests", "16", *flags]
        with pagoda_server(model_dir, engine, run_dir / "server.log") as url:
            max_num_seqs = _served_max_num_seqs(url)
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
                    "chat",
                    "--param",
                    "chat.prompt=uniform:32:128",
                    "--param",
                    "chat.output=64",
                    "--ignore-eos",
                    "--request-rate",
                    str(args.request_rate),
                    "--num-requests",
                    str(args.num_requests),
                    "--slo",
                    slo,
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
        summary = load_results(run_dir / "results.json")["summary"]
        overall = summary["overall"]
        rows[label] = {
            "max_num_seqs": max_num_seqs,
            "admitted": overall["num_ok"],
            "refused": overall["num_requests"] - overall["num_ok"],
            "errors_by_status": overall.get("errors_by_status"),
            "ttft_p50_s": overall["ttft"]["p50"],
            "ttft_p99_s": overall["ttft"]["p99"],
            "tpot_p50_s": overall["tpot"]["p50"],
            "tpot_p99_s": overall["tpot"]["p99"],
            "output_tok_per_s": overall["output_throughput"],
            "goodput_req_per_s": overall["goodput"],
        }
        print(label, rows[label], flush=True)
    write_summary(
        out / "summary.json",
        {
            **meta,
            "workload": {
                "class": "chat",
                "prompt_tokens": "uniform 32-128",
                "output_tokens": 64,
                "arrival": f"Poisson {args.request_rate} req/s",
                "requests": args.num_requests,
                "max_queued_requests": 16,
                "threads": args.threads,
                "targets": {"ttft_ms": args.target_ttft_ms, "itl_ms": args.target_itl_ms},
                "goodput": "requests/s meeting TTFT and TPOT targets",
            },
            "results": rows,
        },
    )
    _plot(out, rows)
    print(f"wrote {out}/summary.json and admission.png")
    return 0


def _served_max_num_seqs(url: str) -> int | None:
    import httpx

    return httpx.get(url + "/v1/models", timeout=10, trust_env=False).json()["data"][0].get("max_num_seqs")


def _plot(out: Path, rows: dict[str, dict]) -> None:
    from pagoda.bench.plots import plot_bars

    plot_bars(
        {
            "admitted TTFT p99 (ms)\n(lower is better)": {k: v["ttft_p99_s"] * 1000 for k, v in rows.items()},
            "admitted TPOT p99 (ms)\n(lower is better)": {k: v["tpot_p99_s"] * 1000 for k, v in rows.items()},
            "goodput (req/s)\n(higher is better)": {k: v["goodput_req_per_s"] or 0.0 for k, v in rows.items()},
            "refused (503)": {k: float(v["refused"]) for k, v in rows.items()},
        },
        out / "admission.png",
        "overload with and without latency targets",
    )


if __name__ == "__main__":
    sys.exit(main())
