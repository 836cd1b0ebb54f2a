"""Runs one scheduled step on the model: flatten the batch, forward, sample.

Holds the KV cache tensors (one key and one value tensor per layer, shaped
[num_blocks, block_size, num_kv_heads, head_dim]) and the model.
"""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import torch

from pagoda.core.scheduler import SchedulerOutput
from pagoda.model.attention import AttentionBackend, BatchLayout
from pagoda.model.llama import ForwardContext, LlamaFamilyModel
from pagoda.outputs import PositionLogprobs
from pagoda.request import Request
from pagoda.worker.sampler import Sampler, position_logprobs


@dataclass
class StepTimings:
    """Seconds spent in each phase of the last step. `schedule` and `update` (the scheduler
    before and after the forward) are filled in by the engine core."""

    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    schedule: float = 0.0
    update: float = 0.0

    @property
    def host(self) -> float:
        """Python-side work around the model: scheduling, input preparation, bookkeeping."""
        return self.schedule + self.prepare + self.update


@dataclass
class ModelRunnerOutput:
    sampled_token_ids: dict[str, list[int]] = field(default_factory=dict)
    logprobs: dict[str, PositionLogprobs] = field(default_factory=dict)
    # Prompt logprobs computed this step: request id -> entries for consecutive prompt positions.
    prompt_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)


def kv_bytes_per_block(model: LlamaFamilyModel, block_size: int, dtype: torch.dtype) -> int:
    config = model.config
    element = torch.tensor([], dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.num_kv_heads * config.head_dim * element


class ModelRunner:
    def __init__(self, model: LlamaFamilyModel, backend: AttentionBackend, num_blocks: int, block_size: int,
                 dtype: torch.dtype, device: torch.device, seed: int) -> None:
        self.model = model
        self.backend = backend
        self.block_size = block_size
        self.device = device
        config = model.config
        shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
        self.kv_caches = [(torch.zeros(shape, dtype=dtype, device=device),
                           torch.zeros(shape, dtype=dtype, device=device)) for _ in range(config.num_layers)]
        self.sliding_windows = set(config.layer_sliding_windows)
        self.sampler = Sampler(config.vocab_size, device, seed)
        self.timings = StepTimings()

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> ModelRunnerOutput:
        start = time.perf_counter()
        self._copy_blocks(scheduler_output.block_copies)
        batch = self._prepare(scheduler_output)
        metadata = self.backend.prepare(batch.layout, self.sliding_windows)
        context = ForwardContext(self.backend, metadata, self.kv_caches)
        prepared = time.perf_counter()

        hidden = self.model(batch.input_ids, batch.positions, context)
        logits = self.model.compute_logits(hidden[batch.logits_rows]) if batch.logits_rows.numel() else None
        forwarded = time.perf_counter()

        output = ModelRunnerOutput()
        if logits is not None:
            num_sampling = len(batch.sampling_requests)
            if num_sampling:
                sampled = self.sampler(logits[:num_sampling], batch.sampling_requests)
                for request, token_id, logprobs in zip(batch.sampling_requests, sampled.token_ids, sampled.logprobs):
                    output.sampled_token_ids[request.request_id] = [token_id]
                    if logprobs is not None:
                        output.logprobs[request.request_id] = logprobs
            offset = num_sampling
            for request, targets in batch.prompt_logprob_targets:
                rows = logits[offset:offset + len(targets)]
                k = request.sampling_params.prompt_logprobs or 0
                output.prompt_logprobs[request.request_id] = position_logprobs(rows, targets, [k] * len(targets))
                offset += len(targets)
        done = time.perf_counter()
        self.timings = StepTimings(prepared - start, forwarded - prepared, done - forwarded)
        return output

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        for key_cache, value_cache in self.kv_caches:
            key_cache[dst] = key_cache[src]
            value_cache[dst] = value_cache[src]

    def _prepare(self, scheduler_output: SchedulerOutput) -> "_PreparedBatch":
        block_size = self.block_size
        input_ids: list[int] = []
        positions: list[int] = []
        slots: list[int] = []
        query_start_loc = [0]
        context_lens: list[int] = []
        query_lens: list[int] = []
        block_tables: list[list[int]] = []
        sampling_rows: list[int] = []
        sampling_requests: list[Request] = []
        prompt_rows: list[int] = []
        prompt_logprob_targets: list[tuple[Request, list[int]]] = []

        for entry in scheduler_output.scheduled:
            request = entry.request
            begin = entry.num_computed_before
            end = begin + entry.num_new_tokens
            block_ids = request.block_ids
            row0 = query_start_loc[-1]
            input_ids.extend(request.all_token_ids[begin:end])
            span = range(begin, end)
            positions.extend(span)
            slots.extend(block_ids[p // block_size] * block_size + p % block_size for p in span)
            query_start_loc.append(row0 + entry.num_new_tokens)
            context_lens.append(begin)
            query_lens.append(entry.num_new_tokens)
            block_tables.append(block_ids)
            if entry.samples:
                sampling_rows.append(row0 + entry.num_new_tokens - 1)
                sampling_requests.append(request)
            if request.sampling_params.prompt_logprobs is not None:
                # Logits at position p score prompt token p + 1.
                last = min(end, request.num_prompt_tokens - 1)
                if last > begin:
                    prompt_rows.extend(range(row0, row0 + last - begin))
                    prompt_logprob_targets.append((request, request.prompt_token_ids[begin + 1:last + 1]))

        device = self.device
        max_blocks = max(len(t) for t in block_tables)
        padded_tables = [t + [0] * (max_blocks - len(t)) for t in block_tables]
        seq_lens = [c + q for c, q in zip(context_lens, query_lens)]
        layout = BatchLayout(
            slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
            query_start_loc=torch.tensor(query_start_loc, dtype=torch.long, device=device),
            context_lens=torch.tensor(context_lens, dtype=torch.long, device=device),
            seq_lens=torch.tensor(seq_lens, dtype=torch.long, device=device),
            block_tables=torch.tensor(padded_tables, dtype=torch.int32, device=device),
            block_size=block_size,
            query_lens_host=query_lens,
            context_lens_host=context_lens,
        )
        return _PreparedBatch(
            input_ids=torch.tensor(input_ids, dtype=torch.long, device=device),
            positions=torch.tensor(positions, dtype=torch.long, device=device),
            layout=layout,
            logits_rows=torch.tensor(sampling_rows + prompt_rows, dtype=torch.long, device=device),
            sampling_requests=sampling_requests,
            prompt_logprob_targets=prompt_logprob_targets,
        )


@dataclass
class _PreparedBatch:
    input_ids: torch.Tensor
    positions: torch.Tensor
    layout: BatchLayout
    logits_rows: torch.Tensor  # sampling rows first, then prompt-logprob rows
    sampling_requests: list[Request]
    prompt_logprob_targets: list[tuple[Request, list[int]]]
