"""`pagoda bench serve`: one run or a concurrency sweep against an HTTP server, then report."""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path
from typing import Any

from pagoda.bench.loadgen import LoadConfig, run_load
from pagoda.bench.options import WARMUP_SEED_OFFSET, ServeBenchOptions, WorkloadOptions, run_metadata
from pagoda.bench.records import RunResult
from pagoda.bench.report import Summary, parse_slo, render_summary, render_table, summarize, write_json
from pagoda.bench.server_metrics import metrics_delta
from pagoda.bench.workloads import Workload, make_workload


def parse_sweep(text: str) -> list[int]:
    try:
        points = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--sweep-concurrency must be integers like 1,4,16,64, got {text!r}") from None
    if not points or min(points) < 1:
        raise ValueError("--sweep-concurrency needs concurrencies >= 1")
    return points


def _requests(workload: Workload, config: LoadConfig) -> Any:
    # With a request count, build every prompt before the clock starts; with only a duration, lazily.
    return workload.build(config.num_requests) if config.num_requests is not None else iter(workload)


def one_run(
    options: ServeBenchOptions, config: LoadConfig, workload: Workload, warmup: Workload | None, label: str
) -> tuple[RunResult, Summary]:
    warmup_requests = warmup.build(config.warmup) if warmup and config.warmup else None
    result = run_load(
        config, _requests(workload, config), progress=not options.report.no_progress, warmup_requests=warmup_requests
    )
    server = (
        metrics_delta(result.metrics_before, result.metrics_after)
        if result.metrics_before is not None and result.metrics_after is not None
        else None
    )
    summary = summarize(
        label,
        result.records,
        result.duration,
        parse_slo(options.report.slo),
        server,
        concurrency=config.concurrency,
        request_rate=config.request_rate if math.isfinite(config.request_rate) else None,
    )
    return result, summary


def sweep_point(summary: Summary) -> dict[str, Any]:
    o = summary.overall
    return {
        "concurrency": summary.concurrency,
        "request_throughput": o.request_throughput,
        "output_throughput": o.output_throughput,
        "ttft_p50": o.ttft.p50 if o.ttft else None,
        "ttft_p99": o.ttft.p99 if o.ttft else None,
        "itl_p50": o.itl.p50 if o.itl else None,
        "itl_p99": o.itl.p99 if o.itl else None,
        "e2e_p50": o.e2e.p50 if o.e2e else None,
        "e2e_p99": o.e2e.p99 if o.e2e else None,
        "num_ok": o.num_ok,
        "num_requests": o.num_requests,
    }


def render_sweep(points: list[dict[str, Any]]) -> str:
    def ms(v: float | None) -> str:
        return "-" if v is None else f"{v * 1000:.1f}"

    rows = [
        [
            str(p["concurrency"]),
            f"{p['request_throughput']:.2f}",
            f"{p['output_throughput']:.1f}",
            ms(p["ttft_p50"]),
            ms(p["ttft_p99"]),
            ms(p["itl_p99"]),
            ms(p["e2e_p99"]),
        ]
        for p in points
    ]
    return render_table(
        ["concurrency", "req/s", "out tok/s", "TTFT p50 ms", "TTFT p99 ms", "ITL p99 ms", "E2E p99 ms"], rows
    )


def write_outputs(out: Path, payload: dict[str, Any], result: RunResult, summary: Summary) -> None:
    from pagoda.bench.plots import plot_latency_cdfs, plot_over_time

    write_json(out / "results.json", payload)
    plot_latency_cdfs(result.records, out / "latency_cdf.png", f"{summary.target}: latency CDFs")
    plot_over_time(result.records, out / "over_time.png", f"{summary.target}: TTFT and ITL over time")


def _with_served_model(options: ServeBenchOptions) -> WorkloadOptions:
    """The tokenizer and context length default to the served model's, when the server says."""
    from pagoda.bench.served_model import discover_served_model
    from pagoda.config import resolve_model_path

    workload = options.workload
    if workload.tokenizer is not None and workload.max_model_len is not None:
        return dataclasses.replace(workload, tokenizer=resolve_model_path(workload.tokenizer))
    served = discover_served_model(options.load.base_url, options.load.model, options.load.api_key)
    tokenizer = workload.tokenizer
    if tokenizer is None:
        if served.local_dir is None:
            raise ValueError("--tokenizer is required: the server does not name a local model directory in /v1/models")
        tokenizer = served.local_dir
        print(f"tokenizer: {tokenizer} (the served model's, from /v1/models)")
    max_model_len = workload.max_model_len
    if max_model_len is None and served.max_model_len is not None:
        max_model_len = served.max_model_len
        print(f"lengths capped at the served context: {max_model_len} tokens (from /v1/models)")
    return dataclasses.replace(workload, tokenizer=resolve_model_path(tokenizer), max_model_len=max_model_len)


def serve_benchmark(options: ServeBenchOptions) -> int:
    parse_slo(options.report.slo)  # a bad flag fails before any work
    options = dataclasses.replace(options, workload=_with_served_model(options))
    label = options.report.label or options.load.base_url
    out = options.report.output_dir()
    base = options.load
    meta = run_metadata(options)
    workload_options = options.workload
    tokenizer = workload_options.tokenizer
    assert tokenizer is not None  # _with_served_model sets it or refuses
    shown_config = dataclasses.replace(base, api_key="<redacted>" if base.api_key else None)

    if options.sweep_concurrency:
        points, runs = [], []
        for i, concurrency in enumerate(parse_sweep(options.sweep_concurrency)):
            config = dataclasses.replace(base, concurrency=concurrency, request_rate=math.inf)
            # A fresh seed per point: a repeated prompt would be served from the prefix cache.
            workload = make_workload(workload_options.spec(seed_offset=i), tokenizer)
            warmup = Workload(workload_options.spec(WARMUP_SEED_OFFSET), workload.builder) if i == 0 else None
            result, summary = one_run(options, config, workload, warmup, f"{label} c={concurrency}")
            print(render_summary(summary), "\n", flush=True)
            points.append(sweep_point(summary))
            runs.append((result, summary))
        print(render_sweep(points))
        if out is not None:
            from pagoda.bench.plots import plot_sweep

            last_result, last_summary = runs[-1]
            payload = {
                **meta,
                "config": shown_config,
                "sweep": points,
                "runs": [
                    {"summary": s, "requests": r.records, "started_at": r.started_at, "duration": r.duration}
                    for r, s in runs
                ],
            }
            write_outputs(out, payload, last_result, last_summary)
            plot_sweep(points, out / "sweep.png", f"{label}: concurrency sweep")
            print(f"wrote {out}/results.json, latency_cdf.png, over_time.png, sweep.png")
        return 0

    workload = make_workload(workload_options.spec(), tokenizer)
    warmup = Workload(workload_options.spec(WARMUP_SEED_OFFSET), workload.builder)
    result, summary = one_run(options, base, workload, warmup, label)
    print(render_summary(summary))
    if out is not None:
        payload = {
            **meta,
            "config": shown_config,
            "summary": summary,
            "requests": result.records,
            "started_at": result.started_at,
            "duration": result.duration,
        }
        write_outputs(out, payload, result, summary)
        print(f"wrote {out}/results.json, latency_cdf.png, over_time.png")
    return 0 if summary.overall.num_ok else 1
