"""`pagoda bench compare`: several targets, one request list, back to back; ratios to the first."""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from pagoda.bench.options import CompareBenchOptions, prepare_requests, run_metadata
from pagoda.bench.records import BenchRequest, RunResult
from pagoda.bench.report import LatencyStats, Summary, render_summary, render_table, summarize
from pagoda.bench.targets import TargetSpec, parse_target


def run_target(
    spec: TargetSpec,
    options: CompareBenchOptions,
    requests: list[BenchRequest],
    warmup: list[BenchRequest],
    encode: Any,
) -> RunResult:
    target_options = dict(spec.options)
    max_model_len = options.workload.max_model_len
    if spec.kind in ("pagoda", "pagoda-static"):
        from pagoda.bench.offline import build_llm, release, run_pagoda

        static_batch = target_options.pop("batch", None)
        if static_batch is not None:
            target_options.setdefault("max_num_seqs", static_batch)
        target_options.setdefault("num_threads", options.num_threads)
        if max_model_len is not None:
            target_options.setdefault("max_model_len", max_model_len)
        llm = build_llm(options.model, target_options)
        try:
            return run_pagoda(llm, requests, encode, static_batch=static_batch, warmup_requests=warmup)
        finally:
            release(llm)
    if spec.kind == "hf":
        from pagoda.bench.hf_baseline import HFGenerateTarget
        from pagoda.bench.offline import release

        target = HFGenerateTarget(
            options.model,
            batch_size=int(target_options.get("batch_size", 8)),
            dtype=str(target_options.get("dtype", "float32")),
            num_threads=options.num_threads,
        )
        try:
            return target.run(requests, encode, warmup_requests=warmup)
        finally:
            release(target)
    from pagoda.bench.loadgen import LoadConfig, run_load

    config = LoadConfig(
        base_url=target_options["url"],
        model=str(target_options.get("model", Path(options.model).name)),
        endpoint=str(target_options.get("endpoint", "completions")),
        request_rate=options.request_rate,
        concurrency=options.concurrency,
        num_requests=len(requests),
        ignore_eos=True,
        seed=options.workload.seed,
    )
    return run_load(config, requests, progress=not options.report.no_progress, warmup_requests=warmup)


def _ratio(value: float | None, base: float | None) -> str:
    if value is None or not base:
        return "-"
    return f"{value / base:.2f}x"


def comparison_rows(summaries: list[Summary]) -> tuple[list[str], list[list[str]]]:
    first = summaries[0].overall

    def ms(stats: LatencyStats | None, attr: str) -> str:
        return "-" if stats is None else f"{getattr(stats, attr) * 1000:.1f}"

    rows = []
    for s in summaries:
        o = s.overall
        rows.append(
            [
                s.target,
                f"{o.num_ok}/{o.num_requests}",
                f"{s.duration:.2f}",
                f"{o.output_throughput:.1f}",
                _ratio(o.output_throughput, first.output_throughput),
                ms(o.ttft, "p50"),
                ms(o.ttft, "p99"),
                ms(o.tpot, "p50"),
                ms(o.e2e, "p50"),
                ms(o.e2e, "p99"),
                _ratio(o.e2e.p99 if o.e2e else None, first.e2e.p99 if first.e2e else None),
            ]
        )
    headers = [
        "target",
        "ok",
        "time s",
        "out tok/s",
        "vs first",
        "TTFT p50",
        "TTFT p99",
        "TPOT p50",
        "E2E p50",
        "E2E p99",
        "E2E p99 vs first",
    ]
    return headers, rows


def plot_comparison(summaries: list[Summary], path: Path) -> None:
    from pagoda.bench.plots import plot_bars

    def seconds(stats: LatencyStats | None, attr: str) -> float:
        return getattr(stats, attr) if stats else 0.0

    plot_bars(
        {
            "output tokens / s\n(higher is better)": {s.target: s.overall.output_throughput for s in summaries},
            "E2E p50 (s)\n(lower is better)": {s.target: seconds(s.overall.e2e, "p50") for s in summaries},
            "E2E p99 (s)\n(lower is better)": {s.target: seconds(s.overall.e2e, "p99") for s in summaries},
            "TTFT p99 (s)\n(lower is better)": {s.target: seconds(s.overall.ttft, "p99") for s in summaries},
        },
        path,
        "same requests, back to back",
    )


def compare_benchmark(options: CompareBenchOptions) -> int:
    from pagoda.bench.report import parse_slo, write_json

    slo = parse_slo(options.report.slo)
    specs = [parse_target(t) for t in options.targets]
    if math.isfinite(options.request_rate) and options.request_rate <= 0:
        raise ValueError("--request-rate must be > 0")
    prepared = prepare_requests(options.workload, options.workload.tokenizer or options.model, options.warmup)
    requests, warmup = prepared.requests, prepared.warmup
    summaries, results = [], []
    for spec in specs:
        print(f"--- {spec.label}", flush=True)
        result = run_target(spec, options, requests, warmup, prepared.workload.builder.encode)
        summary = summarize(spec.label, result.records, result.duration, slo)
        print(render_summary(summary), "\n", flush=True)
        summaries.append(summary)
        results.append(result)
    headers, rows = comparison_rows(summaries)
    print(f"latencies in ms; every target ran the same {len(requests)} requests")
    print(render_table(headers, rows))
    out = options.report.output_dir()
    if out is not None:
        from pagoda.bench.plots import plot_target_cdfs

        payload: dict[str, Any] = {
            **run_metadata(options),
            "targets": [s.__dict__ for s in specs],
            "comparison": {"headers": headers, "rows": rows},
            "runs": [
                {"summary": s, "requests": r.records, "duration": r.duration, "started_at": r.started_at}
                for s, r in zip(summaries, results)
            ],
        }
        write_json(out / "results.json", payload)
        plot_comparison(summaries, out / "compare.png")
        plot_target_cdfs(
            {s.target: r.records for s, r in zip(summaries, results)},
            out / "compare_cdf.png",
            "same requests, back to back: latency CDFs",
        )
        print(f"wrote {out}/results.json, compare.png, compare_cdf.png")
    return 0 if all(s.overall.num_ok for s in summaries) else 1
