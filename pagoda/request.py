"""Request: the engine's unit of work.

A request is a list of token ids plus `num_computed_tokens`; each step computes some of the
tokens it is behind on. A prompt is just a request that is far behind (see docs/DESIGN.md).
"""

from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

import torch

from pagoda.lora_request import AdapterIdentity
from pagoda.media_item import MediaItem
from pagoda.outputs import PositionLogprobs, RequestMetrics
from pagoda.sampling_params import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def is_finished(self) -> bool:
        return self in (RequestStatus.FINISHED_STOPPED, RequestStatus.FINISHED_LENGTH, RequestStatus.FINISHED_ABORTED)

    @property
    def finish_reason(self) -> str | None:
        return self.value if self.is_finished else None


@dataclass
class SpecState:
    """A request's speculative-decoding state. The spec-decode controller (and its proposers)
    decide the drafts; the scheduler only drops what a step or a preemption made stale."""

    num_wanted: int = 0  # drafts wanted this step (set before scheduling)
    token_ids: list[int] = field(default_factory=list)  # drafts proposed this step, verified by the target
    # How far the draft model's KV (same blocks as the target's, its own tensors) is computed.
    num_draft_computed_tokens: int = 0

    def clear_drafts(self) -> None:
        self.num_wanted = 0
        self.token_ids = []

    def after_step(self, num_computed_tokens: int) -> None:
        """The step verified (or never ran) this step's drafts; the draft model's KV of
        rejected drafts is no longer valid."""
        self.clear_drafts()
        self.num_draft_computed_tokens = min(self.num_draft_computed_tokens, num_computed_tokens)

    def reset(self) -> None:
        """Preempted: every block is freed, the draft model's KV with it."""
        self.clear_drafts()
        self.num_draft_computed_tokens = 0


@dataclass(eq=False)
class Request:
    """One sequence being generated. For `n > 1` each sample is its own Request (see `fork`)."""

    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    eos_token_ids: frozenset[int]
    max_output_tokens: int  # max_tokens resolved against the context length
    arrival_time: float = field(default_factory=time.time)
    cache_salt: str | None = None
    priority: int = 0
    # The user-visible request this sample belongs to, and its index among the n samples.
    parent_id: str = ""
    sample_index: int = 0
    lora: AdapterIdentity | None = None  # the LoRA adapter it runs with (None: the base model)
    # Its KV is computed with LongRoPE's long factors (pagoda.model.rope): it is longer than the
    # model's boundary. Set at creation; the scheduler switches it when decoding crosses.
    long_rope: bool = False
    # Its images: placeholder ranges in the prompt, encoded before the prefill reaches them.
    media: tuple[MediaItem, ...] = ()

    status: RequestStatus = RequestStatus.WAITING
    output_token_ids: list[int] = field(default_factory=list)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    # One block table per KV cache group (pagoda.core.kv_cache_groups); block 0 stands in for
    # blocks released behind a sliding window.
    block_tables: list[list[int]] = field(default_factory=list)
    # A hybrid model's slot of the state cache (pagoda.core.state_slots), None while it holds none.
    state_slot: int | None = None
    # Chained hashes of this request's full blocks, computed incrementally (prefix caching).
    block_hashes: list[bytes] = field(default_factory=list)
    num_cached_tokens: int = -1  # prefix-cache hit at first scheduling; -1 until then
    stop_reason: int | str | None = None
    # Samples still to be forked from this one once the prompt (all but its last token) is
    # computed, so that they share the prompt's KV blocks (copy-on-write).
    pending_forks: list[Request] = field(default_factory=list)

    spec: SpecState = field(default_factory=SpecState)

    output_logprobs: list[PositionLogprobs] = field(default_factory=list)
    cumulative_logprob: float = 0.0
    prompt_logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    # Pooling requests (pagoda/worker/pooling.py): the running sum of the prompt's hidden
    # states (a tensor, "mean" pooling), then the embedding once the prompt is computed.
    pooled_sum: Any = None
    embedding: list[float] | None = None
    generator: torch.Generator | None = None
    # Grammar state of a structured-output request (set once its grammar is compiled): a
    # pagoda.structured.matcher.RequestMatcher, typed Any because that layer sits above this one.
    structured_output: Any = None
    metrics: RequestMetrics = field(init=False)

    def __post_init__(self) -> None:
        self.parent_id = self.parent_id or self.request_id
        self.all_token_ids = list(self.prompt_token_ids)
        self.metrics = RequestMetrics(arrival_time=self.arrival_time)
        if self.sampling_params.seed is not None and self.generator is None:
            self.generator = torch.Generator().manual_seed(_sample_seed(self.sampling_params.seed, self.sample_index))

    @property
    def block_ids(self) -> list[int]:
        """The first KV cache group's block table (every layer's when blocks are not released)."""
        return self.block_tables[0] if self.block_tables else []

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.output_token_ids)

    @property
    def is_finished(self) -> bool:
        return self.status.is_finished

    @property
    def num_sequences(self) -> int:
        """Sequences this request holds against --max-num-seqs: itself and its samples to fork."""
        return 1 + len(self.pending_forks)

    @property
    def prefill_limit(self) -> int:
        """How far this request may compute before its pending samples fork off it."""
        if self.pending_forks:
            return max(self.num_prompt_tokens - 1, 0)
        return self.num_tokens

    def append_output_token(self, token_id: int) -> None:
        self.output_token_ids.append(token_id)
        self.all_token_ids.append(token_id)

    def new_sample(self, sample_index: int) -> Request:
        """Another sample of the same prompt; it shares this one's KV blocks once forked."""
        child = Request(
            request_id=f"{self.parent_id}#{sample_index}",
            prompt_token_ids=self.prompt_token_ids,
            sampling_params=self.sampling_params,
            eos_token_ids=self.eos_token_ids,
            max_output_tokens=self.max_output_tokens,
            arrival_time=self.arrival_time,
            cache_salt=self.cache_salt,
            priority=self.priority,
            parent_id=self.parent_id,
            sample_index=sample_index,
            lora=self.lora,
            long_rope=self.long_rope,
            media=self.media,
        )
        return child


def _sample_seed(seed: int, sample_index: int) -> int:
    # Distinct, reproducible streams for the n samples of one seeded request.
    return (seed * 1_000_003 + sample_index) & 0x7FFF_FFFF_FFFF_FFFF
