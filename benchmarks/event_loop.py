"""How long /health waits while one client sends the server heavy work: a large non-streamed
answer (n 25, logprobs 20), a megabyte /tokenize with token strings, a prompt far over the
context; and how long a connection that sends nothing is held.

Run it from a checkout to measure that checkout (a snapshot of an older commit measures before).
"""

from __future__ import annotations

import argparse
import json
import socket
import sys
import threading
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, build_bench_model, metadata, pagoda_server, write_summary  # noqa: E402

LIPSUM = "lorem ipsum dolor sit amet "
WORKLOADS: list[tuple[str, str, dict[str, Any]]] = [
    (
        "chat n=25 top_logprobs=20 max_tokens=256",
        "/v1/chat/completions",
        {
            "messages": [{"role": "user", "content": "hi"}],
            "n": 25,
            "logprobs": True,
            "top_logprobs": 20,
            "max_tokens": 256,
            "temperature": 1,
            "ignore_eos": True,
        },
    ),
    (
        "completions n=25 logprobs=20 max_tokens=256",
        "/v1/completions",
        {"prompt": "def", "n": 25, "logprobs": 20, "max_tokens": 256, "temperature": 1, "ignore_eos": True},
    ),
    ("/tokenize 1 MB, return_token_strs", "/tokenize", {"prompt": LIPSUM * 40_000, "return_token_strs": True}),
    ("/tokenize 7.5 MB over the context", "/tokenize", {"prompt": "word " * 1_500_000, "return_token_strs": True}),
]


def health_while(url: str, work: Callable[[], httpx.Response]) -> dict[str, Any]:
    """/health latencies (ms) polled while `work` runs, and what `work` got."""
    latencies: list[float] = []
    done = threading.Event()
    outcome: dict[str, httpx.Response] = {}

    def run() -> None:
        try:
            outcome["response"] = work()
        finally:
            done.set()

    worker = threading.Thread(target=run)
    worker.start()
    with httpx.Client(timeout=300) as client:
        while not done.is_set():
            started = time.monotonic()
            client.get(url + "/health")
            latencies.append((time.monotonic() - started) * 1000)
            time.sleep(0.01)
    worker.join()
    response = outcome["response"]
    latencies.sort()
    return {
        "status": response.status_code,
        "body_mb": round(len(response.content) / 1e6, 2),
        "health_samples": len(latencies),
        "health_max_ms": round(max(latencies, default=0), 1),
        "health_p50_ms": round(latencies[len(latencies) // 2], 1) if latencies else None,
    }


def silent_connection_held_s(url: str, limit: float = 60) -> float:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port))) as sock:
        sock.settimeout(limit)
        started = time.monotonic()
        try:
            sock.recv(1)
        except (TimeoutError, ConnectionResetError):
            pass
        return round(time.monotonic() - started, 1)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=RESULTS / "event_loop")
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/pagoda-bench-model"))
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()
    model_dir = build_bench_model(args.model_dir)
    results: dict[str, Any] = {}
    with pagoda_server(model_dir, ["--num-threads", "1", "--max-num-seqs", "32"], args.out / "server.log") as url:
        for label, path, body in WORKLOADS:
            post = partial(httpx.post, url + path, json=body, timeout=300)
            results[label] = [health_while(url, post) for _ in range(args.rounds)]
            print(label, json.dumps(results[label]), flush=True)
        results["silent connection held (s, capped at 60)"] = silent_connection_held_s(url)
        print("silent connection held", results["silent connection held (s, capped at 60)"], "s")
    write_summary(args.out / "summary.json", {**metadata("event_loop.py", sys.argv[1:], model_dir), "results": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
