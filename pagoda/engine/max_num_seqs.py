"""The default of --max-num-seqs: what the KV pool and this hardware sustain.

A fixed default (vLLM's 256) lets an overloaded server admit so many sequences that every
admitted stream crawls; a default bound by latency alone serves a slow model one request at a
time although a batch of them costs barely more per step. When --max-num-seqs is not given, the
engine picks the largest count that the KV pool holds and, within that,

- at least the throughput knee: the batch beyond which a decode step's throughput (sequences /
  step time) stops rising by THROUGHPUT_RISE or more. Below it a larger batch serves every
  waiting request sooner at almost no cost to each: the inter-token-latency budget never cuts
  concurrency below the knee;
- beyond the knee, as many sequences as one decode step serves within the ITL budget
  (--max-num-seqs-itl-ms): there more sequences only slow every stream, and the budget is the
  latency the default may reach.

The KV pool bound counts what running sequences actually hold: at least one block each
(pagoda.core.capacity, the formula `pagoda plan` uses), so more running sequences than blocks
can only thrash. The scheduler admits a request when its blocks fit beside what the running ones
hold, and preempts the lowest-ranked one when a growing sequence finds none free
(pagoda.core.scheduler): preemption, not a reservation of every sequence's full context, is the
valve.

A configuration must not change with the load of the moment, so the hardware is measured in
quantities that do not drift: decode steps of short dummy sequences at growing batch sizes
(1, 4, 16, 64, 256) timed as the CPU time of one thread on one core (on CPU the calibration runs
single-threaded; on an accelerator, wall time), the median of several steps per size, stopping
once a size is both over the budget and past the knee, and interpolating linearly between the
last size within the budget and the first over it (decode time grows about linearly with the
batch). More threads only make real steps faster; longer contexts and prefill chunks make them
slower: the budget is a target, not a promise.

The measured steps are cached in a small JSON file (`calibration_cache_path()`:
$XDG_CACHE_HOME/pagoda/max_num_seqs.json, else ~/.cache/pagoda/...), keyed by the machine (CPU
model, cores, torch version, accelerator, torch threads), the model's fingerprint (dtype and
quantization included), the native kernels and the settings that change a step; the next start with the same key
reuses them, so two starts give the same value. Deleting
the file recalibrates; a damaged file is ignored (one log line) and rewritten. The result never
exceeds 256. An explicit --max-num-seqs always wins and skips calibration and cache.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import logging
import os
import platform
import statistics
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Protocol

import torch

from pagoda.config import MAX_NUM_SEQS_CEILING as CEILING
from pagoda.config import EngineConfig
from pagoda.core.capacity import sequences_that_fit
from pagoda.engine.engine_request import EngineRequest
from pagoda.kv_transfer.tiers import model_fingerprint
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PROBE_BATCH_SIZES = (1, 4, 16, 64, 256)
PROBE_PROMPT_TOKENS = 4  # with the decode steps a probe times: one block of 8 or more
PROBE_DECODE_STEPS = 5  # timed per batch size; the median counts
CACHE_FILE_NAME = "max_num_seqs.json"
CACHE_VERSION = 1
CACHE_MAX_ENTRIES = 64


@dataclass(frozen=True)
class MaxNumSeqsChoice:
    """The value in use and why."""

    value: int
    explicit: bool  # --max-num-seqs was given
    kv_bound: int | None = None  # sequences the KV pool holds, one block each
    hardware_bound: int | None = None  # sequences one decode step serves within the budget (None: no
    # measured batch exceeded it)
    itl_budget_ms: float | None = None
    step_ms: tuple[tuple[int, float], ...] = ()  # (batch size, measured decode step ms)
    calibration_s: float = 0.0
    cached: bool = False  # every step time came from the calibration cache
    throughput_knee: int | None = None  # the batch beyond which throughput stops rising (None: not measured)

    def describe(self) -> str:
        """One line for the startup banner."""
        if self.explicit:
            return f"{self.value} (--max-num-seqs)"
        measured = ", ".join(f"{batch}: {ms:.1f} ms" for batch, ms in self.step_ms)
        knee_binds = self.throughput_knee == self.value and self.hardware_bound is not None
        if knee_binds and self.hardware_bound is not None and self.hardware_bound < self.value:
            binding = "throughput knee"
        elif self.hardware_bound is not None and self.hardware_bound == self.value:
            binding = "ITL budget"
        elif self.kv_bound is not None and self.kv_bound == self.value:
            binding = "KV pool"
        else:
            binding = f"ceiling of {CEILING}"
        holds = f"KV pool holds {self.kv_bound} (a block each; preemption when they grow)"
        if self.itl_budget_ms is None:
            return f"{self.value} (auto, bound by the {binding}: {holds}; no ITL budget)"
        fit = (
            self.hardware_bound
            if self.hardware_bound is not None
            else f"every batch measured (up to {self.step_ms[-1][0]})"
            if self.step_ms
            else "-"
        )
        knee = f"throughput rises up to {self.throughput_knee}, " if self.throughput_knee is not None else ""
        source = "from the calibration cache" if self.cached else f"calibrated in {self.calibration_s:.2f} s"
        return (
            f"{self.value} (auto, bound by the {binding}: {holds}, {knee}decode steps "
            f"within {self.itl_budget_ms:g} ms fit {fit} [{measured}], {source})"
        )


# A larger batch counts as raising throughput when its sequences per second are at least this much
# higher (below it, step-time noise and the rising cost per sequence make it a wash).
THROUGHPUT_RISE = 0.10


def throughput_knee(measured: list[tuple[int, float]]) -> int | None:
    """The batch beyond which throughput (batch / step time) stops rising by THROUGHPUT_RISE: the
    first measured size the next one does not beat by that much; the last size when each beats the
    one before (throughput still rising where the measurements end); None when nothing was measured."""
    for (batch, ms), (next_batch, next_ms) in zip(measured, measured[1:]):
        if next_batch / max(next_ms, 1e-9) < batch / max(ms, 1e-9) * (1 + THROUGHPUT_RISE):
            return batch
    return measured[-1][0] if measured else None


def choose_max_num_seqs(
    *,
    num_blocks: int,
    block_size: int,
    max_num_batched_tokens: int,
    itl_budget_ms: float | None,
    step_time_ms: Callable[[int], float] | None,
    ceiling: int = CEILING,
) -> MaxNumSeqsChoice:
    """The default for a pool of `num_blocks` and a hardware whose decode step of `batch`
    sequences takes `step_time_ms(batch)` ms (called for growing batches, stopping once one is
    over the budget and past the throughput knee). No step decodes more sequences than the
    step's token budget, so larger batches are never measured."""
    started = time.perf_counter()
    kv_bound = sequences_that_fit(num_blocks, block_size, 1)
    cap = max(1, min(ceiling, kv_bound))
    largest_step = min(cap, max_num_batched_tokens)
    sizes = sorted({b for b in PROBE_BATCH_SIZES if b < largest_step} | {largest_step})
    measured: list[tuple[int, float]] = []
    hardware: int | None = None
    probes = sizes if itl_budget_ms is not None and step_time_ms is not None else []
    for batch in probes:
        assert itl_budget_ms is not None and step_time_ms is not None  # probes is empty otherwise
        ms = step_time_ms(batch)
        if ms > itl_budget_ms and hardware is None:  # confirm: a moment of other work must not decide it
            ms = min(ms, step_time_ms(batch))
        measured.append((batch, ms))
        if ms > itl_budget_ms and hardware is None:
            if len(measured) == 1:
                hardware = 1  # one sequence alone is over budget
            else:
                (good, good_ms), (bad, bad_ms) = measured[-2], measured[-1]
                slope = (bad_ms - good_ms) / (bad - good)
                extra = int((itl_budget_ms - good_ms) / slope) if slope > 0 else 0
                hardware = max(good, min(bad - 1, good + extra))
        if hardware is not None and throughput_knee(measured) != batch:
            break  # over the budget and throughput has stopped rising: larger batches cannot count
    knee = throughput_knee(measured)
    value = min(cap, max(hardware or cap, knee or 1))
    return MaxNumSeqsChoice(
        value=value,
        explicit=False,
        kv_bound=kv_bound,
        hardware_bound=hardware,
        itl_budget_ms=itl_budget_ms,
        step_ms=tuple(measured),
        calibration_s=time.perf_counter() - started,
        throughput_knee=knee,
    )


class CalibratedEngine(Protocol):
    """What calibration uses of the EngineCore (which imports this module)."""

    config: EngineConfig
    model_config: Any
    num_blocks: int
    max_model_len: int
    requests: dict[str, list[Any]]
    device: torch.device
    dtype: torch.dtype
    executor: Any
    kv_cache: Any  # a hybrid model's state slots bound the sequences (pagoda.core.state_slots)

    def add_request(self, request: EngineRequest) -> Any: ...
    def step(self) -> Any: ...
    def abort_request(self, request_ids: list[str]) -> Any: ...
    def release(self, request_id: str) -> None: ...


def calibrate_decode_step(core: CalibratedEngine) -> Callable[[int], float]:
    """A step-time function that runs real engine steps: `batch` dummy requests of a few
    tokens are prefilled, then PROBE_DECODE_STEPS decode steps are timed (the median counts:
    the first steps pay one-time costs), and the requests are aborted, leaving every block
    free. On CPU the steps run on one thread and are timed by that thread's CPU time, which
    other processes competing for the cores do not inflate. The caller resets the statistics
    these steps touched."""
    one_core = core.device.type == "cpu" and core.executor is None
    clock = time.thread_time if one_core else time.perf_counter
    vocab = core.model_config.vocab_size
    room = min(core.max_model_len, core.num_blocks * core.config.block_size)
    decode_steps = PROBE_DECODE_STEPS + 1  # the first decode step also finishes the prefill's bookkeeping
    prompt_tokens = max(1, min(PROBE_PROMPT_TOKENS, room - decode_steps))
    # As many tokens as a request may ask for: none finishes during a chunked prefill of the others.
    params = SamplingParams(temperature=0.0, max_tokens=max(1, room - prompt_tokens), ignore_eos=True)

    def step_time_ms(batch: int) -> float:
        ids = [f"calibration-{batch}-{i}" for i in range(batch)]
        threads = torch.get_num_threads()
        if one_core:
            torch.set_num_threads(1)
        vision = getattr(core.model_config, "vision", None)  # a placeholder without its image is refused
        image_token = vision.image_token_id if vision is not None else None
        for i, request_id in enumerate(ids):
            prompt = [(7 * i + 13 * j + 1) % vocab for j in range(prompt_tokens)]
            prompt = [(t + 1) % vocab if t == image_token else t for t in prompt]
            core.add_request(EngineRequest(request_id, prompt, params))
        try:
            while any(not s.num_output_tokens for r in ids for s in core.requests[r]):
                core.step()  # prefill (in chunks if the token budget is smaller than the batch)
            timings = []
            for _ in range(decode_steps):
                started = clock()
                core.step()
                timings.append(clock() - started)
            return statistics.median(timings[1:]) * 1000.0
        finally:
            torch.set_num_threads(threads)
            core.abort_request(ids)  # frees their blocks now
            for request_id in ids:
                core.release(request_id)

    return step_time_ms


def calibration_cache_path() -> Path:
    """$XDG_CACHE_HOME/pagoda/max_num_seqs.json, else ~/.cache/pagoda/max_num_seqs.json."""
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "pagoda" / CACHE_FILE_NAME


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo", encoding="utf-8", errors="replace") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def calibration_key(core: CalibratedEngine, itl_budget_ms: float) -> str:
    """What a calibration depends on: the machine, the model and the settings that change a step
    (the model's fingerprint holds its dtype and weight quantization; the threads and the native
    kernels change every step's time as much as the model does)."""
    config = core.config
    accelerator = torch.cuda.get_device_name(core.device) if core.device.type == "cuda" else core.device.type
    parts = {
        "machine": [_cpu_model(), os.cpu_count(), torch.__version__, accelerator, torch.get_num_threads()],
        "kernels": [
            config.native_kernels,
            config.quantization,
            config.quantization_group_size,
            config.quantization_zero_point,
        ],
        "model": model_fingerprint(config, str(core.dtype).removeprefix("torch.")).hex(),
        "settings": [
            core.num_blocks,
            config.block_size,
            core.max_model_len,
            config.max_num_batched_tokens,
            itl_budget_ms,
            config.kv_cache_dtype,
            config.speculative,
            config.num_speculative_tokens,
            config.enable_lora,
            config.max_loras,
            config.max_lora_rank,
            config.tensor_parallel_size,
            config.attention_backend,
            config.enforce_eager,
            config.enable_chunked_prefill,
        ],
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _read_cache(path: Path) -> dict[str, Any]:
    """The cache's entries; an absent file is empty, a damaged one is ignored with one log line."""
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
        if (
            not isinstance(data, dict)
            or data.get("version") != CACHE_VERSION
            or not isinstance(data.get("entries"), dict)
        ):
            raise ValueError("not a calibration cache of this version")
        return data["entries"]
    except FileNotFoundError:
        return {}
    except (OSError, ValueError) as exc:
        logger.warning("ignoring the --max-num-seqs calibration cache %s (%s); calibrating again", path, exc)
        return {}


def _cached_steps(entry: Any) -> dict[int, float] | None:
    try:
        steps = {int(batch): float(ms) for batch, ms in entry["step_ms"]}
    except (TypeError, KeyError, ValueError):
        return None
    return steps if all(ms >= 0 for ms in steps.values()) else None


def _write_cache(path: Path, entries: dict[str, Any]) -> None:
    recent = sorted(entries.items(), key=lambda kv: kv[1].get("written", 0) if isinstance(kv[1], dict) else 0)
    body = json.dumps({"version": CACHE_VERSION, "entries": dict(recent[-CACHE_MAX_ENTRIES:])}, indent=1)
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".tmp")
        with os.fdopen(fd, "w", encoding="utf-8") as f:
            f.write(body)
        os.replace(tmp, path)
    except OSError as exc:  # a read-only home: calibrate at every start, nothing worse
        logger.info("could not write the --max-num-seqs calibration cache %s: %s", path, exc)


def resolve_max_num_seqs(
    core: CalibratedEngine, explicit: int | None, itl_budget_ms: float | None, cache_path: Path | None = None
) -> MaxNumSeqsChoice:
    """The value to use: `explicit` (--max-num-seqs) when given, else the default: bound by the
    KV pool and calibrated against `itl_budget_ms` and the throughput knee (the step times read
    from the cache at `cache_path`, default calibration_cache_path(), when this machine and model
    were calibrated before), or bound by the KV pool alone when there is no budget (offline)."""
    if explicit is not None:
        return MaxNumSeqsChoice(value=explicit, explicit=True)
    slots = core.kv_cache.state_slots
    common = dict(
        num_blocks=core.num_blocks,
        block_size=core.config.block_size,
        max_num_batched_tokens=core.config.max_num_batched_tokens,
        ceiling=CEILING if slots is None else min(CEILING, slots.num_slots),
    )
    if itl_budget_ms is None:
        choice = choose_max_num_seqs(**common, itl_budget_ms=None, step_time_ms=None)
        logger.info("max_num_seqs %s", choice.describe())
        return choice
    path = cache_path or calibration_cache_path()
    key = calibration_key(core, itl_budget_ms)
    entries = _read_cache(path)
    cached = _cached_steps(entries.get(key)) or {}
    measure = calibrate_decode_step(core)
    measured_any = False

    def step_time_ms(batch: int) -> float:
        nonlocal measured_any
        if batch not in cached:
            cached[batch] = measure(batch)
            measured_any = True
        return cached[batch]

    choice = choose_max_num_seqs(**common, itl_budget_ms=itl_budget_ms, step_time_ms=step_time_ms)
    if measured_any:
        entries[key] = {
            "step_ms": sorted(cached.items()),
            "written": time.time(),
            "machine": f"{_cpu_model()}, {os.cpu_count()} cores, torch {torch.__version__}",
            "model": str(core.config.model),
        }
        _write_cache(path, entries)
    else:
        choice = dataclasses.replace(choice, cached=True)
    logger.info("max_num_seqs %s", choice.describe())
    return choice
