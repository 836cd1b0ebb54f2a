"""Stage 0's side of pipeline parallelism: the other stages as workers, the steps and hidden
states handed down the chain of stages, the logits coming back.

The engine core's process is stage 0 (the embedding and the first layers), like tensor
parallelism's rank 0. With tensor parallelism inside the stages (P x T ranks, rank = stage x T +
rank in the stage), each stage's rank 0 leads it: the chain runs between the leads, a lead
shares what it receives with its stage's ranks, and they run the layers as one tensor-parallel
group (stage 0's other ranks get the step from the engine core). For each step its model runner sends the flattened
batch to stage 1 just
before its own forward (every stage needs the positions and the attention layout), runs its
layers and sends its hidden states after it (`hand_on`). Each stage receives both from the
stage before, passes the batch on, runs its layers and sends its hidden states on; the last
stage applies the final norm and the LM head to the rows the runner samples and sends those
logits back to stage 0 (`collect_logits`), whose sampler, grammars and logprobs are the same as
without stages. The KV pool's block ids are the scheduler's: every stage allocates the same
blocks for its own layers only.

Nothing waits on the way down: stage 0's sends complete in the background, so it goes on to
the next micro-batch while the later stages work on the previous ones (the scheduler keeps up
to P steps of disjoint requests in flight), and every stage takes the steps in the order stage
0 submitted them, so the logits come back in that order. `stage_busy_seconds` measures each
stage's compute time, from which the benchmark derives the bubble fraction. The process
lifecycle (start, watch, a dead stage ending the engine, stop) is tensor parallelism's
(pagoda.executor.tensor_parallel).
"""

from __future__ import annotations

import time
from collections import deque

import torch

from pagoda.config import EngineConfig
from pagoda.executor.group import Outbox, forward_payload, seal_payload, share_payload
from pagoda.executor.tensor_parallel import TensorParallelError, TensorParallelExecutor
from pagoda.executor.worker import BUSY_TAG, HIDDEN_TAG, LOGITS_TAG, STEP_TAG, StageMessage, StepInputs, layout_to
from pagoda.kernels.attention import BatchLayout
from pagoda.model.pipeline import PipelineStage


class PipelineExecutor(TensorParallelExecutor):
    def __init__(
        self,
        config: EngineConfig,
        device: torch.device,
        dtype: torch.dtype,
        num_threads: int,
        stages: list[PipelineStage],
        vocab_size: int,
    ) -> None:
        """Start stages 1..P-1 (returns once all have joined); this process is stages[0]."""
        super().__init__(config, device, dtype, num_threads, stages)
        self.stages = stages
        self.vocab_size = vocab_size
        self.stage_ranks = config.tensor_parallel_size  # each stage's tensor-parallel ranks; a lead is rank 0 of them
        self._outbox = Outbox()  # sends to stage 1 still completing
        self._logit_rows: deque[int] = deque()  # per step handed on and not collected: its logits rows
        self._busy_s = 0.0  # stage 0's compute seconds
        self.logits_wait_s = 0.0  # seconds stage 0 has waited for the last stage's logits
        self._forward_started = 0.0

    @property
    def stage(self) -> PipelineStage:
        """This process's stage (the first)."""
        return self.stages[0]

    @property
    def num_in_flight(self) -> int:
        """Steps handed on whose logits have not been collected."""
        return len(self._logit_rows)

    def broadcast_step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        layouts: list[BatchLayout],
        logit_rows: list[int],
        block_copies: list[tuple[int, int]],
    ) -> None:
        """Send the step down the chain (called by the runner just before its own forward)."""
        host = torch.device("cpu")
        if self.device.type != "cpu":  # the step travels from the host
            input_ids, positions = input_ids.to(host), positions.to(host)
            layouts = [layout_to(layout, host) for layout in layouts]
        self._send_down(StageMessage(StepInputs(input_ids, positions, layouts, logit_rows, list(block_copies))))
        self._forward_started = time.perf_counter()

    def hand_on(self, hidden: torch.Tensor, logit_rows: list[int]) -> None:
        """Send stage 0's hidden states to stage 1; the logits come with `collect_logits`."""
        self._busy_s += time.perf_counter() - self._forward_started
        self._guard(
            lambda: self._outbox.send(
                self.groups.control, hidden.to(torch.device("cpu")).contiguous(), self.stage_ranks, HIDDEN_TAG
            )
        )
        self._logit_rows.append(len(logit_rows))

    def collect_logits(self) -> torch.Tensor | None:
        """The last stage's logits of the oldest step handed on (None when it has no rows)."""
        num_rows = self._logit_rows.popleft()
        if not num_rows:
            return None
        logits = torch.empty(num_rows, self.vocab_size, dtype=torch.float32)
        last_lead = self.stages[-1].index * self.stage_ranks
        started = time.perf_counter()
        self._guard(lambda: self.groups.control.recv([logits], last_lead, LOGITS_TAG).wait())
        self.logits_wait_s += time.perf_counter() - started
        return logits.to(self.device)

    def stage_busy_seconds(self) -> list[float]:
        """Seconds each stage has spent computing its layers since start (stage 0 first).
        Only between steps: a stage answers after the steps it was handed before."""
        if self._logit_rows:
            raise RuntimeError("stage_busy_seconds: steps are still in the pipeline")
        self._send_down(StageMessage(busy_query=True))
        busy = [self._busy_s]
        for stage in self.stages[1:]:
            reply = torch.zeros(1, dtype=torch.float64)
            lead = stage.index * self.stage_ranks
            self._guard(lambda reply=reply, lead=lead: self.groups.control.recv([reply], lead, BUSY_TAG).wait())
            busy.append(float(reply.item()))
        return busy

    def _send_stop(self) -> None:
        """Collect the steps still in the stages (the last one's sends wait for stage 0), then
        send the stop down the chain."""
        while self._logit_rows:
            self.collect_logits()
        self._send_down(StageMessage())
        self._outbox.wait()

    def _send_down(self, message: StageMessage) -> None:
        """To this stage's other tensor-parallel ranks, and to the next stage's lead."""
        payload = seal_payload(self.codec, message)
        if self.groups.stage is not None:
            self._guard(lambda: share_payload(self.groups.stage, self.codec, payload, 0))
        self._guard(lambda: forward_payload(self._outbox, self.groups.control, payload, self.stage_ranks, STEP_TAG))

    def _guard(self, transfer) -> None:
        if self.failure is not None:
            raise TensorParallelError(self.failure)
        try:
            transfer()
        except RuntimeError as error:  # a stage's socket closed under the transfer
            raise TensorParallelError(self.failure or f"pipeline stages failed: {error}") from None
