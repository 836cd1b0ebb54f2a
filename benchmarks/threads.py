"""The engine's threads and OpenMP's wait policy, side by side: what `pagoda serve` should default to.

Four servers of the benchmark model (common.MODEL_SHAPE, float32): torch intra-op threads 1 or every
core available (`--num-threads`), each with OMP_WAIT_POLICY PASSIVE (idle OpenMP workers sleep) or
ACTIVE (they spin). One server runs at a time (a spinning server would steal the cores of the others),
in an order that rotates every round, and each round measures every server:

- c=1 decode: the median inter-token latency of --c1-requests streamed completions, one at a time;
- prefill: the time to first token of one --prefill-tokens prompt (prefill alone on the cores);
- under load: --clients streaming clients in a closed loop for --load-s seconds while /health is
  polled every 20 ms: /health p50 and p99 (how long the HTTP side waits while the engine computes)
  and the output tokens per second.

Reported per server: each measure's median over the rounds with its min-max, and the ratios of the
other servers to "1 thread, PASSIVE". The load average is recorded at the start and at every round:
on a machine shared with other work, compare ratios within a round, not absolute times.

    .venv/bin/python benchmarks/threads.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import RESULTS, build_bench_model, metadata, pagoda_server_process, write_summary  # noqa: E402

POLICIES = ("PASSIVE", "ACTIVE")


def stream_times(client: httpx.Client, url: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival times (perf_counter) of each token event of one streamed completion, the request's
    start first."""
    body = {
        "model": "bench",
        "prompt": prompt,
        "max_tokens": max_tokens,
        "temperature": 0,
        "ignore_eos": True,
        "stream": True,
    }
    times = [time.perf_counter()]
    with client.stream("POST", url + "/v1/completions", json=body) as response:
        response.raise_for_status()
        for line in response.iter_lines():
            if line.startswith("data:") and line.strip() != "data: [DONE]":
                times.append(time.perf_counter())
    return times


def decode_itl_ms(url: str, requests: int, max_tokens: int) -> float:
    """Median inter-token latency (ms) over `requests` completions streamed one at a time."""
    gaps: list[float] = []
    with httpx.Client(timeout=300) as client:
        for i in range(requests):
            times = stream_times(client, url, [5 + i, 17, 29, 41, 53, 65, 77, 89], max_tokens)
            gaps += [(b - a) * 1000 for a, b in zip(times[1:], times[2:])]
    return statistics.median(gaps)


def prefill_ttft_ms(url: str, tokens: int) -> float:
    with httpx.Client(timeout=300) as client:
        times = stream_times(client, url, [(7 * i + 3) % 4000 + 5 for i in range(tokens)], 1)
    return (times[1] - times[0]) * 1000


def health_under_load(url: str, clients: int, seconds: float, max_tokens: int) -> dict[str, float]:
    """/health latencies while `clients` streaming clients keep the engine busy, and their output tok/s."""
    stop = threading.Event()
    tokens = [0] * clients

    def client_loop(index: int) -> None:
        with httpx.Client(timeout=300) as client:
            request = 0
            while not stop.is_set():
                request += 1
                times = stream_times(client, url, [index + 5, request % 97 + 5, 11, 13], max_tokens)
                tokens[index] += len(times) - 1

    workers = [threading.Thread(target=client_loop, args=(i,), daemon=True) for i in range(clients)]
    for worker in workers:
        worker.start()
    latencies: list[float] = []
    with httpx.Client(timeout=60) as health:
        time.sleep(1.0)  # every client's first request is in
        counted = sum(tokens)
        started = time.perf_counter()
        while time.perf_counter() - started < seconds:
            sent = time.perf_counter()
            health.get(url + "/health").raise_for_status()
            latencies.append((time.perf_counter() - sent) * 1000)
            time.sleep(0.02)
        elapsed = time.perf_counter() - started
        output = sum(tokens) - counted
    stop.set()
    for worker in workers:
        worker.join()
    latencies.sort()
    return {
        "health_p50_ms": latencies[len(latencies) // 2],
        "health_p99_ms": latencies[min(len(latencies) - 1, int(0.99 * len(latencies)))],
        "health_samples": len(latencies),
        "output_tok_s": output / elapsed,
    }


def measure(model_dir: Path, threads: int, policy: str, args: argparse.Namespace, log: Path) -> dict[str, float]:
    flags = ["--num-threads", str(threads), "--max-num-seqs", "32", "--kv-cache-memory", "256MiB"]
    with pagoda_server_process(model_dir, flags, log, env={"OMP_WAIT_POLICY": policy}) as (url, _):
        decode_itl_ms(url, 1, 8)  # warm up: first steps pay one-time costs
        return {
            "c1_itl_ms": decode_itl_ms(url, args.c1_requests, args.output_len),
            "prefill_ttft_ms": prefill_ttft_ms(url, args.prefill_tokens),
            **health_under_load(url, args.clients, args.load_s, args.output_len),
        }


def summarize(rounds: list[dict[str, dict[str, float]]]) -> dict[str, Any]:
    """Per server and measure: median, min, max over the rounds; and each median's ratio to the
    baseline server's (1 thread, PASSIVE) in the same round, as a median over rounds."""
    servers = list(rounds[0])
    baseline = servers[0]
    out: dict[str, Any] = {}
    for server in servers:
        out[server] = {}
        for key in rounds[0][server]:
            values = [r[server][key] for r in rounds]
            ratios = [r[server][key] / r[baseline][key] for r in rounds if r[baseline][key]]
            out[server][key] = {
                "median": round(statistics.median(values), 3),
                "min": round(min(values), 3),
                "max": round(max(values), 3),
                "ratio_to_baseline": round(statistics.median(ratios), 3) if ratios else None,
            }
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, default=RESULTS / "threads")
    parser.add_argument("--model-dir", type=Path, default=Path("/tmp/pagoda-bench-model"))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--c1-requests", type=int, default=3)
    parser.add_argument("--output-len", type=int, default=64)
    parser.add_argument("--prefill-tokens", type=int, default=512)
    parser.add_argument("--clients", type=int, default=16)
    parser.add_argument("--load-s", type=float, default=8.0)
    args = parser.parse_args()
    model_dir = build_bench_model(args.model_dir)
    cores = len(os.sched_getaffinity(0))
    servers = [(threads, policy) for threads in sorted({1, cores}) for policy in POLICIES]
    rounds: list[dict[str, dict[str, float]]] = []
    loads: list[tuple[float, float, float]] = []
    for index in range(args.rounds):
        loads.append(os.getloadavg())
        order = servers[index % len(servers) :] + servers[: index % len(servers)]
        measured = {}
        for threads, policy in order:
            name = f"{threads} threads, {policy}"
            measured[name] = measure(model_dir, threads, policy, args, args.out / "server.log")
            print(f"round {index + 1} {name}: {json.dumps({k: round(v, 2) for k, v in measured[name].items()})}")
        rounds.append({f"{t} threads, {p}": measured[f"{t} threads, {p}"] for t, p in servers})
    summary = summarize(rounds)
    for server, measures in summary.items():
        print(server, {key: (m["median"], m["ratio_to_baseline"]) for key, m in measures.items()})
    write_summary(
        args.out / "summary.json",
        {
            **metadata("threads.py", sys.argv[1:], model_dir),
            "cores": cores,
            "load_average_per_round": loads,
            "rounds": rounds,
            "summary": summary,
        },
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
