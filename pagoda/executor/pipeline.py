"""Stage 0's side of pipeline parallelism: the other stages as workers, the hidden states
handed on each step, the logits coming back.

The engine core's process is stage 0 (the embedding and the first layers), like tensor
parallelism's rank 0: the scheduler's step goes to its model runner, which broadcasts the
flattened batch to every stage just before its own forward (each stage needs the positions and
the attention layout of the batch), runs its layers, and hands its hidden states to stage 1
(`hand_on`). Each stage runs its layers and sends its output on; the last stage applies the
final norm and the LM head to the rows the runner samples and sends those logits back to stage
0, whose sampler, grammars and logprobs are the same as without stages. The KV pool's block
ids are the scheduler's: every stage allocates the same blocks for its own layers only.

One batch is in the pipeline at a time (a synchronous pipeline): while stage k computes, the
others wait, so the bubble fraction is about (P - 1) / P of every stage's time;
`stage_busy_seconds` measures it. The process lifecycle (start, watch, a dead stage ending the
engine, stop) is tensor parallelism's (pagoda.executor.tensor_parallel).
"""

from __future__ import annotations

import time

import torch

from pagoda.config import EngineConfig
from pagoda.executor.tensor_parallel import TensorParallelError, TensorParallelExecutor
from pagoda.executor.worker import BUSY_TAG, HIDDEN_TAG, LOGITS_TAG, BusyQuery
from pagoda.model.attention import BatchLayout
from pagoda.model.pipeline import PipelineStage
from pagoda.quant.weight_formats import WeightFormat


class PipelineExecutor(TensorParallelExecutor):
    def __init__(self, config: EngineConfig, device: torch.device, dtype: torch.dtype,
                 weight_format: WeightFormat, num_threads: int, stages: list[PipelineStage],
                 vocab_size: int) -> None:
        """Start stages 1..P-1 (returns once all have joined); this process is stages[0]."""
        super().__init__(config, device, dtype, weight_format, num_threads, stages)
        self.stages = stages
        self.vocab_size = vocab_size
        self._busy_s = 0.0  # stage 0's compute seconds
        self._forward_started = 0.0

    @property
    def stage(self) -> PipelineStage:
        """This process's stage (the first)."""
        return self.stages[0]

    def broadcast_step(self, input_ids: torch.Tensor, positions: torch.Tensor, layouts: list[BatchLayout],
                       logit_rows: list[int], block_copies: list[tuple[int, int]]) -> None:
        super().broadcast_step(input_ids, positions, layouts, logit_rows, block_copies)
        self._forward_started = time.perf_counter()

    def hand_on(self, hidden: torch.Tensor, logit_rows: list[int]) -> torch.Tensor | None:
        """Send stage 0's hidden states to stage 1; the last stage's logits of `logit_rows`
        come back (None when there are none)."""
        self._busy_s += time.perf_counter() - self._forward_started
        host = torch.device("cpu")
        logits = torch.empty(len(logit_rows), self.vocab_size, dtype=torch.float32) if logit_rows else None
        try:
            self.groups.control.send([hidden.to(host).contiguous()], 1, HIDDEN_TAG).wait()
            if logits is not None:
                self.groups.control.recv([logits], len(self.stages) - 1, LOGITS_TAG).wait()
        except RuntimeError as error:  # a stage's socket closed under the transfer
            raise TensorParallelError(self.failure or f"pipeline stages failed: {error}") from None
        return logits.to(self.device) if logits is not None else None

    def stage_busy_seconds(self) -> list[float]:
        """Seconds each stage has spent computing its layers since start (stage 0 first)."""
        self._broadcast(BusyQuery())
        busy = [self._busy_s]
        for stage in self.stages[1:]:
            reply = torch.zeros(1, dtype=torch.float64)
            self.groups.control.recv([reply], stage.index, BUSY_TAG).wait()
            busy.append(float(reply.item()))
        return busy
