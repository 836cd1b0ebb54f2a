"""Runs one scheduled step on the model: flatten the batch, forward, sample or verify.

Holds the KV cache tensors (one key and one value tensor per layer, shaped
[num_blocks, block_size, num_kv_heads, head_dim]) and the model. With speculative decoding a
request's step carries its drafted tokens after its real ones; the target scores them all in
the same forward and the rejection sampler decides how many to keep.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from typing import Protocol

import torch

from pagoda.core.encoder_cache import EncoderCache
from pagoda.core.kv_cache_groups import KVCacheGroup
from pagoda.core.scheduler import SchedulerOutput
from pagoda.kernels.attention import AttentionBackend, BatchLayout
from pagoda.kv_transfer.block_transfer import BlockTransfer
from pagoda.lora.manager import LoRAManager
from pagoda.model.decoder import DecoderModel
from pagoda.model.mrope import batch_positions
from pagoda.outputs import PositionLogprobs
from pagoda.quant.kv_cache_dtype import KVCacheFormat
from pagoda.request import Request
from pagoda.structured.manager import GrammarMasks
from pagoda.worker.cuda_graphs import DecodeGraphRunner, supports_cuda_graphs
from pagoda.worker.encoder_step import image_embeds
from pagoda.worker.paged_model import PagedModel
from pagoda.worker.pooling import pool_prompts
from pagoda.worker.sampler import Sampler, position_logprobs
from pagoda.worker.state_cache import StateCache


@dataclass
class StepTimings:
    """Seconds spent in each phase of one step. The runner measures its phases (prepare,
    propose, forward, logits, sample); the engine core, which owns the step record, adds
    `schedule` and `update` (the scheduler before and after the forward)."""

    prepare: float = 0.0
    propose: float = 0.0  # the draft model's forwards (speculative decoding)
    forward: float = 0.0  # the decoder stack, up to the final norm
    logits: float = 0.0  # the LM head over the rows whose logits are used (pipeline: waiting for the last stage's)
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
    logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)  # one per emitted token
    num_accepted: dict[str, int] = field(default_factory=dict)  # drafts accepted, per speculating request
    # Prompt logprobs computed this step: request id -> entries for consecutive prompt positions.
    prompt_logprobs: dict[str, list[PositionLogprobs]] = field(default_factory=dict)
    pooled: dict[str, list[float]] = field(default_factory=dict)  # embeddings of pooling requests
    timings: StepTimings = field(default_factory=StepTimings)  # the runner's phases of this step


@dataclass
class SubmittedStep:
    """A step whose forward ran (or, with pipeline stages, is running in the later stages),
    waiting to be collected: what sampling it needs."""

    scheduler_output: SchedulerOutput
    hidden: torch.Tensor  # this stage's output
    query_start_loc: torch.Tensor
    logit_rows: list[int]
    row_owners: list[tuple]
    grammar_masks: GrammarMasks
    draft_probs: dict[str, torch.Tensor | None]
    timings: StepTimings  # prepare, propose and forward so far


class StepBroadcaster(Protocol):
    """Tensor parallelism (pagoda.executor): hands rank 0's forward to the other ranks."""

    def broadcast_step(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        layouts: list[BatchLayout],
        logit_rows: list[int],
        block_copies: list[tuple[int, int]],
    ) -> None: ...


class LaterStages(StepBroadcaster, Protocol):
    """Pipeline parallelism (pagoda.executor.pipeline): after the first stage's layers, the
    other stages run theirs; the last one's logits come back to be sampled here. Several steps
    may be in the stages at once: their logits come back in the order they were handed on."""

    def hand_on(self, hidden: torch.Tensor, logit_rows: list[int]) -> None:
        """Send the first stage's hidden states on, without waiting for the other stages."""

    def collect_logits(self) -> torch.Tensor | None:
        """The logits rows of the oldest step handed on (None: it had none)."""


class Verified(Protocol):
    token_ids: list[int]  # accepted drafts, then one token from the target
    num_accepted: int


class Speculator(Protocol):
    """What the runner needs from speculative decoding (spec_decode.SpecDecodeController)."""

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """A draft model's own KV tensors, copied with the target's on copy-on-write."""

    def propose(self, scheduler_output: SchedulerOutput, sampler: Sampler) -> dict[str, torch.Tensor | None]:
        """Fill the drafts of the speculating requests; their draft distributions (None: point masses)."""

    def verify(
        self,
        sampler: Sampler,
        logits: torch.Tensor,
        request: Request,
        drafts: list[int],
        draft_probs: torch.Tensor | None,
    ) -> Verified:
        """Accept a prefix of the drafts from the target's logits [K + 1, V]."""


@dataclass
class Segment:
    """Tokens of one request computed in one forward, starting at position `start`."""

    request: Request
    start: int
    token_ids: list[int]


def build_batch(
    segments: Sequence[Segment],
    block_size: int,
    device: torch.device,
    num_groups: int = 1,
    long_rope_boundary: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, list[BatchLayout]]:
    """Flatten segments into input ids, positions and the attention layout of each KV cache
    group (they differ only in block tables and slots). With LongRoPE, the positions of requests
    on the long factors are shifted by the boundary, to their rows of the rotary tables."""
    input_ids: list[int] = []
    positions: list[int] = []
    query_start_loc = [0]
    context_lens: list[int] = []
    query_lens: list[int] = []
    for segment in segments:
        input_ids.extend(segment.token_ids)
        row = segment.start + (long_rope_boundary if segment.request.long_rope and long_rope_boundary else 0)
        positions.extend(range(row, row + len(segment.token_ids)))
        query_start_loc.append(query_start_loc[-1] + len(segment.token_ids))
        context_lens.append(segment.start)
        query_lens.append(len(segment.token_ids))
    # Shared by every KV cache group's layout.
    query_start_loc_t = torch.tensor(query_start_loc, dtype=torch.long, device=device)
    context_lens_t = torch.tensor(context_lens, dtype=torch.long, device=device)
    seq_lens_t = torch.tensor([c + q for c, q in zip(context_lens, query_lens)], dtype=torch.long, device=device)
    layouts = []
    for group in range(num_groups):
        slots: list[int] = []
        block_tables = [segment.request.block_tables[group] for segment in segments]
        for segment, block_ids in zip(segments, block_tables):
            span = range(segment.start, segment.start + len(segment.token_ids))
            slots.extend(block_ids[p // block_size] * block_size + p % block_size for p in span)
        max_blocks = max(len(t) for t in block_tables)
        layouts.append(
            BatchLayout(
                slot_mapping=torch.tensor(slots, dtype=torch.long, device=device),
                block_tables=torch.tensor(
                    [t + [0] * (max_blocks - len(t)) for t in block_tables], dtype=torch.int32, device=device
                ),
                query_start_loc=query_start_loc_t,
                context_lens=context_lens_t,
                seq_lens=seq_lens_t,
                block_size=block_size,
                query_lens_host=query_lens,
                context_lens_host=context_lens,
            )
        )
    return (
        torch.tensor(input_ids, dtype=torch.long, device=device),
        torch.tensor(positions, dtype=torch.long, device=device),
        layouts,
    )


class ModelRunner(PagedModel):
    def __init__(
        self,
        model: DecoderModel,
        backend: AttentionBackend,
        num_blocks: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        seed: int,
        *,
        max_num_seqs: int,
        max_model_len: int,
        enforce_eager: bool = False,
        speculator: Speculator | None = None,
        kv_format: KVCacheFormat | None = None,
        lora: LoRAManager | None = None,
        groups: Sequence[KVCacheGroup] | None = None,
        num_state_slots: int = 0,
    ) -> None:
        super().__init__(model, backend, num_blocks, block_size, dtype, device, kv_format, groups)
        # A hybrid model's linear-attention state, a slot per running sequence (pagoda.core.state_slots).
        self.state_cache = (
            StateCache(model, num_state_slots, dtype, device) if model.config.linear_attention is not None else None
        )
        self.lora = lora  # LoRA adapters (pagoda.lora): the step's token -> slot mapping is set here
        self.sampler = Sampler(model.config.vocab_size, device, seed)
        self.speculator = speculator
        self.kv_transfer: BlockTransfer | None = None  # the KV tiers' copies (pagoda.kv_transfer), if any
        # A vision-language model's encoder outputs (the scheduler's, which plans what to encode).
        self.encoder_cache: EncoderCache | None = None
        # Tensor parallelism: rank 0's executor (pagoda.executor), which hands each forward to
        # the other ranks just before this one runs it.
        self.tensor_parallel: StepBroadcaster | None = None
        # Pipeline parallelism: this runner is the first stage; the executor runs the others.
        self.pipeline: LaterStages | None = None
        # Structured output: grammar bitmasks are filled here while the forward runs.
        self.mask_filler = ThreadPoolExecutor(max_workers=1, thread_name_prefix="grammar-mask")
        # Decode-only steps replay captured CUDA graphs (the caches are never reallocated after this).
        self.decode_graphs = None
        # Graphs replay one block table per request: a model with several KV cache groups runs eagerly.
        # A hybrid model's step reads and writes state slots the graphs do not capture: it runs eagerly.
        # (M-RoPE models' 3-D positions are not what the graphs were captured with.)
        if (
            device.type == "cuda"
            and not enforce_eager
            and supports_cuda_graphs(backend)
            and len(self.kv_groups) == 1
            and self.state_cache is None
            and model.config.mrope_section is None
        ):
            self.decode_graphs = DecodeGraphRunner(
                model, backend, self.kv_caches, self.sliding_windows, max_num_seqs, max_model_len, block_size, device
            )
            self.decode_graphs.capture()

    @torch.inference_mode()
    def submit(self, scheduler_output: SchedulerOutput) -> SubmittedStep:
        """Run the step's forward (with pipeline stages: this stage's layers, then hand the
        hidden states on without waiting for the others); `collect` samples it."""
        start = time.perf_counter()
        if scheduler_output.kv_transfers:  # tier copies go first: CoW targets may be evicted blocks
            assert self.kv_transfer is not None, "the scheduler plans tier copies only with KV tiers"
            self.kv_transfer.run(scheduler_output.kv_transfers)
        self._copy_blocks(scheduler_output.block_copies)
        if self.state_cache is not None:
            self.state_cache.copy(scheduler_output.state_copies)
        draft_probs: dict[str, torch.Tensor | None] = {}
        if self.speculator is not None:
            draft_probs = self.speculator.propose(scheduler_output, self.sampler)
        proposed = time.perf_counter()

        segments = []
        for entry in scheduler_output.scheduled:
            request = entry.request
            num_real = entry.num_new_tokens - entry.num_spec_tokens
            begin = entry.num_computed_before
            tokens = request.all_token_ids[begin : begin + num_real] + request.spec.token_ids[: entry.num_spec_tokens]
            segments.append(Segment(request, begin, tokens))
        input_ids, positions, layouts = build_batch(
            segments, self.block_size, self.device, len(self.kv_groups), self.model.config.long_rope_boundary
        )
        vision = self.model.config.vision
        if vision is not None and vision.bidirectional:  # each chunk's image ranges, seen both ways
            spans = [
                [
                    (item.offset, item.end)
                    for item in s.request.media
                    if item.overlaps(s.start, s.start + len(s.token_ids))
                ]
                for s in segments
            ]
            for layout in layouts:
                layout.bidirectional = spans
        if self.model.config.mrope_section is not None and vision is not None:  # three positions per token
            chunks = [(s.start, s.start + len(s.token_ids), s.request.media) for s in segments]
            positions = batch_positions(chunks, int(vision.options["spatial_merge_size"])).to(self.device)
        logit_rows, row_owners = self._logit_rows(scheduler_output, layouts[0])
        grammar_masks = GrammarMasks(_grammar_groups(row_owners), self.model.config.vocab_size, self.mask_filler)
        if self.lora is not None:  # every step sets (or clears) the token -> adapter slot mapping
            self.lora.begin_step([(segment.request.lora, len(segment.token_ids)) for segment in segments])
        workers = self.tensor_parallel or self.pipeline
        if workers is not None:
            workers.broadcast_step(input_ids, positions, layouts, logit_rows, scheduler_output.block_copies)
        embeds = None
        if self.encoder_cache is not None:
            embeds = image_embeds(self.model, self.encoder_cache, scheduler_output.encoder_work, segments, self.device)
        # Graphs were captured without adapters or image rows: such a step runs eagerly.
        graphs = self.decode_graphs if (self.lora is None or self.lora.state.batch is None) and embeds is None else None
        if graphs is not None and graphs.fits(layouts[0]):
            prepared = time.perf_counter()
            hidden = graphs.run(input_ids, positions, layouts[0])  # the graph's buffer: used before next step
        else:
            context = self.forward_context(layouts)
            if self.state_cache is not None:
                context.linear_states = self.state_cache.batch(segments, scheduler_output.state_snapshots)
            prepared = time.perf_counter()
            hidden = self.model(input_ids, positions, context, embeds=embeds)
        if self.encoder_cache is not None:
            self.encoder_cache.end_step()
        if self.lora is not None:
            self.lora.end_step()
        if self.pipeline is not None:
            self.pipeline.hand_on(hidden, logit_rows)
        forwarded = time.perf_counter()
        return SubmittedStep(
            scheduler_output,
            hidden,
            layouts[0].query_start_loc,
            logit_rows,
            row_owners,
            grammar_masks,
            draft_probs,
            StepTimings(prepare=prepared - proposed, propose=proposed - start, forward=forwarded - prepared),
        )

    @torch.inference_mode()
    def collect(self, step: SubmittedStep) -> ModelRunnerOutput:
        """The logits of a submitted step (with pipeline stages: the last stage's, in the order
        steps were submitted), sampled, verified and pooled."""
        started = time.perf_counter()
        if self.pipeline is not None:
            logits = self.pipeline.collect_logits()
        else:
            logits = self.model.compute_logits(step.hidden[step.logit_rows]) if step.logit_rows else None
        projected = time.perf_counter()

        output = ModelRunnerOutput()
        if any(entry.request.sampling_params.pooling for entry in step.scheduler_output.scheduled):
            output.pooled = pool_prompts(
                step.scheduler_output.scheduled, step.hidden, step.query_start_loc.tolist(), self.model.score
            )
        if logits is not None:
            step.grammar_masks.apply(logits)  # filled while the forward ran
            self._sample(logits, step.row_owners, step.draft_probs, output)
        done = time.perf_counter()
        output.timings = replace(step.timings, logits=projected - started, sample=done - projected)
        return output

    def _logit_rows(self, scheduler_output: SchedulerOutput, layout: BatchLayout) -> tuple[list[int], list[tuple]]:
        """Rows of the batch whose logits are needed, and what each group of rows is for:
        ("sample", request, n) for one sampled token, ("verify", request, k + 1) for drafts,
        ("prompt", request, targets) for prompt logprobs."""
        rows: list[int] = []
        owners: list[tuple] = []
        starts = layout.query_start_loc.tolist()
        for index, entry in enumerate(scheduler_output.scheduled):
            request = entry.request
            row0 = starts[index]
            num_real = entry.num_new_tokens - entry.num_spec_tokens
            if entry.samples:
                first = row0 + num_real - 1
                count = entry.num_spec_tokens + 1
                rows.extend(range(first, first + count))
                owners.append(("verify" if entry.num_spec_tokens else "sample", request, count))
            if request.sampling_params.prompt_logprobs is not None:
                # Logits at position p score prompt token p + 1.
                begin = entry.num_computed_before
                last = min(begin + num_real, request.num_prompt_tokens - 1)
                if last > begin:
                    rows.extend(range(row0, row0 + last - begin))
                    owners.append(("prompt", request, request.prompt_token_ids[begin + 1 : last + 1]))
        return rows, owners

    def _sample(
        self,
        logits: torch.Tensor,
        owners: list[tuple],
        draft_probs: dict[str, torch.Tensor | None],
        output: ModelRunnerOutput,
    ) -> None:
        offsets = []
        offset = 0
        for kind, _request, extent in owners:
            count = len(extent) if kind == "prompt" else extent
            offsets.append(offset)
            offset += count

        plain = [(i, owner[1]) for i, owner in enumerate(owners) if owner[0] == "sample"]
        if plain:
            requests = [request for _, request in plain]
            if len(plain) == logits.shape[0]:  # every row samples one token: no gather
                sampled = self.sampler(logits, requests)
            else:
                sampled = self.sampler(
                    logits[torch.tensor([offsets[i] for i, _ in plain], device=logits.device)], requests
                )
            for request, token_id, logprobs in zip(requests, sampled.token_ids, sampled.logprobs):
                output.sampled_token_ids[request.request_id] = [token_id]
                if logprobs is not None:
                    output.logprobs[request.request_id] = [logprobs]

        for index, (kind, request, extent) in enumerate(owners):
            rows = logits[offsets[index] : offsets[index] + (len(extent) if kind == "prompt" else extent)]
            if kind == "verify":
                drafts = request.spec.token_ids[: extent - 1]
                assert self.speculator is not None  # verify rows exist only for drafted requests
                result = self.speculator.verify(
                    self.sampler, rows, request, drafts, draft_probs.get(request.request_id)
                )
                output.sampled_token_ids[request.request_id] = result.token_ids
                output.num_accepted[request.request_id] = result.num_accepted
                k = request.sampling_params.logprobs
                if k is not None:
                    emitted = result.token_ids
                    output.logprobs[request.request_id] = position_logprobs(
                        rows[: len(emitted)], emitted, [k] * len(emitted)
                    )
            elif kind == "prompt":
                k = request.sampling_params.prompt_logprobs or 0
                output.prompt_logprobs[request.request_id] = position_logprobs(rows, extent, [k] * len(extent))

    def _copy_blocks(self, copies: list[tuple[int, int]]) -> None:
        if not copies:
            return
        src = torch.tensor([c[0] for c in copies], device=self.device)
        dst = torch.tensor([c[1] for c in copies], device=self.device)
        caches = self.distinct_kv_caches + (self.speculator.kv_caches if self.speculator is not None else [])
        for key_cache, value_cache in caches:
            key_cache[dst] = key_cache[src]
            value_cache[dst] = value_cache[src]


def _grammar_groups(owners: list[tuple]) -> list[tuple[int, Request, list[int]]]:
    """(first logits row, request, drafts) for each request about to sample, in logits order."""
    groups, offset = [], 0
    for kind, request, extent in owners:
        if kind != "prompt":
            groups.append((offset, request, request.spec.token_ids[: extent - 1] if kind == "verify" else []))
        offset += len(extent) if kind == "prompt" else extent
    return groups
