"""Prefill/decode disaggregation inside one engine: exporting a prefilled request with its KV
blocks (role prefill) and importing one into freshly allocated blocks (role decode).

The wire lives in pagoda.kv_transfer.handoff and when each step happens in the engine's
KVConnector (kv_connector.py); this module decides what travels and what the receiving
engine may trust. A decode engine uses transferred blocks only when the sender's
chained block hashes equal the ones it computes itself from the request's tokens, tenant salt
and adapter, and the model fingerprint and block layout match: the blocks then enter its prefix
cache under its own (identical) hashes, never under another tenant's. Anything else is
refused and the request is prefilled locally.
"""

from __future__ import annotations

import base64
import bisect
import dataclasses
import time
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.engine.validation import check_exportable
from pagoda.kv_transfer.block_transfer import gather_blocks, scatter_blocks
from pagoda.kv_transfer.handoff import (
    HandoffHeader,
    HandoffRefused,
    IncomingHandoff,
    KVHandoff,
    TransferError,
    layout_of,
)
from pagoda.outputs import Logprob
from pagoda.request import Request
from pagoda.sampling_params import SamplingParams

PHASES = ("queue", "prefill", "transfer", "first_decode")
# Seconds; the server's TTFT histogram uses the same bounds (a phase is a part of the TTFT).
PHASE_BUCKETS: tuple[float, ...] = (
    0.001,
    0.005,
    0.01,
    0.02,
    0.04,
    0.06,
    0.08,
    0.1,
    0.25,
    0.5,
    0.75,
    1.0,
    2.5,
    5.0,
    7.5,
    10.0,
    20.0,
    40.0,
    80.0,
)


@dataclass
class PhaseHistogram:
    """Counts per bucket of PHASE_BUCKETS (the last one above every bound), their sum and count."""

    counts: list[int] = field(default_factory=lambda: [0] * (len(PHASE_BUCKETS) + 1))
    sum: float = 0.0
    count: int = 0

    def observe(self, seconds: float) -> None:
        seconds = max(seconds, 0.0)
        self.counts[bisect.bisect_left(PHASE_BUCKETS, seconds)] += 1
        self.sum += seconds
        self.count += 1

    def copy(self) -> PhaseHistogram:
        return PhaseHistogram(list(self.counts), self.sum, self.count)


@dataclass
class DisaggStats:
    """Cumulative counters of KV handoffs, and a histogram of each TTFT phase per request:
    queue and prefill on the prefill engine, transfer and first decode on the decode engine."""

    role: str
    handoffs_exported: int = 0
    handoffs_imported: int = 0  # requests that continued on transferred KV
    blocks_sent: int = 0
    bytes_sent: int = 0
    blocks_received: int = 0
    bytes_received: int = 0
    blocks_cached: int = 0  # blocks the receiver's prefix cache already held (not sent)
    failures: dict[str, int] = field(default_factory=lambda: {"send": 0, "receive": 0, "refused": 0})
    fallback_prefills: int = 0  # handoffs that failed and were prefilled by the decode engine
    phases: dict[str, PhaseHistogram] = field(default_factory=lambda: {p: PhaseHistogram() for p in PHASES})

    def observe(self, phase: str, seconds: float) -> None:
        self.phases[phase].observe(seconds)

    def copy(self) -> DisaggStats:
        return dataclasses.replace(
            self, failures=dict(self.failures), phases={p: h.copy() for p, h in self.phases.items()}
        )


def sampling_params_to_dict(params: SamplingParams) -> dict:
    check_exportable(params)
    return dataclasses.asdict(params)


def sampling_params_from_dict(data: dict) -> SamplingParams:
    data = dict(data)
    if data.get("logit_bias") is not None:  # JSON keys are strings
        data["logit_bias"] = {int(k): v for k, v in data["logit_bias"].items()}
    return SamplingParams(**data)


class KVHandoffs:
    """One engine's KV handoffs, request by request: bound to its KV cache manager and cache
    tensors (the target model's keys and values, layer by layer). It never touches the
    scheduler's queues: the KVConnector that owns it does, through the scheduler's operations."""

    def __init__(self, role: str, kv_cache: KVCacheManager, caches: Sequence[torch.Tensor], fingerprint: str) -> None:
        self.kv_cache = kv_cache
        self.caches = list(caches)
        self.layout = layout_of(self.caches)
        self.fingerprint = fingerprint
        self.stats = DisaggStats(role)
        self._first_decode_pending: set[str] = set()  # imported, no token decoded here yet

    # ---- prefill side --------------------------------------------------------------------------

    def export(self, request: Request) -> KVHandoff:
        """Copy the request's prompt blocks to host memory; the caller then finishes it here,
        freeing its blocks (they stay in this engine's prefix cache). The request must have
        just sampled its first token."""
        block_size = self.kv_cache.block_size
        num_blocks = self.kv_cache.num_blocks_for(request.num_prompt_tokens)
        blocks = [t.cpu() for t in gather_blocks(self.caches, request.block_ids[:num_blocks])]
        num_full = request.num_prompt_tokens // block_size
        hashes = self.kv_cache.block_hashes(request)[:num_full]
        metrics = request.metrics
        scheduled = metrics.first_scheduled_time or metrics.arrival_time
        header = HandoffHeader(
            request_id=request.parent_id,
            prompt_token_ids=list(request.prompt_token_ids),
            output_token_ids=list(request.output_token_ids),
            sampling_params=sampling_params_to_dict(request.sampling_params),
            cache_salt=request.cache_salt,
            lora_name=request.lora.name if request.lora is not None else None,
            block_size=block_size,
            block_hashes=[h.hex() for h in hashes],
            num_blocks=num_blocks,
            layout=self.layout,
            fingerprint=self.fingerprint,
            queue_seconds=scheduled - metrics.arrival_time,
            prefill_seconds=(metrics.first_token_time or time.time()) - scheduled,
            output_logprobs=[
                [(token_id, entry.logprob, entry.rank) for token_id, entry in position.items()]
                for position in request.output_logprobs
            ]
            or None,
            cumulative_logprob=request.cumulative_logprob,
            generator_state=(
                base64.b64encode(request.generator.get_state().numpy().tobytes()).decode()
                if request.generator is not None
                else None
            ),
        )
        self.stats.handoffs_exported += 1
        self.stats.observe("queue", header.queue_seconds)
        self.stats.observe("prefill", header.prefill_seconds)
        return KVHandoff(header, blocks)

    def record_sent(self, handoff: KVHandoff, num_sent: int) -> None:
        self.stats.blocks_sent += num_sent
        self.stats.bytes_sent += num_sent * handoff.header.block_nbytes

    # ---- decode side ---------------------------------------------------------------------------

    def refusal(self, header: HandoffHeader, request: Request) -> str | None:
        """Why this engine must not use the sender's blocks for `request` (None: it may)."""
        if header.fingerprint != self.fingerprint:
            return "the sender runs another model, dtype, block size or KV cache dtype"
        if header.layout != self.layout or header.block_size != self.kv_cache.block_size:
            return "the sender's KV block layout differs"
        own = [h.hex() for h in self.kv_cache.block_hashes(request)]
        num_full = request.num_prompt_tokens // self.kv_cache.block_size
        if header.block_hashes != own[:num_full]:
            return "the sender's block hashes differ from this engine's for the request's tenant and adapter"
        if header.num_blocks != self.kv_cache.num_blocks_for(request.num_prompt_tokens):
            return "the sender's block count does not cover the prompt"
        return None

    def import_request(self, incoming: IncomingHandoff, request: Request) -> None:
        """Receive the request's blocks (only those this engine's prefix cache lacks) into
        freshly allocated blocks and append the sender's first token, all on the calling
        thread; the caller then starts it decoding.

        `request` holds the prompt only. HandoffRefused: the sender's KV and first token were
        produced under another identity (nothing was appended). TransferError: the transfer
        failed; the first token is appended (it is the sender's to give), everything allocated
        here is released and the request is not scheduled."""
        started = time.perf_counter()
        skip = self.begin_import(incoming, request)
        try:
            for indices, data in incoming.receive(skip):
                self.write_blocks(request, indices, data)
        except TransferError:
            self.abandon_import(request)
            raise
        finally:
            incoming.close()
        self.finish_import(incoming, request, skip, started)

    def begin_import(self, incoming: IncomingHandoff, request: Request) -> int:
        """Check the sender's identity, append its first token and allocate the request's
        blocks; returns how many leading blocks this engine's prefix cache already holds (the
        sender skips them). The caller then receives the rest (write_blocks) and calls
        finish_import, or abandon_import if the transfer fails. Raises as import_request."""
        header = incoming.header
        reason = self.refusal(header, request)
        if reason is not None:
            self.stats.failures["refused"] += 1
            incoming.reject(reason)
            raise HandoffRefused(f"KV handoff of {header.request_id!r} refused: {reason}")
        for token_id in header.output_token_ids:
            request.append_output_token(token_id)
        if header.output_logprobs:
            request.output_logprobs = [
                {int(token_id): Logprob(logprob, rank) for token_id, logprob, rank in position}
                for position in header.output_logprobs
            ]
            request.cumulative_logprob = header.cumulative_logprob
        if header.generator_state is not None and request.generator is not None:
            state = base64.b64decode(header.generator_state)
            request.generator.set_state(torch.frombuffer(bytearray(state), dtype=torch.uint8))
        cached = self.kv_cache.find_cached_prefix(request)
        skip = len(cached)
        if not self.kv_cache.allocate_slots(
            request, request.num_prompt_tokens - skip * self.kv_cache.block_size, cached
        ):
            self.stats.failures["refused"] += 1
            incoming.reject("no free KV blocks on the decode engine")
            raise TransferError(f"KV handoff of {header.request_id!r} refused: no free KV blocks")
        return skip

    def write_blocks(self, request: Request, indices: Sequence[int], data: Sequence[torch.Tensor]) -> None:
        """Write arrived blocks (indices within the request's blocks) into their places; safe
        off the engine thread: the request is in no queue, so no step reads these blocks."""
        scatter_blocks(self.caches, [request.block_ids[i] for i in indices], data)

    def abandon_import(self, request: Request) -> None:
        """The transfer failed: release what begin_import allocated."""
        self.kv_cache.free(request)
        self.stats.failures["receive"] += 1

    def finish_import(self, incoming: IncomingHandoff, request: Request, skip: int, started: float) -> None:
        """Every block is in place: the request may continue decoding here."""
        header = incoming.header
        num_prompt = request.num_prompt_tokens
        self.stats.blocks_received += header.num_blocks - skip
        self.stats.bytes_received += incoming.bytes_received
        self.stats.blocks_cached += skip
        self.stats.handoffs_imported += 1
        request.num_computed_tokens = num_prompt
        request.spec.num_draft_computed_tokens = num_prompt
        request.num_cached_tokens = skip * self.kv_cache.block_size
        self.kv_cache.cache_full_blocks(request, num_prompt)
        self.stats.observe("transfer", time.perf_counter() - started)
        self._first_decode_pending.add(request.request_id)

    def after_step(self, progressed: Sequence[Request]) -> None:
        """Time from joining the running set to the first token the decode engine produced,
        for each imported request."""
        if not self._first_decode_pending:
            return
        now = time.time()
        for request in progressed:
            if request.request_id in self._first_decode_pending:
                self._first_decode_pending.discard(request.request_id)
                scheduled = request.metrics.first_scheduled_time
                assert scheduled is not None, "a request that progressed in a step was scheduled"
                self.stats.observe("first_decode", now - scheduled)

    def forget(self, request_id: str) -> None:
        self._first_decode_pending.discard(request_id)
