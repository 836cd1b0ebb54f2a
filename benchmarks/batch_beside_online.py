"""The Batch API beside online traffic: online inter-token latency with and without a batch running.

One `pagoda serve` (--scheduling-policy priority, a fresh --batch-store) answers the same
closed-loop online load (`--streams` concurrent streamed chat requests, 64 output tokens) twice:
alone, then while a `--batch-lines`-request batch (chat lines, 64 output tokens each) runs. Reports
the online ITL p50/p99 and output tok/s of each run, their ratio (issue 49's target: p99 within
1.2x), and how many batch lines completed during the loaded run (the batch is not starved).

    .venv/bin/python benchmarks/batch_beside_online.py              # 1,000 lines beside 16 streams
    .venv/bin/python benchmarks/batch_beside_online.py --batch-lines 40 --streams 4 --num-requests 8
"""

from __future__ import annotations

import argparse
import io
import json
import os
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

NAME = "batch_beside_online"


def _online(url: str, model_dir: Path, args: argparse.Namespace, run_dir: Path, label: str) -> dict:
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
            "--concurrency",
            str(args.streams),
            "--num-requests",
            str(args.num_requests),
            "--seed",
            "0",
            "--label",
            label,
            "--no-progress",
            "--out",
            str(run_dir),
        ]
    )
    if rc:
        raise SystemExit(rc)
    overall = load_results(run_dir / "results.json")["summary"]["overall"]
    return {
        "itl_p50_s": overall["itl"]["p50"],
        "itl_p99_s": overall["itl"]["p99"],
        "output_tok_per_s": overall["output_throughput"],
        "ok": overall["num_ok"],
        "load_average_after": list(os.getloadavg()),  # the machine is shared: how busy it was
    }


def main(argv: list[str] | None = None) -> int:
    import openai

    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=str(REPO / "tmp" / "bench-model"))
    parser.add_argument("--out", default=str(RESULTS / NAME))
    parser.add_argument("--batch-lines", type=int, default=1000)
    parser.add_argument("--streams", type=int, default=16)
    parser.add_argument("--num-requests", type=int, default=64, help="online requests per run")
    parser.add_argument("--batch-concurrency", type=int, default=4)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args(argv)

    model_dir = build_bench_model(Path(args.model_dir))
    out = Path(args.out)
    meta = {k: v for k, v in metadata(f"{NAME}.py", argv, model_dir).items() if k in META_KEYS}
    with tempfile.TemporaryDirectory() as state:
        engine = [
            "--num-threads",
            str(args.threads),
            "--max-model-len",
            "1024",
            "--scheduling-policy",
            "priority",
            "--batch-store",
            str(Path(state) / "batches.sqlite"),
            "--batch-concurrency",
            str(args.batch_concurrency),
        ]
        with pagoda_server(model_dir, engine, out / "server.log") as url:
            alone = _online(url, model_dir, args, out / "alone", "online alone")
            sdk = openai.OpenAI(base_url=url + "/v1", api_key="none")
            body = {
                "model": "bench",
                "messages": [{"role": "user", "content": "write"}],
                "max_tokens": 64,
                "ignore_eos": True,
            }
            lines = "".join(
                json.dumps({"custom_id": f"b{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n"
                for i in range(args.batch_lines)
            )
            file = sdk.files.create(file=("batch.jsonl", io.BytesIO(lines.encode())), purpose="batch")
            batch = sdk.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
            started = sdk.batches.retrieve(batch.id).request_counts.completed
            beside = _online(url, model_dir, args, out / "beside_batch", "online beside a batch")
            progress = sdk.batches.retrieve(batch.id)
            sdk.batches.cancel(batch.id)
    (out / "server.log").unlink(missing_ok=True)
    ratio = beside["itl_p99_s"] / alone["itl_p99_s"] if alone["itl_p99_s"] else None
    rows = {
        "alone": alone,
        "beside_batch": beside,
        "itl_p99_ratio": ratio,
        "batch_lines_completed_meanwhile": progress.request_counts.completed - started,
        "batch_status": progress.status,
    }
    write_summary(out / "summary.json", {"meta": meta, "rows": rows})
    print(json.dumps(rows, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
