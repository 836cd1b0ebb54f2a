"""Prefill/decode disaggregation vs one co-located engine on the same two cores.

Workload (pagoda.bench.mixed_load, seeded, the same for every configuration): --streams chat
clients decode continuously (prompts uniform 56-72 tokens, 128 output tokens, closed loop)
while long-prompt RAG requests (prompts uniform 1400-1600 tokens, 16 output tokens) arrive as
a Poisson process at --rag-rate per second, for --duration seconds. ignore_eos, greedy.
Chunked prefill is on in every configuration, with the same --max-num-batched-tokens budget.

Configurations (each its own `pagoda serve`; rounds interleave them, the order rotating):
- co-located, 2 threads / 1 thread: one engine, `--num-threads 2` / `1`, not pinned.
- disaggregated tcp / shm: `--replica-roles prefill=1,decode=1 --kv-transport T --num-threads 1`;
  the prefill engine process (all its threads) pinned to core 0, the decode engine to core 1
  (the pids come from GET /health).
The HTTP front and this load generator run unpinned on the same two cores in every configuration.

Reported per configuration (median over rounds, min and max): chat ITL p50/p99 (every gap),
TTFT p50/p99 of chat and RAG, total output tok/s, goodput under per-class SLOs (TTFT and the
request's own ITL p99), and for the disaggregated runs from /metrics: handoffs, bytes per
handoff and the mean of each TTFT phase (queue, prefill, transfer, first decode).

    .venv/bin/python benchmarks/disaggregation.py --rounds 3
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import META_KEYS, REPO, RESULTS, build_bench_model, metadata, pagoda_server_process, write_summary  # noqa: E402

NAME = "disaggregation"
COLOCATED_2T, COLOCATED_1T = "co-located, 2 threads", "co-located, 1 thread"
DISAGG_TCP, DISAGG_SHM = "disaggregated, tcp", "disaggregated, shm"
CONFIGS: dict[str, list[str]] = {
    COLOCATED_2T: ["--num-threads", "2"],
    COLOCATED_1T: ["--num-threads", "1"],
    DISAGG_TCP: ["--replica-roles", "prefill=1,decode=1", "--kv-transport", "tcp", "--num-threads", "1"],
    DISAGG_SHM: ["--replica-roles", "prefill=1,decode=1", "--kv-transport", "shm", "--num-threads", "1"],
}
CONFIG_KEYS = {
    "colocated-2t": COLOCATED_2T,
    "colocated-1t": COLOCATED_1T,
    "disagg-tcp": DISAGG_TCP,
    "disagg-shm": DISAGG_SHM,
}
ROLE_CORES = {"prefill": 0, "decode": 1}
# The numbers compared in the summary: (row key, lower is better).
HEADLINE = (
    ("chat_itl_p50_s", True),
    ("chat_itl_p99_s", True),
    ("chat_ttft_p50_s", True),
    ("chat_ttft_p99_s", True),
    ("rag_ttft_p50_s", True),
    ("rag_ttft_p99_s", True),
    ("output_tok_per_s", False),
    ("goodput_req_per_s", False),
    ("chat_goodput_req_per_s", False),
    ("rag_goodput_req_per_s", False),
)


def pin_engines(url: str) -> dict[str, dict[str, Any]]:
    """Pin every thread of each role's engine process to its core; returns what was pinned."""
    import httpx

    health = httpx.get(url + "/health", timeout=10.0, trust_env=False).json()
    pinned: dict[str, dict[str, Any]] = {}
    for replica in health.get("replicas") or []:
        role, pid = replica.get("role"), replica.get("pid")
        if role not in ROLE_CORES or pid is None:
            raise RuntimeError(f"/health does not name the replica's role and pid: {replica}")
        core = ROLE_CORES[role]
        threads = [int(tid) for tid in os.listdir(f"/proc/{pid}/task")]
        for tid in threads:
            os.sched_setaffinity(tid, {core})
        if any(os.sched_getaffinity(tid) != {core} for tid in threads):
            raise RuntimeError(f"could not pin the {role} engine (pid {pid}) to core {core}")
        pinned[role] = {"pid": pid, "core": core, "threads": len(threads)}
    if set(pinned) != set(ROLE_CORES):
        raise RuntimeError(f"expected a prefill and a decode replica in /health, got {health}")
    return pinned


def metrics_text(url: str) -> str:
    import httpx

    return httpx.get(url + "/metrics", timeout=10.0, trust_env=False).text


def run_config(
    label: str, model_dir: Path, engine: list[str], load: Any, workload: Any, slo: dict[str, Any], scratch: Path
) -> tuple[dict[str, Any], list[Any]]:
    """One server, one run of the workload: (summary row, records)."""
    from pagoda.bench.handoff_metrics import handoff_delta
    from pagoda.bench.mixed_load import run_mixed, summarize_mixed, summary_row, warm_up
    from pagoda.bench.server_metrics import parse_labeled

    flags = [*CONFIGS[label], *engine]
    with pagoda_server_process(model_dir, flags, scratch / "server.log") as (url, _):
        pinned = pin_engines(url) if "--replica-roles" in flags else {}
        config = load(url)
        warm_up(config, workload)
        load_average = os.getloadavg()
        before = parse_labeled(metrics_text(url))
        result = run_mixed(config, workload)
        after = parse_labeled(metrics_text(url))
    summary = summarize_mixed(result.records, result.duration, slo)
    row = summary_row(summary)
    row["load_average_at_start"] = [round(x, 2) for x in load_average]
    if summary.errors:
        row["errors"] = summary.errors
    if pinned:
        row["pinned"] = pinned
    handoffs = handoff_delta(before, after) if pinned else None
    if handoffs is not None:
        row.update(
            handoffs=handoffs.handoffs_exported,
            handoffs_imported=handoffs.handoffs_imported,
            handoff_failures=handoffs.failures,
            fallback_prefills=handoffs.fallback_prefills,
            blocks_per_handoff=handoffs.blocks_per_handoff,
            bytes_per_handoff=handoffs.bytes_per_handoff,
            blocks_cached=handoffs.blocks_cached,
            **{f"handoff_{phase}_mean_s": mean for phase, mean in handoffs.phase_mean_s.items()},
        )
    return row, result.records


def decode_step_probe(label: str, model_dir: Path, engine: list[str], builder: Any, scratch: Path) -> dict[str, Any]:
    """Chat decode steps with and without one long context decoding beside them.

    8 chat requests (64-token prompts, 48 output tokens) run alone, then again while a
    1500-token request is decoding (it was sent first and has streamed its first token). The
    torch attention backend pads each decode group to its longest context, so the long one can
    make every chat step gather ~1500 tokens; this isolates that cost from prefill."""
    import asyncio
    import random

    import httpx

    from pagoda.bench.loadgen import LoadConfig, send_request
    from pagoda.bench.records import BenchRequest
    from pagoda.http_client.sse import aiter_sse_events

    rng = random.Random(f"probe:{label}")

    def request(index: int, name: str, prompt_len: int, output_len: int) -> BenchRequest:
        prompt = builder.extend_to("", prompt_len, rng)
        return BenchRequest(index, name, prompt, [], builder.count(prompt), output_len)

    async def chats(client: Any, config: LoadConfig, first: int) -> list[float]:
        records = await asyncio.gather(
            *(send_request(client, config, request(first + i, "chat", 64, 48), time.perf_counter()) for i in range(8))
        )
        if not all(r.ok for r in records):
            raise RuntimeError(f"probe request failed: {[r.error for r in records if not r.ok]}")
        return [g for r in records for g in r.itls]

    async def probe(url: str) -> dict[str, Any]:
        config = LoadConfig(base_url=url, model="bench", ignore_eos=True, duration=60.0, timeout=300.0)
        async with httpx.AsyncClient(timeout=300.0, trust_env=False) as client:
            await chats(client, config, 0)  # warm up
            alone = await chats(client, config, 10)
            long_request = request(100, "long", 1500, 400)
            first_token = asyncio.Event()

            async def long_stream() -> None:
                body = {
                    "model": "bench",
                    "prompt": long_request.prompt,
                    "max_tokens": long_request.output_len,
                    "ignore_eos": True,
                    "stream": True,
                }
                async with client.stream("POST", config.url, json=body) as response:
                    async for _ in aiter_sse_events(response.aiter_lines()):
                        first_token.set()

            long_task = asyncio.create_task(long_stream())
            await first_token.wait()
            beside_long = await chats(client, config, 20)
            long_still_running = not long_task.done()
            long_task.cancel()
        return {
            "chat_itl_p50_alone_s": statistics.median(alone),
            "chat_itl_p50_beside_long_context_s": statistics.median(beside_long),
            "long_request_decoding_throughout": long_still_running,
        }

    flags = [*CONFIGS[label], *engine]
    with pagoda_server_process(model_dir, flags, scratch / "server.log") as (url, _):
        if "--replica-roles" in flags:
            pin_engines(url)
        return asyncio.run(probe(url))


def transfer_cost(rounds: int) -> dict[str, Any]:
    """ms per 1k tokens of context per transport (fp32 KV of this model): measured now by
    benchmarks/kv_transfer.py when rounds > 0, and as committed in results/kv_transfer.json."""

    def rows(payload: dict[str, Any]) -> list[dict[str, Any]]:
        return [
            {
                k: row[k]
                for k in ("transport", "kv_cache_dtype", "context_tokens", "bytes", "median_ms", "ms_per_1k_tokens")
            }
            for row in payload["results"]
        ]

    out: dict[str, Any] = {}
    committed = RESULTS / "kv_transfer.json"
    if committed.is_file():
        payload = json.loads(committed.read_text())
        out["committed"] = {
            "file": "benchmarks/results/kv_transfer.json",
            "date": payload["date"],
            "command": payload["command"],
            "results": rows(payload),
        }
    if rounds > 0:
        with tempfile.TemporaryDirectory() as scratch:
            command = [
                sys.executable,
                str(REPO / "benchmarks" / "kv_transfer.py"),
                "--rounds",
                str(rounds),
                "--contexts",
                "1536",
                "--out",
                scratch,
            ]
            subprocess.run(command, check=True, cwd=REPO)
            payload = json.loads((Path(scratch) / "kv_transfer.json").read_text())
        out["this_run"] = {
            "command": f".venv/bin/python benchmarks/kv_transfer.py --rounds {rounds} --contexts 1536",
            "date": payload["date"],
            "load_average_at_start": payload["load_average_at_start"],
            "results": rows(payload),
        }
    return out


def aggregate(rounds: list[dict[str, dict[str, Any]]], labels: list[str]) -> dict[str, dict[str, Any]]:
    """Median, min and max over rounds of every numeric field of each configuration's rows."""
    out: dict[str, dict[str, Any]] = {}
    for label in labels:
        rows = [r[label] for r in rounds if label in r]
        keys = [k for k, v in rows[0].items() if isinstance(v, (int, float)) and not isinstance(v, bool)]
        out[label] = {}
        for key in keys:
            values = [row[key] for row in rows if isinstance(row.get(key), (int, float))]
            if values:
                out[label][key] = {"median": statistics.median(values), "min": min(values), "max": max(values)}
    return out


def comparison(medians: dict[str, dict[str, Any]], baseline: str, other: str) -> dict[str, float]:
    """other / baseline for each headline number (a ratio of medians)."""
    ratios = {}
    for key, _ in HEADLINE:
        a, b = medians[baseline].get(key), medians[other].get(key)
        if a and b:
            ratios[key] = b["median"] / a["median"]
    return ratios


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model-dir", default=str(REPO / "tmp" / "bench-model"))
    parser.add_argument("--out", default=str(RESULTS / NAME))
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument(
        "--configs",
        default="colocated-2t,colocated-1t,disagg-tcp,disagg-shm",
        help=f"comma-separated, from {', '.join(CONFIG_KEYS)}",
    )
    parser.add_argument("--streams", type=int, default=8, help="closed-loop chat clients")
    parser.add_argument("--rag-rate", type=float, default=0.5, help="long-prompt requests per second (Poisson)")
    parser.add_argument("--duration", type=float, default=45.0, help="seconds of sending per run")
    parser.add_argument(
        "--max-num-batched-tokens",
        type=int,
        default=512,
        help="chunked-prefill token budget per engine step, every configuration",
    )
    parser.add_argument("--chat-slo", default="ttft=1,itl_p99=100ms")
    parser.add_argument("--rag-slo", default="ttft=3,itl_p99=100ms")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-decode-probe",
        dest="decode_probe",
        action="store_false",
        help="skip the probe of chat decode steps beside one long context (after the runs)",
    )
    parser.add_argument(
        "--transfer-rounds",
        type=int,
        default=5,
        help="rounds of benchmarks/kv_transfer.py at a 1536-token context after the runs "
        "(0: only cite the committed results/kv_transfer.json)",
    )
    args = parser.parse_args(argv)

    from pagoda.bench.lengths import uniform
    from pagoda.bench.loadgen import LoadConfig
    from pagoda.bench.mixed_load import MixedLoadSpec, MixedWorkload, parse_request_slo, slo_text
    from pagoda.bench.prompts import PromptBuilder
    from pagoda.bench.workloads import load_tokenizer

    labels = [CONFIG_KEYS[k.strip()] for k in args.configs.split(",") if k.strip()]
    model_dir = build_bench_model(Path(args.model_dir))
    out = Path(args.out)
    meta = {k: v for k, v in metadata(f"{NAME}.py", argv, model_dir).items() if k in META_KEYS}
    spec = MixedLoadSpec(
        streams=args.streams,
        stream_prompt=uniform(56, 72),
        stream_output=128,
        arrival_rate=args.rag_rate,
        arrival_prompt=uniform(1400, 1600),
        arrival_output=16,
        duration=args.duration,
        seed=args.seed,
    )
    workload = MixedWorkload(spec, PromptBuilder.from_tokenizer(load_tokenizer(str(model_dir))))
    slo = {"chat": parse_request_slo(args.chat_slo), "rag": parse_request_slo(args.rag_slo)}
    engine = [
        "--max-model-len",
        "2048",
        "--max-num-seqs",
        "32",
        "--enable-chunked-prefill",
        "--max-num-batched-tokens",
        str(args.max_num_batched_tokens),
    ]

    def load(url: str) -> LoadConfig:
        return LoadConfig(base_url=url, model="bench", ignore_eos=True, duration=spec.duration, timeout=300.0)

    rounds: list[dict[str, dict[str, Any]]] = []
    chat_gaps: dict[str, list[float]] = {label: [] for label in labels}
    for round_index in range(args.rounds):
        shift = round_index % len(labels)
        row: dict[str, dict[str, Any]] = {}
        for label in labels[shift:] + labels[:shift]:
            started = time.monotonic()
            with tempfile.TemporaryDirectory() as scratch:
                try:
                    row[label], records = run_config(label, model_dir, engine, load, workload, slo, Path(scratch))
                except Exception as e:  # keep the other configurations' rounds; say what failed
                    log = Path(scratch) / "server.log"
                    tail = log.read_text()[-3000:] if log.is_file() else ""
                    print(f"round {round_index + 1} {label}: FAILED: {e!r}\n{tail}", flush=True)
                    row[label] = {"failed": repr(e)[:500], "server_log_tail": tail[-1500:]}
                    continue
            chat_gaps[label] += [g for r in records if r.ok and r.class_name == "chat" for g in r.itls]
            r = row[label]
            print(
                f"round {round_index + 1} {label}: {r['output_tok_per_s']:.0f} tok/s, chat ITL p50/p99 "
                f"{r.get('chat_itl_p50_s', 0) * 1e3:.0f}/{r.get('chat_itl_p99_s', 0) * 1e3:.0f} ms, "
                f"rag TTFT p50 {r.get('rag_ttft_p50_s', 0):.2f} s, goodput {r['goodput_req_per_s']:.2f} req/s "
                f"({time.monotonic() - started:.0f} s)",
                flush=True,
            )
        rounds.append(row)

    ok_rounds = [{k: v for k, v in r.items() if "failed" not in v} for r in rounds]
    measured = [label for label in labels if any(label in r for r in ok_rounds)]
    medians = aggregate(ok_rounds, measured)
    comparisons = {}
    colocated = [label for label in (COLOCATED_2T, COLOCATED_1T) if label in medians]
    if colocated:
        # Compare with the better co-located engine: the one with the higher goodput, then throughput.
        best = max(
            colocated,
            key=lambda label: (
                medians[label]["goodput_req_per_s"]["median"],
                medians[label]["output_tok_per_s"]["median"],
            ),
        )
        comparisons = {
            "baseline": best,
            "ratios_vs_baseline": {label: comparison(medians, best, label) for label in measured if label != best},
        }
    probes = {}
    for label in (
        [label for label in (COLOCATED_2T, COLOCATED_1T, DISAGG_TCP) if label in labels] if args.decode_probe else []
    ):
        with tempfile.TemporaryDirectory() as scratch:
            probes[label] = decode_step_probe(label, model_dir, engine, workload.builder, Path(scratch))
        print(
            f"decode-step probe, {label}: chat ITL p50 "
            f"{probes[label]['chat_itl_p50_alone_s'] * 1e3:.0f} ms alone, "
            f"{probes[label]['chat_itl_p50_beside_long_context_s'] * 1e3:.0f} ms beside a 1500-token context",
            flush=True,
        )
    load_average_at_end = [round(x, 2) for x in os.getloadavg()]
    transfer = transfer_cost(args.transfer_rounds)
    write_summary(
        out / "summary.json",
        {
            **meta,
            "workload": {
                "chat": f"{spec.streams} closed-loop streams, prompt uniform 56-72 tokens, "
                f"{spec.stream_output} output tokens",
                "rag": f"Poisson {spec.arrival_rate} req/s, prompt uniform 1400-1600 tokens, "
                f"{spec.arrival_output} output tokens",
                "duration_s": spec.duration,
                "seed": spec.seed,
                "ignore_eos": True,
                "endpoint": "completions",
                "arrivals": len(workload.arrival_times()),
            },
            "engine_flags_every_config": engine,
            "configs": {label: CONFIGS[label] for label in labels},
            "pinning": "disaggregated: prefill engine -> core 0, decode engine -> core 1 (every thread); "
            "co-located engine, HTTP front and load generator unpinned",
            "slo": {name: slo_text(s) for name, s in slo.items()},
            "machine_note": "2 vCPUs shared with other engineers' tests and benchmarks during the run; "
            "each run's load average at its start is in its round row",
            "load_average_at_end": load_average_at_end,
            "rounds": rounds,
            "summary": medians,
            **comparisons,
            "kv_transfer_ms_per_1k_tokens": transfer,
            "decode_step_probe": probes,
        },
    )
    _plot(out, medians, chat_gaps)
    print(f"wrote {out}/summary.json and {NAME}.png")
    return 0


def _plot(out: Path, medians: dict[str, dict[str, Any]], chat_gaps: dict[str, list[float]]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = (
        ("chat ITL p99 (ms)", "chat_itl_p99_s", 1e3),
        ("chat TTFT p99 (ms)", "chat_ttft_p99_s", 1e3),
        ("RAG TTFT p99 (s)", "rag_ttft_p99_s", 1),
        ("output tok/s", "output_tok_per_s", 1),
        ("goodput (req/s)", "goodput_req_per_s", 1),
    )
    labels = list(medians)
    fig, axes = plt.subplots(1, len(panels) + 1, figsize=(4.2 * (len(panels) + 1), 4.4))
    for ax, (title, key, scale) in zip(axes, panels):
        stats = [medians[label].get(key) for label in labels]
        mid = [s["median"] * scale if s else 0 for s in stats]
        low = [(s["median"] - s["min"]) * scale if s else 0 for s in stats]
        high = [(s["max"] - s["median"]) * scale if s else 0 for s in stats]
        bars = ax.bar(range(len(labels)), mid, yerr=[low, high], capsize=4, color=[f"C{i}" for i in range(len(labels))])
        ax.bar_label(bars, labels=[f"{v:,.0f}" if v >= 100 else f"{v:.3g}" for v in mid], fontsize=8)
        ax.set_xticks(range(len(labels)), labels, rotation=20, ha="right", fontsize=8)
        ax.set_title(title, fontsize=10)
        ax.grid(True, axis="y", alpha=0.3)
    cdf = axes[-1]
    for i, (label, gaps) in enumerate(chat_gaps.items()):
        if gaps:
            xs = sorted(g * 1e3 for g in gaps)
            cdf.step(
                xs,
                [(j + 1) / len(xs) for j in range(len(xs))],
                where="post",
                color=f"C{i}",
                label=f"{label} (n={len(xs)})",
            )
    cdf.set_xscale("log")
    cdf.set_xlabel("chat inter-token gap (ms), every round")
    cdf.set_title("chat ITL CDF", fontsize=10)
    cdf.grid(True, which="both", alpha=0.3)
    cdf.legend(fontsize=7)
    fig.suptitle(
        "prefill/decode disaggregation vs one co-located engine, 2 cores: medians over rounds (whiskers: min-max)"
    )
    fig.tight_layout()
    fig.savefig(out / f"{NAME}.png", dpi=110)
    plt.close(fig)


if __name__ == "__main__":
    sys.exit(main())
