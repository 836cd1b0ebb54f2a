"""The `transformers` baseline: `generate` in static batches, left padding, greedy, exact lengths.

Each batch generates as many tokens as its longest request needs (min_new_tokens = max_new_tokens,
so EOS never ends it early); a shorter request's latency is the time of its own last token, while
its slot keeps computing until the batch ends — that idle work is what static batching costs.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from pagoda.bench.records import BenchRequest, RequestRecord, RunResult


class HFGenerateTarget:
    """A loaded transformers model that runs request lists in static batches."""

    def __init__(
        self, model_dir: str, *, batch_size: int = 8, dtype: str = "float32", num_threads: int | None = None
    ) -> None:
        import torch
        from transformers import AutoModelForCausalLM

        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not hasattr(torch, dtype) or not isinstance(getattr(torch, dtype), torch.dtype):
            raise ValueError(f"unknown torch dtype {dtype!r}")
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.torch = torch
        self.batch_size = batch_size
        self.model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=getattr(torch, dtype), local_files_only=True)
        self.model.eval()
        config = self.model.config
        eos = getattr(config, "eos_token_id", None)
        eos = eos[0] if isinstance(eos, list) else eos
        pad = getattr(config, "pad_token_id", None)
        self.pad_token_id = pad if pad is not None else (eos if eos is not None else 0)

    def _generate(self, prompts: list[list[int]], max_new: int) -> list[float]:
        """One static batch; returns the wall time (perf_counter) at which each step's token was ready."""
        from transformers import StoppingCriteria, StoppingCriteriaList

        torch = self.torch
        step_times: list[float] = []

        class StepClock(StoppingCriteria):
            def __call__(self, input_ids: Any, scores: Any, **kwargs: Any) -> Any:
                step_times.append(time.perf_counter())
                return torch.zeros(input_ids.shape[0], dtype=torch.bool, device=input_ids.device)

        width = max(len(p) for p in prompts)
        input_ids = torch.tensor([[self.pad_token_id] * (width - len(p)) + p for p in prompts])
        attention_mask = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
        with torch.inference_mode():
            self.model.generate(
                input_ids=input_ids,
                attention_mask=attention_mask,
                do_sample=False,
                max_new_tokens=max_new,
                min_new_tokens=max_new,
                pad_token_id=self.pad_token_id,
                stopping_criteria=StoppingCriteriaList([StepClock()]),
            )
        return step_times

    def run(
        self,
        requests: Sequence[BenchRequest],
        encode: Callable[[str], list[int]],
        warmup_requests: Sequence[BenchRequest] = (),
    ) -> RunResult:
        if warmup_requests:
            self._generate(
                [r.prompt_ids(encode) for r in warmup_requests[: self.batch_size]],
                max(r.output_len for r in warmup_requests[: self.batch_size]),
            )
        prompts = [r.prompt_ids(encode) for r in requests]
        records: list[RequestRecord] = []
        started_at = time.time()
        t0 = time.perf_counter()
        for lo in range(0, len(requests), self.batch_size):
            group = requests[lo : lo + self.batch_size]
            times = self._generate(prompts[lo : lo + self.batch_size], max(r.output_len for r in group))
            for request in group:
                mine = times[: request.output_len]
                records.append(
                    RequestRecord(
                        request.index,
                        request.class_name,
                        request.prompt_len,
                        request.output_len,
                        start=0.0,
                        ttft=mine[0] - t0,
                        itls=[b - a for a, b in zip(mine, mine[1:])],
                        e2e=mine[-1] - t0,
                        output_tokens=len(mine),
                        status=200,
                    )
                )
        duration = time.perf_counter() - t0
        return RunResult(records, duration, started_at)
