"""What each `pagoda bench` run is asked to do, as dataclasses (the CLI fills them from flags),
and the plumbing every run shares: the request list, the output directory, the run metadata.
"""

from __future__ import annotations

import dataclasses
import json
import math
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pagoda.config import EngineConfig

if TYPE_CHECKING:
    from pagoda.bench.loadgen import LoadConfig
    from pagoda.bench.records import BenchRequest
    from pagoda.bench.workloads import Workload, WorkloadSpec

DEFAULT_NUM_REQUESTS = 100
# The warmup requests come from the same classes with another seed, so that they never warm the
# prefix cache for the measured ones.
WARMUP_SEED_OFFSET = 7919


@dataclass
class WorkloadOptions:
    """Which requests to send: class mix, length overrides, count, seed."""

    mix: str = "chat"
    param: list[str] = field(default_factory=list)  # CLASS.FIELD=LENGTH overrides
    length_scale: float = 1.0
    num_requests: int | None = None
    max_model_len: int | None = None
    seed: int = 0
    tokenizer: str | None = None

    def spec(self, seed_offset: int = 0) -> WorkloadSpec:
        from pagoda.bench.workloads import WorkloadSpec, parse_mix, parse_params

        if self.length_scale <= 0:
            raise ValueError(f"--length-scale must be > 0, got {self.length_scale}")
        return WorkloadSpec(
            mix=parse_mix(self.mix),
            overrides=parse_params(self.param),
            length_scale=self.length_scale,
            max_model_len=self.max_model_len,
            seed=self.seed + seed_offset,
        )


@dataclass
class ReportOptions:
    """Where and how a run reports: goodput targets, output directory, label, progress bar."""

    slo: str | None = None
    out: str | None = None
    label: str | None = None
    no_progress: bool = False

    def output_dir(self) -> Path | None:
        if not self.out:
            return None
        path = Path(self.out)
        path.mkdir(parents=True, exist_ok=True)
        return path


@dataclass(kw_only=True)
class BenchRunOptions:
    """What every benchmark run has: the requests to send and how to report."""

    workload: WorkloadOptions = field(default_factory=WorkloadOptions)
    report: ReportOptions = field(default_factory=ReportOptions)


@dataclass(kw_only=True)
class ServeBenchOptions(BenchRunOptions):
    """`pagoda bench serve`: load-test an OpenAI-compatible server over HTTP."""

    load: LoadConfig  # target, arrivals, request knobs, warmup
    sweep_concurrency: str | None = None  # "1,4,16,64": one closed-loop run per concurrency


@dataclass(kw_only=True)
class OfflineBenchOptions(BenchRunOptions):
    """`pagoda bench offline`: the engine in-process, every request at once."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    static_batch: int | None = None  # run B requests at a time, each group to completion
    warmup: int = 2


@dataclass(kw_only=True)
class CompareBenchOptions(BenchRunOptions):
    """`pagoda bench compare`: several targets on one request list, back to back."""

    model: str
    targets: list[str] = field(default_factory=list)
    num_threads: int | None = None  # torch threads of in-process targets
    concurrency: int | None = None  # HTTP targets: closed-loop clients
    request_rate: float = math.inf  # HTTP targets: open-loop rate
    warmup: int = 2


@dataclass
class PreparedRequests:
    workload: Workload
    requests: list[BenchRequest]
    warmup: list[BenchRequest]


def prepare_requests(options: WorkloadOptions, tokenizer_dir: str, num_warmup: int) -> PreparedRequests:
    """The measured request list (built before the clock starts) and the warmup requests."""
    from pagoda.bench.workloads import Workload, make_workload

    workload = make_workload(options.spec(), tokenizer_dir)
    requests = workload.build(options.num_requests or DEFAULT_NUM_REQUESTS)
    warmup = Workload(options.spec(WARMUP_SEED_OFFSET), workload.builder).build(num_warmup)
    return PreparedRequests(workload, requests, warmup)


def parse_json_arg(text: str | None, flag: str) -> dict[str, Any]:
    if not text:
        return {}
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{flag} is not valid JSON: {e}") from None
    if not isinstance(value, dict):
        raise ValueError(f"{flag} must be a JSON object")
    return value


def run_metadata(options: Any) -> dict[str, Any]:
    """What ran, when, where and with which options (the API key redacted), for results.json."""
    from pagoda.bench.report import machine_info

    return {
        "command": " ".join(["pagoda"] + sys.argv[1:]) if sys.argv and "pagoda" in sys.argv[0] else " ".join(sys.argv),
        "date": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "machine": machine_info(),
        "args": _redact_api_keys(dataclasses.asdict(options)),
    }


def _redact_api_keys(value: Any) -> Any:
    if isinstance(value, dict):
        return {k: "<redacted>" if k == "api_key" and v else _redact_api_keys(v) for k, v in value.items()}
    return value
