"""Before vs after a change: the offline and server benchmarks on two revisions, alternating.

Each revision is checked out into a temporary git worktree and runs its own
`benchmarks/server_throughput.py` (one offline pass through `pagoda.LLM` and one server pass
through `pagoda serve` with streaming clients, on the same request list) with its own package
first on PYTHONPATH. Rounds alternate which revision goes first, so a machine that slows down
or speeds up during the run weighs on both alike. Reports, per revision, the median over
rounds of the offline and server output tok/s and server TTFT / ITL p50, and the after/before
ratio of each per round and its median: a change that should not move performance shows
ratios near 1 within the spread between rounds.

    .venv/bin/python benchmarks/before_after.py --before main --after HEAD --rounds 3 \
        --out benchmarks/results/before_after
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import REPO, build_bench_model, metadata, write_summary  # noqa: E402

NAME = "before_after"
SERVER_LABEL_PREFIX = "server"
# Per pass: what server_throughput.py's summary holds, by target label prefix.
FIELDS = {
    "offline_tok_per_s": ("offline", "output_tok_per_s"),
    "server_tok_per_s": (SERVER_LABEL_PREFIX, "output_tok_per_s"),
    "server_ttft_p50_s": (SERVER_LABEL_PREFIX, "ttft_p50_s"),
    "server_itl_p50_s": (SERVER_LABEL_PREFIX, "itl_p50_s"),
}


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", required=True, help="git revision measured as 'before'")
    parser.add_argument("--after", default="HEAD", help="git revision measured as 'after' (default: HEAD)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--num-requests", type=int, default=256)
    parser.add_argument("--concurrency", type=int, default=64)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--model-dir", default=str(REPO / "tmp" / "bench-model"))
    parser.add_argument("--out", default=str(REPO / "benchmarks" / "results" / NAME))
    args = parser.parse_args(argv)

    model_dir = build_bench_model(Path(args.model_dir))
    out = Path(args.out)
    revisions = {"before": _resolve(args.before), "after": _resolve(args.after)}
    meta = metadata(f"{NAME}.py", argv, model_dir)
    rounds: list[dict[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="pagoda-ab-") as scratch:
        trees = {side: _worktree(rev, Path(scratch) / side) for side, rev in revisions.items()}
        try:
            for index in range(args.rounds):
                order = ["before", "after"] if index % 2 == 0 else ["after", "before"]
                results = {}
                for side in order:
                    summary = _run_pass(trees[side], model_dir, args, Path(scratch) / f"round{index + 1}-{side}")
                    results[side] = _fields(summary)
                ratios = {
                    key: results["after"][key] / results["before"][key] for key in FIELDS if results["before"].get(key)
                }
                rounds.append(
                    {
                        "first": order[0],
                        "results": results,
                        "after_over_before": ratios,
                        "load_average": os.getloadavg()[0],
                    }
                )
                print(
                    f"round {index + 1} ({order[0]} first): "
                    + ", ".join(f"{key} {value:.3f}" for key, value in ratios.items()),
                    flush=True,
                )
        finally:
            for tree in trees.values():
                subprocess.run(["git", "worktree", "remove", "--force", str(tree)], cwd=REPO, check=False)
    medians = {
        side: {key: statistics.median(r["results"][side][key] for r in rounds) for key in FIELDS} for side in revisions
    }
    ratio_medians = {
        key: statistics.median(r["after_over_before"][key] for r in rounds) for key in rounds[0]["after_over_before"]
    }
    payload = {
        **meta,
        "revisions": revisions,
        "workload": {
            "requests": args.num_requests,
            "prompt": "uniform 32-256",
            "output": "uniform 32-256",
            "ignore_eos": True,
            "concurrency": args.concurrency,
            "threads": args.threads,
        },
        "medians": medians,
        "after_over_before_median": ratio_medians,
        "rounds": rounds,
    }
    write_summary(out / "summary.json", payload)
    for key, value in ratio_medians.items():
        print(
            f"{key}: before {medians['before'][key]:.4g}, after {medians['after'][key]:.4g}, "
            f"after/before median of rounds {value:.3f}"
        )
    print(f"wrote {out}/summary.json")
    return 0


def _resolve(revision: str) -> str:
    return subprocess.run(
        ["git", "rev-parse", "--short", revision], cwd=REPO, capture_output=True, text=True, check=True
    ).stdout.strip()


def _worktree(revision: str, path: Path) -> Path:
    subprocess.run(["git", "worktree", "add", "--detach", "-q", str(path), revision], cwd=REPO, check=True)
    return path


def _run_pass(tree: Path, model_dir: Path, args: argparse.Namespace, out: Path) -> dict[str, Any]:
    """That revision's own server_throughput.py, importing that revision's package; its summary
    (the per-request records stay in the scratch directory)."""
    command = [
        sys.executable,
        str(tree / "benchmarks" / "server_throughput.py"),
        "--model-dir",
        str(model_dir),
        "--num-requests",
        str(args.num_requests),
        "--concurrency",
        str(args.concurrency),
        "--threads",
        str(args.threads),
        "--out",
        str(out),
    ]
    env = {**os.environ, "PYTHONPATH": str(tree)}
    subprocess.run(command, cwd=tree, env=env, check=True)
    return json.loads((out / "summary.json").read_text())


def _fields(summary: dict[str, Any]) -> dict[str, float]:
    rows = summary["results"]
    values = {}
    for key, (prefix, field) in FIELDS.items():
        label = next(label for label in rows if label.startswith(prefix))
        values[key] = rows[label].get(field)
    return values


if __name__ == "__main__":
    sys.exit(main())
