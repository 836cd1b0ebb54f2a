"""Overload: how fast a flood of simultaneous requests is refused.

Starts `pagoda serve` with a small queue (`--max-queued-requests 16`), then opens N connections
at once (default 600) and sends one completion request on each. The server admits what fits
and answers the rest 503; the 503s must come back at once, not after the admitted requests'
tokenizing. Reports the end-to-end latency of the 503s as the client saw them (connect, send,
whole answer; p50/p99 with pagoda.stats.percentile), the server's own time per refusal (the
`pagoda:request_refusal_seconds` histogram: mean, and p50/p99 from its buckets) and the server
process's CPU time per request over a flood (HTTP parsing and writes included).

The same client floods a bare asyncio server that answers 503 at once (its own process): what
this machine and client cost with no server work at all, the floor to compare against. The
two are flooded in alternating rounds (bare, pagoda, bare, pagoda...) and the medians and
their ratio reported, since the machine's load drifts between runs. The client is raw asyncio
streams, so that its own per-request cost stays small next to what it measures.

    .venv/bin/python benchmarks/overload.py [--num-requests 600] [--max-queued-requests 16] [--rounds 3]

Writes `benchmarks/results/overload/summary.json` (command, commit, machine, load average).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import META_KEYS, PYTHON, REPO, RESULTS, build_bench_model, metadata, pagoda_server_process, write_summary  # noqa: E402
from pagoda.http_client.server_process import free_port  # noqa: E402
from pagoda.stats import histogram_quantile, percentile  # noqa: E402

NAME = "overload"
REFUSAL_METRIC = "pagoda:request_refusal_seconds"

# A server that answers every request 503 at once, with no parsing beyond the headers.
BARE_SERVER = """
import asyncio, sys
BODY = b'{"error": {"message": "overloaded"}}'
RESPONSE = (b"HTTP/1.1 503 Service Unavailable\\r\\ncontent-type: application/json\\r\\n"
            b"content-length: " + str(len(BODY)).encode() + b"\\r\\nconnection: close\\r\\n\\r\\n" + BODY)
async def handle(reader, writer):
    try:
        head = await reader.readuntil(b"\\r\\n\\r\\n")
        length = next((int(l.split(b":")[1]) for l in head.split(b"\\r\\n")
                       if l.lower().startswith(b"content-length:")), 0)
        await reader.readexactly(length)
        writer.write(RESPONSE)
        await writer.drain()
    finally:
        writer.close()
async def main():
    server = await asyncio.start_server(handle, "127.0.0.1", int(sys.argv[1]), backlog=4096)
    async with server:
        await server.serve_forever()
asyncio.run(main())
"""


@dataclass
class Outcome:
    status: int  # 0: no answer (connection error)
    seconds: float


async def one_request(port: int, body: bytes, start: asyncio.Event) -> Outcome:
    await start.wait()
    began = time.perf_counter()
    try:
        reader, writer = await asyncio.open_connection("127.0.0.1", port)
        writer.write(
            b"POST /v1/completions HTTP/1.1\r\nhost: 127.0.0.1\r\n"
            b"content-type: application/json\r\nconnection: close\r\n"
            b"content-length: " + str(len(body)).encode() + b"\r\n\r\n" + body
        )
        await writer.drain()
        head = await reader.readuntil(b"\r\n\r\n")
        status = int(head.split(b" ", 2)[1])
        length = re.search(rb"(?i)\r\ncontent-length:\s*(\d+)", head)
        if length is not None:
            await reader.readexactly(int(length.group(1)))
        else:
            await reader.read()
        writer.close()
        return Outcome(status, time.perf_counter() - began)
    except (OSError, asyncio.IncompleteReadError, ValueError):
        return Outcome(0, time.perf_counter() - began)


async def flood(port: int, num_requests: int, body: bytes) -> list[Outcome]:
    start = asyncio.Event()
    tasks = [asyncio.create_task(one_request(port, body, start)) for _ in range(num_requests)]
    await asyncio.sleep(0.1)  # every task waits on the event: all start together
    start.set()
    return await asyncio.gather(*tasks)


def summarize(outcomes: list[Outcome]) -> dict[str, Any]:
    by_status: dict[str, int] = {}
    for outcome in outcomes:
        by_status[str(outcome.status)] = by_status.get(str(outcome.status), 0) + 1
    refused = [o.seconds for o in outcomes if o.status == 503]
    admitted = [o.seconds for o in outcomes if o.status == 200]

    def ms(values: list[float], q: float) -> float | None:
        value = percentile(values, q)
        return round(value * 1000, 1) if value is not None else None

    return {
        "statuses": by_status,
        "refused_e2e_ms": {"p50": ms(refused, 50), "p99": ms(refused, 99), "max": ms(refused, 100)},
        "admitted_e2e_ms": {"p50": ms(admitted, 50), "p99": ms(admitted, 99)},
    }


def refusal_histogram(metrics_text: str, reason: str = "overloaded") -> dict[str, Any]:
    """The server's refusal-time histogram for `reason`: count, mean, p50 and p99 (ms)."""
    buckets: list[tuple[float, float]] = []
    total = count = 0.0
    label = f'reason="{reason}"'
    for line in metrics_text.splitlines():
        if not line.startswith(REFUSAL_METRIC) or label not in line:
            continue
        name, value = line.rsplit(" ", 1)
        if name.startswith(REFUSAL_METRIC + "_bucket"):
            bound = re.search(r'le="([^"]+)"', name).group(1)
            buckets.append((float("inf") if bound == "+Inf" else float(bound), float(value)))
        elif name.startswith(REFUSAL_METRIC + "_sum"):
            total = float(value)
        elif name.startswith(REFUSAL_METRIC + "_count"):
            count = float(value)

    def ms(value: float | None) -> float | None:
        return round(value * 1000, 3) if value is not None else None

    return {
        "count": int(count),
        "mean_ms": ms(total / count) if count else None,
        "p50_ms": ms(histogram_quantile(0.5, buckets)),
        "p99_ms": ms(histogram_quantile(0.99, buckets)),
    }


def request_body(max_tokens: int) -> bytes:
    return json.dumps(
        {"model": "bench", "prompt": "def overload(request):\n    return", "max_tokens": max_tokens, "ignore_eos": True}
    ).encode()


def process_cpu_seconds(pid: int) -> float:
    """User plus system CPU time of process `pid` so far (every thread of it, no children)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def median(values: list[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return round(percentile(present, 50), 1) if present else None


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=str(REPO / "tmp" / "bench-model"))
    parser.add_argument("--out", default=str(RESULTS / NAME))
    parser.add_argument("--num-requests", type=int, default=600)
    parser.add_argument("--max-queued-requests", type=int, default=16)
    parser.add_argument("--max-tokens", type=int, default=16)
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument(
        "--rounds", type=int, default=3, help="floods of each server, alternating bare and pagoda; medians are reported"
    )
    args = parser.parse_args(argv)

    import httpx

    model_dir = build_bench_model(Path(args.model_dir))
    out = Path(args.out)
    meta = {k: v for k, v in metadata(f"{NAME}.py", argv, model_dir).items() if k in META_KEYS}
    body = request_body(args.max_tokens)

    bare_port = free_port()
    engine = [
        "--num-threads",
        str(args.threads),
        "--max-model-len",
        "1024",
        "--max-queued-requests",
        str(args.max_queued_requests),
    ]
    rounds: list[dict[str, Any]] = []
    with (
        subprocess.Popen([PYTHON, "-c", BARE_SERVER, str(bare_port)]) as bare,
        pagoda_server_process(model_dir, engine, out / "server.log") as (url, server),
    ):
        try:
            pagoda_port = int(url.rsplit(":", 1)[1])
            time.sleep(1.0)
            for index in range(args.rounds):
                baseline = summarize(asyncio.run(flood(bare_port, args.num_requests, body)))
                print(f"round {index + 1} bare asyncio 503 server:", json.dumps(baseline), flush=True)
                cpu_before = process_cpu_seconds(server.pid)
                outcomes = asyncio.run(flood(pagoda_port, args.num_requests, body))
                cpu = process_cpu_seconds(server.pid) - cpu_before
                result = summarize(outcomes)
                result["server_cpu_ms_per_request"] = round(cpu * 1000 / args.num_requests, 3)
                print(f"round {index + 1} pagoda serve:", json.dumps(result), flush=True)
                rounds.append({"bare_asyncio_503": baseline, "pagoda": result, "load_average": os.getloadavg()})
            metrics_text = httpx.get(url + "/metrics", timeout=30).text
        finally:
            bare.terminate()
    (out / "server.log").unlink(missing_ok=True)

    def medians(side: str, key: str) -> dict[str, float | None]:
        return {q: median([r[side][key][q] for r in rounds]) for q in ("p50", "p99")}

    bare_ms, pagoda_ms = medians("bare_asyncio_503", "refused_e2e_ms"), medians("pagoda", "refused_e2e_ms")
    summary = {
        "bare_asyncio_503_refused_e2e_ms": bare_ms,
        "pagoda_refused_e2e_ms": pagoda_ms,
        "p99_ratio_to_bare": (
            round(pagoda_ms["p99"] / bare_ms["p99"], 2) if pagoda_ms["p99"] and bare_ms["p99"] else None
        ),
        "pagoda_admitted_e2e_ms": medians("pagoda", "admitted_e2e_ms"),
        "server_cpu_ms_per_request": median([r["pagoda"]["server_cpu_ms_per_request"] for r in rounds]),
        "server_refusal_time": refusal_histogram(metrics_text),
    }
    print("medians:", json.dumps(summary), flush=True)
    write_summary(
        out / "summary.json",
        {
            **meta,
            "num_requests": args.num_requests,
            "max_queued_requests": args.max_queued_requests,
            "max_tokens": args.max_tokens,
            "threads": args.threads,
            "rounds": args.rounds,
            **summary,
            "per_round": rounds,
            "load_average_at_end": os.getloadavg(),
            "note": "medians over alternating rounds (bare server, then pagoda, each round); "
            "server_refusal_time: pagoda's own histogram over every round, from the fast "
            "refusal's entry to the answer handed to the HTTP server; server_cpu_ms_per_request: "
            "the server process's CPU time over one flood (HTTP parsing and writes included, "
            "the engine runs in its own process) divided by the requests sent; one shared "
            "2-core machine: the client, the server and other agents' work compete for the same "
            "cores; see the load averages",
        },
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
