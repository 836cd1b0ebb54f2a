"""`pagoda bench shootout URL...`: the same workload classes against several OpenAI-compatible
servers (pagoda, vLLM, llama.cpp's llama-server, SGLang), side by side.

Rounds alternate the order of the targets, so a machine that drifts (another job, a warming
cache) does not favour whichever runs first; within a round every target gets the same seeded
request list per class. Each target × class gets TTFT/ITL/E2E percentiles, throughput, goodput
under the SLOs and its error rate; greedy prompts sent to every target measure how often their
outputs agree with the first target's.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pagoda.bench.loadgen import LoadConfig, run_load
from pagoda.bench.records import RequestRecord
from pagoda.bench.report import machine_info, meets_slo, render_table, write_json
from pagoda.bench.served_model import discover_served_model
from pagoda.bench.workloads import DEFAULT_PARAMS, WorkloadSpec, make_workload
from pagoda.stats import percentile

CLASSES = ("chat", "rag", "summarize", "agent")
QUANTILES = (50, 90, 99)


@dataclass
class ShootoutTarget:
    label: str
    base_url: str
    model: str | None = None

    @classmethod
    def parse(cls, spec: str, index: int) -> ShootoutTarget:
        """`URL` or `LABEL=URL`."""
        label, sep, url = spec.partition("=")
        if not sep or label.startswith("http"):
            label, url = f"target{index + 1}", spec
        if not url.startswith(("http://", "https://")):
            raise ValueError(f"{spec!r} is not a URL or LABEL=URL")
        return cls(label, url.rstrip("/").removesuffix("/v1"))


@dataclass
class ShootoutOptions:
    targets: list[str]
    tokenizer: str | None = None  # default: the first target's model directory from /v1/models
    classes: list[str] = field(default_factory=lambda: list(CLASSES))
    rounds: int = 2
    requests_per_class: int = 8
    concurrency: int = 4
    length_scale: float = 0.1
    max_model_len: int | None = None
    slo: dict[str, float] = field(default_factory=dict)
    greedy_prompts: int = 8
    greedy_max_tokens: int = 16
    models: list[str] = field(default_factory=list)  # per target; default: the first of /v1/models
    api_key: str | None = None
    timeout_s: float = 300.0
    out: str | None = None

    def __post_init__(self) -> None:
        if len(self.targets) < 1:
            raise ValueError("give at least one target URL")
        unknown = [c for c in self.classes if c not in DEFAULT_PARAMS or c == "file"]
        if unknown:
            raise ValueError(f"unknown class {unknown[0]!r}; use {', '.join(CLASSES)}")
        for name in ("rounds", "requests_per_class", "concurrency"):
            if getattr(self, name) < 1:
                raise ValueError(f"--{name.replace('_', '-')} must be >= 1")


def _stats(values: list[float]) -> dict[str, float | None]:
    return {f"p{q}": percentile(values, q) for q in QUANTILES}


def summarize_class(records: list[RequestRecord], duration: float, slo: dict[str, float]) -> dict[str, Any]:
    """One target × class: latency percentiles (seconds), rates, error rate."""
    ok = [r for r in records if r.ok]
    output = sum(r.output_tokens for r in ok)
    return {
        "requests": len(records),
        "errors": len(records) - len(ok),
        "error_rate": (len(records) - len(ok)) / len(records) if records else None,
        "ttft": _stats([r.ttft for r in ok if r.ttft is not None]),
        "itl": _stats([gap for r in ok for gap in r.itls]),
        "e2e": _stats([r.e2e for r in ok if r.e2e is not None]),
        "output_tokens_per_s": output / duration if duration > 0 else None,
        "goodput_requests_per_s": (
            sum(meets_slo(r, slo) for r in records) / duration if slo and duration > 0 else None
        ),
        "duration_s": duration,
    }


def _greedy_outputs(
    target: ShootoutTarget, prompts: list[list[int]], max_tokens: int, api_key: str | None, timeout: float
) -> list[str | None]:
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    outputs: list[str | None] = []
    with httpx.Client(timeout=timeout, trust_env=False) as client:
        for prompt in prompts:
            try:
                response = client.post(
                    target.base_url + "/v1/completions",
                    headers=headers,
                    json={"model": target.model, "prompt": prompt, "max_tokens": max_tokens, "temperature": 0},
                )
                outputs.append(response.json()["choices"][0]["text"] if response.status_code == 200 else None)
            except (httpx.HTTPError, KeyError, ValueError):
                outputs.append(None)
    return outputs


def agreement(reference: list[str | None], other: list[str | None]) -> dict[str, float | None]:
    """Exact matches and the mean share of the reference's characters before the first difference."""
    pairs = [(a, b) for a, b in zip(reference, other) if a is not None and b is not None]
    if not pairs:
        return {"exact_match_rate": None, "common_prefix_share": None, "compared": 0}
    shares = []
    for a, b in pairs:
        common = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
        shares.append(common / max(len(a), len(b), 1))
    return {
        "exact_match_rate": sum(a == b for a, b in pairs) / len(pairs),
        "common_prefix_share": sum(shares) / len(shares),
        "compared": len(pairs),
    }


def run_shootout(options: ShootoutOptions, *, progress: bool = False) -> dict[str, Any]:
    targets = [ShootoutTarget.parse(spec, i) for i, spec in enumerate(options.targets)]
    for index, target in enumerate(targets):
        target.model = options.models[index] if index < len(options.models) else _first_model(target, options)
    tokenizer, max_model_len = options.tokenizer, options.max_model_len
    if tokenizer is None or max_model_len is None:
        served = discover_served_model(targets[0].base_url, targets[0].model or "", options.api_key)
        tokenizer = tokenizer or served.local_dir
        max_model_len = max_model_len or served.max_model_len
    if tokenizer is None:
        raise ValueError("--tokenizer is required: the first target names no local model directory")
    records: dict[str, dict[str, list[RequestRecord]]] = {t.label: {c: [] for c in options.classes} for t in targets}
    durations: dict[str, dict[str, float]] = {t.label: dict.fromkeys(options.classes, 0.0) for t in targets}
    load_averages: list[float] = []  # as each round starts and after the last: others may share the machine
    for round_index in range(options.rounds):
        load_averages.append(os.getloadavg()[0])
        shift = round_index % len(targets)
        for target in targets[shift:] + targets[:shift]:
            for class_name in options.classes:
                workload = make_workload(
                    WorkloadSpec(
                        {class_name: 1.0},
                        length_scale=options.length_scale,
                        max_model_len=max_model_len,
                        seed=round_index,
                    ),
                    tokenizer,
                )
                config = LoadConfig(
                    base_url=target.base_url,
                    model=target.model or "",
                    endpoint="completions",
                    concurrency=options.concurrency,
                    num_requests=options.requests_per_class,
                    ignore_eos=True,
                    timeout=options.timeout_s,
                    api_key=options.api_key,
                )
                result = run_load(config, workload.build(options.requests_per_class), progress=progress)
                records[target.label][class_name].extend(result.records)
                durations[target.label][class_name] += result.duration
    load_averages.append(os.getloadavg()[0])
    prompts = [list(range(10 + i, 10 + i + 24)) for i in range(options.greedy_prompts)]
    outputs = {
        t.label: _greedy_outputs(t, prompts, options.greedy_max_tokens, options.api_key, options.timeout_s)
        for t in targets
    }
    reference = targets[0].label
    report = {
        "targets": [{"label": t.label, "base_url": t.base_url, "model": t.model} for t in targets],
        "settings": {
            "classes": options.classes,
            "rounds": options.rounds,
            "requests_per_class": options.requests_per_class,
            "concurrency": options.concurrency,
            "length_scale": options.length_scale,
            "max_model_len": max_model_len,
            "slo": options.slo,
            "greedy_prompts": options.greedy_prompts,
            "greedy_max_tokens": options.greedy_max_tokens,
        },
        "machine": {**machine_info(), "load_average_1m": load_averages},
        "results": {
            label: {c: summarize_class(records[label][c], durations[label][c], options.slo) for c in options.classes}
            for label in records
        },
        "greedy_agreement": {
            "reference": reference,
            **{t.label: agreement(outputs[reference], outputs[t.label]) for t in targets[1:]},
        },
    }
    if options.out:
        write_outputs(Path(options.out), report, records)
    return report


def _first_model(target: ShootoutTarget, options: ShootoutOptions) -> str:
    headers = {"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}
    try:
        response = httpx.get(target.base_url + "/v1/models", headers=headers, timeout=30, trust_env=False)
        return str(response.json()["data"][0]["id"])
    except (httpx.HTTPError, KeyError, IndexError, ValueError) as error:
        raise ValueError(
            f"{target.label}: cannot list models at {target.base_url}/v1/models ({error}); give --model per target"
        ) from None


def _ms(value: float | None) -> str:
    return "-" if value is None else f"{value * 1000:.1f}"


def render_markdown(report: dict[str, Any]) -> str:
    headers = [
        "class",
        "target",
        "TTFT p50/p99 ms",
        "ITL p50/p99 ms",
        "E2E p50/p99 ms",
        "output tok/s",
        "goodput req/s",
        "errors",
    ]
    rows = []
    for class_name in report["settings"]["classes"]:
        for label, by_class in report["results"].items():
            s = by_class[class_name]
            rows.append(
                [
                    class_name,
                    label,
                    f"{_ms(s['ttft']['p50'])} / {_ms(s['ttft']['p99'])}",
                    f"{_ms(s['itl']['p50'])} / {_ms(s['itl']['p99'])}",
                    f"{_ms(s['e2e']['p50'])} / {_ms(s['e2e']['p99'])}",
                    "-" if s["output_tokens_per_s"] is None else f"{s['output_tokens_per_s']:.1f}",
                    "-" if s["goodput_requests_per_s"] is None else f"{s['goodput_requests_per_s']:.2f}",
                    f"{s['errors']}/{s['requests']}",
                ]
            )
    lines = [
        "# Shootout",
        "",
        "Targets: " + ", ".join(f"{t['label']} ({t['base_url']}, {t['model']})" for t in report["targets"]),
        "",
        "| " + " | ".join(headers) + " |",
        "|" + "---|" * len(headers),
    ]
    lines += ["| " + " | ".join(row) + " |" for row in rows]
    greedy = report["greedy_agreement"]
    lines += ["", f"Greedy agreement with {greedy['reference']}:", ""]
    for label, figures in greedy.items():
        if label != "reference":
            lines.append(
                f"- {label}: exact match {figures['exact_match_rate']}, common prefix share "
                f"{figures['common_prefix_share']} over {figures['compared']} prompts"
            )
    settings = report["settings"]
    lines += [
        "",
        f"{settings['rounds']} rounds alternating the target order, {settings['requests_per_class']} "
        f"requests per class per round at concurrency {settings['concurrency']}, length scale "
        f"{settings['length_scale']}.",
    ]
    load = report["machine"].get("load_average_1m")
    if load:
        lines += [
            "",
            f"1-minute load average as the rounds started and after the last: "
            f"{', '.join(f'{value:.1f}' for value in load)} (on {report['machine']['cpu_count']} CPUs).",
        ]
    return "\n".join(lines) + "\n"


def render_text(report: dict[str, Any]) -> str:
    rows = [
        [
            c,
            label,
            _ms(s[c]["ttft"]["p50"]),
            _ms(s[c]["itl"]["p50"]),
            _ms(s[c]["e2e"]["p50"]),
            "-" if s[c]["output_tokens_per_s"] is None else f"{s[c]['output_tokens_per_s']:.1f}",
            f"{s[c]['errors']}/{s[c]['requests']}",
        ]
        for c in report["settings"]["classes"]
        for label, s in report["results"].items()
    ]
    return render_table(["class", "target", "TTFT p50 ms", "ITL p50 ms", "E2E p50 ms", "output tok/s", "errors"], rows)


def write_outputs(out: Path, report: dict[str, Any], records: dict[str, dict[str, list[RequestRecord]]]) -> None:
    from pagoda.bench.plots import plot_bars, plot_target_cdfs

    out.mkdir(parents=True, exist_ok=True)
    write_json(out / "shootout.json", report)
    (out / "shootout.md").write_text(render_markdown(report))
    for class_name in report["settings"]["classes"]:
        runs = {label: by_class[class_name] for label, by_class in records.items()}
        plot_target_cdfs(
            runs, out / f"cdf_{class_name}.png", f"{class_name}: latency CDFs", metrics=("ttft", "itl", "e2e")
        )
    bars = {
        f"{c}: output tok/s (higher is better)": {
            label: by_class[c]["output_tokens_per_s"] or 0.0 for label, by_class in report["results"].items()
        }
        for c in report["settings"]["classes"]
    }
    plot_bars(bars, out / "throughput.png", "throughput by class")
