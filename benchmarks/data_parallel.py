"""Data-parallel replicas vs one engine on the same two cores: does `--data-parallel-size 2`
(two engine processes, one torch thread each) serve more than one engine with two threads?

Each round starts `pagoda serve` twice, one configuration after the other (the order
alternates between rounds), and drives it with the same closed-loop streaming workload
(`pagoda bench serve`, prompts uniform 32-256 tokens, 64 output tokens, ignore_eos). Reports
output tok/s and TTFT / ITL percentiles per configuration, the median over rounds, and the
ratio DP=2 / DP=1 of the per-round medians.

    .venv/bin/python benchmarks/data_parallel.py --rounds 5
"""

from __future__ import annotations

import argparse
import statistics
import sys
import tempfile
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

NAME = "data_parallel"
CONFIGS = {
    "DP=1, 2 threads": ["--data-parallel-size", "1", "--num-threads", "2"],
    "DP=2, 1 thread each": ["--data-parallel-size", "2", "--num-threads", "1"],
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=str(REPO / "tmp" / "bench-model"))
    parser.add_argument("--out", default=str(RESULTS / NAME))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=96)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args(argv)

    model_dir = build_bench_model(Path(args.model_dir))
    out = Path(args.out)
    meta = {k: v for k, v in metadata(f"{NAME}.py", argv, model_dir).items() if k in META_KEYS}
    rounds: list[dict[str, dict[str, float]]] = []
    for round_index in range(args.rounds):
        order = list(CONFIGS) if round_index % 2 == 0 else list(reversed(CONFIGS))
        row = {}
        for label in order:
            engine = [*CONFIGS[label], "--max-num-seqs", str(args.concurrency), "--max-model-len", "1024"]
            with (
                tempfile.TemporaryDirectory() as scratch,
                pagoda_server(model_dir, engine, Path(scratch) / "server.log") as url,
            ):
                run_out = Path(scratch) / "run"
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
                        "chat.prompt=uniform:32:256",
                        "--param",
                        "chat.output=uniform:64:64",
                        "--max-model-len",
                        "1024",
                        "--num-requests",
                        str(args.num_requests),
                        "--concurrency",
                        str(args.concurrency),
                        "--ignore-eos",
                        "--warmup",
                        "4",
                        "--seed",
                        str(round_index),
                        "--no-progress",
                        "--label",
                        label,
                        "--out",
                        str(run_out),
                    ]
                )
                if rc:
                    return rc
                overall = load_results(run_out / "results.json")["summary"]["overall"]
            row[label] = {
                "output_tok_per_s": overall["output_throughput"],
                "ttft_p50_s": overall["ttft"]["p50"],
                "ttft_p99_s": overall["ttft"]["p99"],
                "itl_p50_s": overall["itl"]["p50"],
                "itl_p99_s": overall["itl"]["p99"],
            }
            print(f"round {round_index + 1} {label}: {row[label]['output_tok_per_s']:.0f} output tok/s", flush=True)
        rounds.append(row)
    medians = {
        label: {key: statistics.median(r[label][key] for r in rounds) for key in rounds[0][label]} for label in CONFIGS
    }
    dp1, dp2 = list(CONFIGS)
    ratios = [r[dp2]["output_tok_per_s"] / r[dp1]["output_tok_per_s"] for r in rounds]
    write_summary(
        out / "summary.json",
        {
            **meta,
            "workload": {
                "requests": args.num_requests,
                "prompt": "uniform 32-256",
                "output": 64,
                "ignore_eos": True,
                "concurrency": args.concurrency,
                "max_num_seqs": args.concurrency,
            },
            "rounds": rounds,
            "median": medians,
            "dp2_over_dp1_per_round": ratios,
            "dp2_over_dp1_median": statistics.median(ratios),
        },
    )
    print(
        f"DP=2 / DP=1 output throughput per round: {', '.join(f'{x:.2f}' for x in ratios)}; "
        f"median {statistics.median(ratios):.2f}; wrote {out}/summary.json"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
