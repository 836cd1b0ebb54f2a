"""Chunked prefill on vs off: inter-token latency of running decodes while long prompts arrive.

Traffic through `pagoda serve`: `chat` requests (32-64 token prompts, 64 output tokens) keep a
handful of sequences decoding while `summarize` requests with 1024-token prompts (8 output
tokens) arrive among them, open-loop (Poisson). Without chunking a long prompt is computed in
one step and every running decode waits for it; with chunking each step computes at most a
budget of tokens (each of --budgets is tried). Every server gets the same request list.
Reported: the chat class's ITL p50/p99/max and TTFT p99, and the long prompts' TTFT.

    .venv/bin/python benchmarks/chunked_prefill.py
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

NAME = "chunked_prefill"


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=str(REPO / "tmp" / "bench-model"))
    parser.add_argument("--out", default=str(RESULTS / NAME))
    parser.add_argument("--num-requests", type=int, default=80)
    parser.add_argument("--request-rate", type=float, default=2.0)
    parser.add_argument("--budgets", default="128,256", help="token budgets per step to try with chunking on")
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--replot", action="store_true", help="only redo summary.json and plots from results")
    args = parser.parse_args(argv)

    model_dir = build_bench_model(Path(args.model_dir))
    out = Path(args.out)
    meta = load_results(out / "summary.json") if args.replot else metadata(f"{NAME}.py", argv, model_dir)
    meta = {k: meta[k] for k in META_KEYS if k in meta}
    budgets = [int(b) for b in args.budgets.split(",") if b.strip()]
    configs = {
        f"chunked prefill on (budget {b})": (
            f"on-{b}",
            ["--enable-chunked-prefill", "--max-num-batched-tokens", str(b)],
        )
        for b in budgets
    }
    configs["chunked prefill off (budget 2048)"] = (
        "off",
        ["--no-enable-chunked-prefill", "--max-num-batched-tokens", "2048"],
    )
    for label, (sub, flags) in configs.items():
        if args.replot:
            break
        run_dir = out / sub
        engine = ["--num-threads", str(args.threads), "--max-model-len", "2048", "--no-enable-prefix-caching", *flags]
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
                    "chat=0.75,summarize=0.25",
                    "--param",
                    "chat.prompt=uniform:32:64",
                    "--param",
                    "chat.output=64",
                    "--param",
                    "summarize.prompt=1024",
                    "--param",
                    "summarize.output=8",
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
    for label, (sub, _) in configs.items():
        s = load_results(out / sub / "results.json")["summary"]
        classes = {c["name"]: c for c in s["per_class"]}
        chat, summ = classes["chat"], classes["summarize"]
        rows[label] = {
            "chat_itl_p50_s": chat["itl"]["p50"],
            "chat_itl_p99_s": chat["itl"]["p99"],
            "chat_itl_max_s": chat["itl"]["max"],
            "chat_tpot_p50_s": chat["tpot"]["p50"],
            "chat_e2e_p99_s": chat["e2e"]["p99"],
            "chat_ttft_p99_s": chat["ttft"]["p99"],
            "summarize_ttft_p50_s": summ["ttft"]["p50"],
            "summarize_ttft_p99_s": summ["ttft"]["p99"],
            "output_tok_per_s": s["overall"]["output_throughput"],
            "ok": s["overall"]["num_ok"],
        }
    write_summary(
        out / "summary.json",
        {
            **meta,
            "workload": {
                "mix": "chat 0.75 (prompt 32-64, output 64), summarize 0.25 (prompt 1024, output 8)",
                "arrival": f"Poisson {args.request_rate} req/s",
                "requests": args.num_requests,
                "threads": args.threads,
                "prefix_caching": "off",
            },
            "results": rows,
        },
    )
    _plot(out, rows, [sub for sub, _ in configs.values()])
    print(f"wrote {out}/summary.json, itl.png, cdf.png")
    return 0


def _plot(out: Path, rows: dict[str, dict], subdirs: list[str]) -> None:
    from pagoda.bench.plots import plot_bars, plot_target_cdfs
    from pagoda.bench.records import records_from_json

    plot_bars(
        {
            "chat ITL p99 (ms)": {k: v["chat_itl_p99_s"] * 1000 for k, v in rows.items()},
            "chat ITL max (ms)": {k: v["chat_itl_max_s"] * 1000 for k, v in rows.items()},
            "chat TTFT p99 (ms)": {k: v["chat_ttft_p99_s"] * 1000 for k, v in rows.items()},
            "long-prompt TTFT p50 (ms)": {k: v["summarize_ttft_p50_s"] * 1000 for k, v in rows.items()},
        },
        out / "itl.png",
        "decodes while 1024-token prompts arrive",
    )

    chat = {
        label: [
            r for r in records_from_json(load_results(out / sub / "results.json")["requests"]) if r.class_name == "chat"
        ]
        for label, sub in zip(rows, subdirs)
    }
    plot_target_cdfs(chat, out / "cdf.png", "chat requests while 1024-token prompts arrive", metrics=("itl", "e2e"))


if __name__ == "__main__":
    sys.exit(main())
