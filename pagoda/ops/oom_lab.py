"""`pagoda bench oom-lab`: where a server starts preempting and refusing, measured, beside what
`pagoda plan` predicts for the same model and KV pool.

For each (prompt length, output length) point the lab sends `c` identical-length requests at
once (distinct token ids, so no prefix is shared; ignore_eos, so every request reaches its full
length), for c = 1, 2, ... and reads the server's preemption counter around each step. The
preemption boundary is the first c that preempts; plan predicts it as one more than the
sequences of prompt + output tokens its KV blocks hold. Stepping stops at the first refusal or
time-out (a request whose tokens exceed the whole pool is refused outright) or at
--max-concurrency. Preemption shows where outputs outgrow the pool (short prompts, long
outputs: every request is admitted, then they grow); where prompts alone fill the pool the
scheduler queues the extra requests instead, which each step's queue time shows. The lab lives
in ops/ because it needs both bench's HTTP client and plan.
"""

from __future__ import annotations

import asyncio
import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

from pagoda.bench.loadgen import LoadConfig, send_request
from pagoda.bench.records import BenchRequest
from pagoda.bench.server_metrics import metrics_delta, scrape
from pagoda.config import parse_bytes
from pagoda.plan import RequestClass, build_plan, kv_bytes_per_token, load_model, normalize_dtype, weight_bytes

AGREEMENT = 0.10  # measured and planned preemption boundaries within this fraction of plan's


@dataclass
class OomLabOptions:
    url: str
    model_dir: str  # the served weights' directory (plan reads its config.json)
    prompt_lens: list[int]
    output_lens: list[int]
    max_concurrency: int = 32
    num_kv_blocks: int | None = None  # the server's --num-kv-blocks, or
    kv_cache_memory: str | None = None  # its --kv-cache-memory
    block_size: int = 16
    kv_dtype: str | None = None  # default: the model config's dtype
    model: str | None = None  # served model name (default: the first of /v1/models)
    api_key: str | None = None
    timeout_s: float = 120.0
    out: str | None = None

    def __post_init__(self) -> None:
        if (self.num_kv_blocks is None) == (self.kv_cache_memory is None):
            raise ValueError("give the server's pool: --num-kv-blocks or --kv-cache-memory (one of them)")
        if not self.prompt_lens or not self.output_lens or min(self.prompt_lens + self.output_lens) < 1:
            raise ValueError("--prompt-lens and --output-lens must be positive token counts")
        if self.max_concurrency < 1:
            raise ValueError(f"--max-concurrency must be >= 1, got {self.max_concurrency}")


@dataclass
class LabStep:
    concurrency: int
    preemptions: float
    errors: int
    error: str | None = None
    queue_time_p99_s: float | None = None


@dataclass
class LabPoint:
    prompt_len: int
    output_len: int
    planned_fit: int  # sequences plan says the pool holds at once
    steps: list[LabStep] = field(default_factory=list)

    @property
    def planned_boundary(self) -> int:
        return self.planned_fit + 1

    @property
    def measured_boundary(self) -> int | None:
        """The first concurrency that preempted (None: none did up to the steps run)."""
        return next((s.concurrency for s in self.steps if s.preemptions > 0), None)

    @property
    def refused_at(self) -> int | None:
        return next((s.concurrency for s in self.steps if s.errors), None)

    @property
    def agrees(self) -> bool | None:
        measured = self.measured_boundary
        if self.planned_fit == 0:  # plan says one request does not fit: it must be refused
            return self.refused_at == 1
        if measured is None:
            return None
        return abs(measured - self.planned_boundary) <= AGREEMENT * self.planned_boundary


@dataclass
class LabReport:
    url: str
    model_dir: str
    num_kv_blocks: int
    block_size: int
    kv_bytes_per_token: int
    points: list[LabPoint]

    def to_dict(self) -> dict[str, Any]:
        return {
            "url": self.url,
            "model_dir": self.model_dir,
            "plan_num_kv_blocks": self.num_kv_blocks,
            "block_size": self.block_size,
            "kv_bytes_per_token": self.kv_bytes_per_token,
            "points": [
                {
                    "prompt_len": p.prompt_len,
                    "output_len": p.output_len,
                    "planned_fit": p.planned_fit,
                    "planned_boundary": p.planned_boundary,
                    "measured_boundary": p.measured_boundary,
                    "refused_at": p.refused_at,
                    "agrees": p.agrees,
                    "steps": [vars(s) for s in p.steps],
                }
                for p in self.points
            ],
        }


def _planned(options: OomLabOptions) -> tuple[int, int, dict[tuple[int, int], int]]:
    """plan's KV blocks for the server's pool, its KV bytes per token, and each point's fit."""
    shape, params = load_model(options.model_dir)
    kv_dtype = normalize_dtype(options.kv_dtype or shape.config_dtype or "bf16")
    kv_token = kv_bytes_per_token(shape, kv_dtype)
    block_bytes = kv_token * options.block_size
    kv_memory = (
        options.num_kv_blocks * block_bytes
        if options.num_kv_blocks is not None
        else parse_bytes(options.kv_cache_memory or "0")
    )
    weights = weight_bytes(params, kv_dtype if kv_dtype not in ("fp8", "int8") else "bf16")
    points = [(p, o) for p in options.prompt_lens for o in options.output_lens]
    # plan sizes the pool as memory - reserve - weights: give it exactly the server's pool.
    plan = build_plan(
        shape,
        params,
        model=options.model_dir,
        memory_bytes=weights + kv_memory,
        dtype=kv_dtype if kv_dtype not in ("fp8", "int8") else "bf16",
        kv_dtype=kv_dtype,
        context=max(p + o for p, o in points),
        block_size=options.block_size,
        reserve_bytes=0,
        classes=[RequestClass(f"{p}/{o}", p, o, p, o) for p, o in points],
    )
    return plan.num_blocks, kv_token, {(p, o): row.fits_at_p50 for (p, o), row in zip(points, plan.classes)}


async def _step(
    client: httpx.AsyncClient,
    config: LoadConfig,
    prompt_len: int,
    output_len: int,
    concurrency: int,
    rng: random.Random,
) -> LabStep:
    requests = [
        BenchRequest(i, "oom-lab", [rng.randrange(10, 5000) for _ in range(prompt_len)], [], prompt_len, output_len)
        for i in range(concurrency)
    ]
    before = await scrape(client, config.metrics_url)
    records = await asyncio.gather(*(send_request(client, config, r, 0.0) for r in requests))
    after = await scrape(client, config.metrics_url)
    delta = metrics_delta(before or {}, after or {})
    failed = [r for r in records if not r.ok]
    return LabStep(
        concurrency,
        (delta.num_preemptions or 0.0) if delta else 0.0,
        len(failed),
        failed[0].error if failed else None,
        delta.queue_time_p99 if delta else None,
    )


async def _run(options: OomLabOptions, fits: dict[tuple[int, int], int]) -> list[LabPoint]:
    config = LoadConfig(
        base_url=options.url,
        model=options.model or "",
        num_requests=1,
        ignore_eos=True,
        timeout=options.timeout_s,
        api_key=options.api_key,
    )
    rng = random.Random(0)
    points = []
    limits = httpx.Limits(max_connections=options.max_concurrency + 4)
    async with httpx.AsyncClient(
        timeout=httpx.Timeout(options.timeout_s, connect=30.0), limits=limits, trust_env=False
    ) as client:
        if not config.model:
            response = await client.get(
                config.base_url + "/v1/models",
                headers=({"Authorization": f"Bearer {options.api_key}"} if options.api_key else {}),
            )
            config.model = response.json()["data"][0]["id"]
        for (prompt_len, output_len), fit in fits.items():
            point = LabPoint(prompt_len, output_len, fit)
            for concurrency in range(1, options.max_concurrency + 1):
                step = await _step(client, config, prompt_len, output_len, concurrency, rng)
                point.steps.append(step)
                if step.errors:
                    break
            points.append(point)
    return points


def run_oom_lab(options: OomLabOptions) -> LabReport:
    num_blocks, kv_token, fits = _planned(options)
    points = asyncio.run(_run(options, fits))
    report = LabReport(options.url, options.model_dir, num_blocks, options.block_size, kv_token, points)
    if options.out:
        _write(report, Path(options.out))
    return report


def render_lab(report: LabReport) -> str:
    lines = [
        f"OOM lab against {report.url}: plan gives {report.num_kv_blocks} KV blocks of "
        f"{report.block_size} tokens ({report.kv_bytes_per_token} bytes per token)",
        "prompt  output  plan fits  plan preempts at  measured preempts at  refused at  agree",
    ]
    for p in report.points:
        agree = {True: "yes", False: "NO", None: "-"}[p.agrees]
        lines.append(
            f"{p.prompt_len:>6}  {p.output_len:>6}  {p.planned_fit:>9}  {p.planned_boundary:>16}  "
            f"{p.measured_boundary or '-':>20}  {p.refused_at or '-':>10}  {agree}"
        )
    return "\n".join(lines)


def _write(report: LabReport, out: Path) -> None:
    import json

    from pagoda.bench.plots import plot_bars

    out.mkdir(parents=True, exist_ok=True)
    (out / "oom_lab.json").write_text(json.dumps(report.to_dict(), indent=2))
    (out / "oom_lab.md").write_text("```\n" + render_lab(report) + "\n```\n")
    bars = {
        f"{p.prompt_len}+{p.output_len} tokens: preempts at (concurrency)": {
            "plan": float(p.planned_boundary),
            "measured": float(p.measured_boundary or 0),
        }
        for p in report.points
    }
    if bars:
        plot_bars(bars, out / "oom_lab.png", "preemption boundary: measured vs pagoda plan")
