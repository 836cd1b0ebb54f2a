"""`pagoda bench offline`: the engine in-process through `pagoda.LLM`, no HTTP.

Every request arrives at the start; latencies count from there. With a static batch size the
requests run B at a time and each group runs to completion before the next starts — the same
engine with continuous batching turned into static batching, for a side-by-side comparison.
Agent turns are sent together with everything else (no turn waits for the previous one).
"""

from __future__ import annotations

import dataclasses
import gc
import time
from collections.abc import Callable, Sequence
from typing import Any

from pagoda.bench.options import OfflineBenchOptions, prepare_requests, run_metadata
from pagoda.bench.records import BenchRequest, RequestRecord, RunResult

Encode = Callable[[str], list[int]]


def _sampling_params(requests: Sequence[BenchRequest], temperature: float) -> list[Any]:
    from pagoda import SamplingParams

    return [SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=temperature) for r in requests]


def _records(
    requests: Sequence[BenchRequest], outputs: Sequence[Any], t0_wall: float, fallback_end: float
) -> list[RequestRecord]:
    records = []
    for request, out in zip(requests, outputs):
        record = RequestRecord(
            request.index, request.class_name, request.prompt_len, request.output_len, start=0.0, status=200
        )
        metrics = getattr(out, "metrics", None)
        record.output_tokens = len(out.outputs[0].token_ids)
        record.cached_tokens = out.num_cached_tokens
        record.reported_prompt_tokens = len(out.prompt_token_ids)
        first = getattr(metrics, "first_token_time", None)
        finished = getattr(metrics, "finished_time", None) or getattr(metrics, "last_token_time", None)
        record.ttft = first - t0_wall if first is not None else None
        record.e2e = (finished if finished is not None else fallback_end) - t0_wall
        records.append(record)
    return records


def run_pagoda(
    llm: Any,
    requests: Sequence[BenchRequest],
    encode: Encode,
    *,
    static_batch: int | None = None,
    warmup_requests: Sequence[BenchRequest] = (),
    temperature: float = 0.0,
    progress: bool = False,
) -> RunResult:
    """Run the requests on an already built `pagoda.LLM` and time them."""
    prompts = [r.prompt_ids(encode) for r in requests]
    params = _sampling_params(requests, temperature)
    if warmup_requests:
        llm.generate(
            [r.prompt_ids(encode) for r in warmup_requests],
            _sampling_params(warmup_requests, temperature),
            use_tqdm=False,
        )
    started_at = time.time()
    t0 = time.perf_counter()
    batch = static_batch or len(prompts)
    outputs: list[Any] = []
    for lo in range(0, len(prompts), batch):
        outputs += llm.generate(
            prompts[lo : lo + batch], params[lo : lo + batch], use_tqdm=progress and static_batch is None
        )
    duration = time.perf_counter() - t0
    return RunResult(_records(requests, outputs, started_at, started_at + duration), duration, started_at)


def build_llm(model: str, engine_kwargs: dict[str, Any]) -> Any:
    from pagoda import LLM

    return LLM(model=model, **engine_kwargs)


def release(obj: Any) -> None:
    """Drop an engine or model between targets so the next one gets the memory and cores."""
    shutdown = getattr(obj, "shutdown", None)
    if callable(shutdown):
        shutdown()
    del obj
    gc.collect()


def offline_benchmark(options: OfflineBenchOptions) -> int:
    from pagoda.bench.report import parse_slo, render_summary, summarize, write_json

    report = options.report
    slo = parse_slo(report.slo)
    if options.static_batch is not None and options.static_batch < 1:
        raise ValueError(f"--static-batch must be >= 1, got {options.static_batch}")
    config = options.engine
    prepared = prepare_requests(options.workload, config.tokenizer or config.model, options.warmup)
    engine_kwargs = {k: v for k, v in dataclasses.asdict(config).items() if k != "model"}
    llm = build_llm(config.model, engine_kwargs)
    result = run_pagoda(
        llm,
        prepared.requests,
        prepared.workload.builder.encode,
        static_batch=options.static_batch,
        warmup_requests=prepared.warmup,
        progress=not report.no_progress,
    )
    label = report.label or (f"pagoda static batch {options.static_batch}" if options.static_batch else "pagoda")
    summary = summarize(label, result.records, result.duration, slo)
    print(render_summary(summary))
    out = report.output_dir()
    if out is not None:
        from pagoda.bench.plots import plot_latency_cdfs

        write_json(
            out / "results.json",
            {
                **run_metadata(options),
                "engine_config": config,
                "summary": summary,
                "requests": result.records,
                "started_at": result.started_at,
                "duration": result.duration,
            },
        )
        plot_latency_cdfs(result.records, out / "latency_cdf.png", f"{label}: latency CDFs")
        print(f"wrote {out}/results.json, latency_cdf.png")
    return 0
