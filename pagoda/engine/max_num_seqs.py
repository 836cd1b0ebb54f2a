"""The default of --max-num-seqs: what the KV pool and this hardware sustain.

A fixed default (vLLM's 256) lets an overloaded server admit so many sequences that every
admitted stream crawls. When --max-num-seqs is not given, the engine picks the largest count
that both

- the KV pool holds: a running sequence holds at least one block (pagoda.core.capacity, the
  formula `pagoda plan` uses), so more running sequences than blocks can only thrash; and
- this hardware decodes within the inter-token-latency budget (--max-num-seqs-itl-ms): one
  decode step of that many sequences takes at most the budget.

The hardware bound comes from a calibration at startup: decode steps of short dummy sequences
at growing batch sizes (1, 4, 16, 64, 256), stopping at the first size over the budget, then
interpolating linearly between the last size within it and that one (decode time grows about
linearly with the batch). Short contexts are the fast case, so real steps -- longer contexts,
prefill chunks beside the decodes -- take longer: the budget is a ceiling, not a promise.
The result never exceeds 256. An explicit --max-num-seqs always wins and skips calibration.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, Protocol

from pagoda.config import MAX_NUM_SEQS_CEILING as CEILING
from pagoda.config import EngineConfig
from pagoda.core.capacity import sequences_that_fit
from pagoda.sampling_params import SamplingParams

logger = logging.getLogger(__name__)

PROBE_BATCH_SIZES = (1, 4, 16, 64, 256)
PROBE_PROMPT_TOKENS = 4  # with the 3 tokens a probe decodes: one block of 8 or more


@dataclass(frozen=True)
class MaxNumSeqsChoice:
    """The value in use and why."""

    value: int
    explicit: bool  # --max-num-seqs was given
    kv_bound: int | None = None  # sequences the KV pool holds (one block each)
    hardware_bound: int | None = None  # sequences one decode step serves within the budget (None: no
    # measured batch exceeded it)
    itl_budget_ms: float | None = None
    step_ms: tuple[tuple[int, float], ...] = ()  # (batch size, measured decode step ms)
    calibration_s: float = 0.0

    def describe(self) -> str:
        """One line for the startup banner."""
        if self.explicit:
            return f"{self.value} (--max-num-seqs)"
        measured = ", ".join(f"{batch}: {ms:.1f} ms" for batch, ms in self.step_ms)
        if self.hardware_bound is not None and self.hardware_bound == self.value:
            binding = "ITL budget"
        elif self.kv_bound is not None and self.kv_bound == self.value:
            binding = "KV pool"
        else:
            binding = f"ceiling of {CEILING}"
        if self.itl_budget_ms is None:
            return f"{self.value} (auto, bound by the {binding}: KV pool holds {self.kv_bound}; no ITL budget)"
        fit = self.hardware_bound if self.hardware_bound is not None else \
            f"every batch measured (up to {self.step_ms[-1][0]})" if self.step_ms else "-"
        return (f"{self.value} (auto, bound by the {binding}: KV pool holds {self.kv_bound}, decode steps "
                f"within {self.itl_budget_ms:g} ms fit {fit} [{measured}], "
                f"calibrated in {self.calibration_s:.2f} s)")


def choose_max_num_seqs(*, num_blocks: int, block_size: int, max_num_batched_tokens: int,
                        itl_budget_ms: float | None, step_time_ms: Callable[[int], float] | None,
                        ceiling: int = CEILING) -> MaxNumSeqsChoice:
    """The default for a pool of `num_blocks` and a hardware whose decode step of `batch`
    sequences takes `step_time_ms(batch)` ms (called for growing batches, stopping early).
    No step decodes more sequences than the step's token budget, so larger batches are never
    measured: within budget up to there means within budget for every step that can occur."""
    started = time.perf_counter()
    kv_bound = sequences_that_fit(num_blocks, block_size, 1)
    cap = max(1, min(ceiling, kv_bound))
    largest_step = min(cap, max_num_batched_tokens)
    sizes = sorted({b for b in PROBE_BATCH_SIZES if b < largest_step} | {largest_step})
    measured: list[tuple[int, float]] = []
    hardware: int | None = None
    for batch in sizes if itl_budget_ms is not None and step_time_ms is not None else ():
        ms = step_time_ms(batch)
        if ms > itl_budget_ms:  # confirm: a moment of other work on the machine must not decide it
            ms = min(ms, step_time_ms(batch))
        measured.append((batch, ms))
        if ms > itl_budget_ms:
            if len(measured) == 1:
                hardware = 1  # one sequence alone is over budget: still serve one at a time
            else:
                (good, good_ms), (bad, bad_ms) = measured[-2], measured[-1]
                slope = (bad_ms - good_ms) / (bad - good)
                extra = int((itl_budget_ms - good_ms) / slope) if slope > 0 else 0
                hardware = max(good, min(bad - 1, good + extra))
            break
    return MaxNumSeqsChoice(value=min(cap, hardware or cap), explicit=False, kv_bound=kv_bound,
                            hardware_bound=hardware, itl_budget_ms=itl_budget_ms, step_ms=tuple(measured),
                            calibration_s=time.perf_counter() - started)


class CalibratedEngine(Protocol):
    """What calibration uses of the EngineCore (which imports this module)."""

    config: EngineConfig
    model_config: Any
    num_blocks: int
    max_model_len: int
    requests: dict[str, list[Any]]

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams) -> Any: ...
    def step(self) -> Any: ...
    def abort_request(self, request_ids: list[str]) -> Any: ...
    def release(self, request_id: str) -> None: ...


def calibrate_decode_step(core: CalibratedEngine) -> Callable[[int], float]:
    """A step-time function that runs real engine steps: `batch` dummy requests of a few
    tokens are prefilled, then three decode steps are timed (the fastest counts: the first
    steps pay one-time costs and the machine may be busy with something else for a moment),
    and the requests are aborted, leaving every block free. The caller resets the statistics
    these steps touched."""
    vocab = core.model_config.vocab_size
    room = min(core.max_model_len, core.num_blocks * core.config.block_size)
    prompt_tokens = max(1, min(PROBE_PROMPT_TOKENS, room - 3))
    # As many tokens as a request may ask for: none finishes during a chunked prefill of the others.
    params = SamplingParams(temperature=0.0, max_tokens=max(1, room - prompt_tokens), ignore_eos=True)

    def step_time_ms(batch: int) -> float:
        ids = [f"calibration-{batch}-{i}" for i in range(batch)]
        for i, request_id in enumerate(ids):
            prompt = [(7 * i + 13 * j + 1) % vocab for j in range(prompt_tokens)]
            core.add_request(request_id, prompt, params)
        try:
            while any(not s.num_output_tokens for r in ids for s in core.requests[r]):
                core.step()  # prefill (in chunks if the token budget is smaller than the batch)
            timings = []
            for _ in range(3):
                started = time.perf_counter()
                core.step()
                timings.append(time.perf_counter() - started)
            return min(timings) * 1000.0
        finally:
            core.abort_request(ids)  # frees their blocks now
            for request_id in ids:
                core.release(request_id)

    return step_time_ms


def resolve_max_num_seqs(core: CalibratedEngine, explicit: int | None, itl_budget_ms: float | None
                         ) -> MaxNumSeqsChoice:
    """The value to use: `explicit` (--max-num-seqs) when given, else the default: calibrated
    against `itl_budget_ms`, or bound by the KV pool alone when there is no budget (offline)."""
    if explicit is not None:
        return MaxNumSeqsChoice(value=explicit, explicit=True)
    choice = choose_max_num_seqs(num_blocks=core.num_blocks, block_size=core.config.block_size,
                                 max_num_batched_tokens=core.config.max_num_batched_tokens,
                                 itl_budget_ms=itl_budget_ms,
                                 step_time_ms=calibrate_decode_step(core) if itl_budget_ms is not None else None)
    logger.info("max_num_seqs %s", choice.describe())
    return choice
