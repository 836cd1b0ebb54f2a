"""The replica router at fleet scale, by simulation: `pagoda bench route-sim` on the generated
multi-tenant chat trace (8 and 16 tenants per replica) and the RAG trace, at N = 8, 32 and 64
replicas, every router policy. Writes results/route_sim/{TRACE}.json and summary.json, and
checks the issue's target: cache-aware >= 2x round-robin's prefix hit rate at N = 32 on the
chat trace, with load imbalance (max/mean outstanding tokens) <= 1.5.

    .venv/bin/python benchmarks/route_sim.py
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import RESULTS, git_commit, write_summary  # noqa: E402
from pagoda.bench.route_sim import RouteSimOptions, render_table, route_sim  # noqa: E402

NAME = "route_sim"
RUNS = {
    "chat": dict(trace="chat"),
    "chat-16-tenants": dict(trace="chat", tenants_per_replica=16),
    "rag": dict(trace="rag"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", default=str(RESULTS / NAME))
    parser.add_argument("--replicas", default="8,32,64")
    parser.add_argument("--requests-per-replica", type=int, default=150)
    args = parser.parse_args(argv)
    out = Path(args.out)
    summary: dict = {
        "command": " ".join([".venv/bin/python", f"benchmarks/{NAME}.py", *argv]),
        "git_commit": git_commit(),
        "runs": {},
    }
    for name, run in RUNS.items():
        report = route_sim(
            RouteSimOptions(
                replicas=[int(n) for n in args.replicas.split(",")],
                requests_per_replica=args.requests_per_replica,
                out=None,
                **run,
            )
        )
        out.mkdir(parents=True, exist_ok=True)
        (out / f"{name}.json").write_text(json.dumps(report, indent=2) + "\n")
        print(f"## {name}\n{render_table(report)}\n", flush=True)
        summary["runs"][name] = {
            f"{r['policy']}@{r['num_replicas']}": {
                k: round(r[k], 4) for k in ("hit_rate", "imbalance", "ttft_p50_s", "ttft_p99_s")
            }
            for r in report["results"]
        }
    chat = summary["runs"]["chat"]
    if "cache_aware@32" in chat:
        ratio = chat["cache_aware@32"]["hit_rate"] / chat["round_robin@32"]["hit_rate"]
        summary["target_n32"] = {
            "hit_rate_ratio_cache_aware_over_round_robin": round(ratio, 3),
            "cache_aware_imbalance": chat["cache_aware@32"]["imbalance"],
        }
        print(
            f"N=32 chat: cache-aware / round-robin hit rate {ratio:.2f}x (target >= 2), "
            f"imbalance {chat['cache_aware@32']['imbalance']:.2f} (target <= 1.5)"
        )
    write_summary(out / "summary.json", summary)
    return 0


if __name__ == "__main__":
    sys.exit(main())
