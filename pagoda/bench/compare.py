"""`pagoda bench compare`: several targets, one request list, back to back; ratios to the first."""

from __future__ import annotations

import argparse
import math
from pathlib import Path
from typing import Any

from pagoda.bench.records import BenchRequest, RunResult
from pagoda.bench.report import Summary, render_summary, render_table, summarize
from pagoda.bench.targets import TargetSpec, parse_target


def run_target(spec: TargetSpec, args: argparse.Namespace, requests: list[BenchRequest],
               warmup: list[BenchRequest], encode: Any) -> RunResult:
    options = dict(spec.options)
    if spec.kind in ("pagoda", "pagoda-static"):
        from pagoda.bench.offline import build_llm, release, run_pagoda

        static_batch = options.pop("batch", None)
        if static_batch is not None:
            options.setdefault("max_num_seqs", static_batch)
        options.setdefault("num_threads", args.num_threads)
        if args.max_model_len is not None:
            options.setdefault("max_model_len", args.max_model_len)
        llm = build_llm(args.model, options)
        try:
            return run_pagoda(llm, requests, encode, static_batch=static_batch, warmup_requests=warmup)
        finally:
            release(llm)
    if spec.kind == "hf":
        from pagoda.bench.hf_baseline import HFGenerateTarget
        from pagoda.bench.offline import release

        target = HFGenerateTarget(args.model, batch_size=int(options.get("batch_size", 8)),
                                  dtype=str(options.get("dtype", "float32")), num_threads=args.num_threads)
        try:
            return target.run(requests, encode, warmup_requests=warmup)
        finally:
            release(target)
    from pagoda.bench.loadgen import LoadConfig, run_load

    config = LoadConfig(base_url=options["url"], model=str(options.get("model", Path(args.model).name)),
                        endpoint=str(options.get("endpoint", "completions")), request_rate=args.request_rate,
                        concurrency=args.concurrency, num_requests=len(requests), ignore_eos=True,
                        seed=args.seed)
    return run_load(config, requests, progress=not args.no_progress, warmup_requests=warmup)


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or not base:
        return "-"
    return f"{value / base:.2f}x"


def comparison_rows(summaries: list[Summary]) -> tuple[list[str], list[list[str]]]:
    first = summaries[0].overall
    ms = lambda stats, attr: "-" if stats is None else f"{getattr(stats, attr) * 1000:.1f}"
    rows = []
    for s in summaries:
        o = s.overall
        rows.append([
            s.target, f"{o.num_ok}/{o.num_requests}", f"{s.duration:.2f}", f"{o.output_throughput:.1f}",
            _ratio(o.output_throughput, first.output_throughput),
            ms(o.ttft, "p50"), ms(o.ttft, "p99"), ms(o.tpot, "p50"), ms(o.e2e, "p50"), ms(o.e2e, "p99"),
            _ratio(o.e2e.p99 if o.e2e else None, first.e2e.p99 if first.e2e else None),
        ])
    headers = ["target", "ok", "time s", "out tok/s", "vs first", "TTFT p50", "TTFT p99", "TPOT p50",
               "E2E p50", "E2E p99", "E2E p99 vs first"]
    return headers, rows


def plot_comparison(summaries: list[Summary], path: Path) -> None:
    from pagoda.bench.plots import plot_bars

    seconds = lambda stats, attr: getattr(stats, attr) if stats else 0.0
    plot_bars({
        "output tokens / s\n(higher is better)": {s.target: s.overall.output_throughput for s in summaries},
        "E2E p50 (s)\n(lower is better)": {s.target: seconds(s.overall.e2e, "p50") for s in summaries},
        "E2E p99 (s)\n(lower is better)": {s.target: seconds(s.overall.e2e, "p99") for s in summaries},
        "TTFT p99 (s)\n(lower is better)": {s.target: seconds(s.overall.ttft, "p99") for s in summaries},
    }, path, "same requests, back to back")


def compare_benchmark(args: argparse.Namespace) -> int:
    from pagoda.bench.cli import output_dir, run_metadata, workload_spec
    from pagoda.bench.report import parse_slo, write_json
    from pagoda.bench.serve_run import DEFAULT_NUM_REQUESTS, WARMUP_SEED_OFFSET
    from pagoda.bench.workloads import Workload, make_workload

    slo = parse_slo(args.slo)
    specs = [parse_target(t) for t in args.target]
    if math.isfinite(args.request_rate) and args.request_rate <= 0:
        raise ValueError("--request-rate must be > 0")
    workload = make_workload(workload_spec(args), args.tokenizer or args.model)
    requests = workload.build(args.num_requests or DEFAULT_NUM_REQUESTS)
    warmup = Workload(workload_spec(args, WARMUP_SEED_OFFSET), workload.builder).build(args.warmup)
    summaries, results = [], []
    for spec in specs:
        print(f"--- {spec.label}", flush=True)
        result = run_target(spec, args, requests, warmup, workload.builder.encode)
        summary = summarize(spec.label, result.records, result.duration, slo)
        print(render_summary(summary), "\n", flush=True)
        summaries.append(summary)
        results.append(result)
    headers, rows = comparison_rows(summaries)
    print("latencies in ms; every target ran the same %d requests" % len(requests))
    print(render_table(headers, rows))
    out = output_dir(args)
    if out is not None:
        from pagoda.bench.plots import plot_bars, plot_target_cdfs

        payload: dict[str, Any] = {**run_metadata(args), "targets": [s.__dict__ for s in specs],
                                   "comparison": {"headers": headers, "rows": rows},
                                   "runs": [{"summary": s, "requests": r.records, "duration": r.duration,
                                             "started_at": r.started_at} for s, r in zip(summaries, results)]}
        write_json(out / "results.json", payload)
        plot_comparison(summaries, out / "compare.png")
        plot_target_cdfs({s.target: r.records for s, r in zip(summaries, results)}, out / "compare_cdf.png",
                         "same requests, back to back: latency CDFs")
        print(f"wrote {out}/results.json, compare.png, compare_cdf.png")
    return 0 if all(s.overall.num_ok for s in summaries) else 1
