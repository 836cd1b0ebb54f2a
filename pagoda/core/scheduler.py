"""The scheduler: one token budget per step, running requests first, then waiting ones.

There are no prefill or decode steps: each step hands each request some of the tokens it is
behind on. `max_num_seqs` counts sequences, not requests: a request's samples still to be forked
(`n > 1`) hold their slots from the moment it is admitted, so forking never overshoots it. A long prompt is cut into
chunks (chunked prefill); when KV blocks run out, the
lowest-ranked running request is preempted: its blocks freed and recomputed later, or, with a
host tier and --preemption-mode swap/auto, copied out and back (kv_cache.swap_out/swap_in).

Pipeline parallelism keeps up to `num_micro_batches` steps in flight: a request scheduled in
one is skipped (never scheduled, preempted or re-planned) until that step's output comes back,
so the batches in flight hold disjoint requests, and each takes at most its share of the
requests, so the stages get batches of a similar size.

LongRoPE (pagoda.model.rope): a request that grows past the model's boundary while decoding
is computed again from position 0 with the long factors, through the same recompute path as
preemption; its prefix-cache keys change with its factors.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

from pagoda.core.adapter_limit import AdapterLimit
from pagoda.core.encoder_cache import EncoderCache, EncoderStep
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.request import Request, RequestStatus


@dataclass
class ScheduledRequest:
    request: Request
    num_new_tokens: int  # real tokens, then `num_spec_tokens` drafted ones
    num_computed_before: int  # position of the first token computed this step
    num_spec_tokens: int = 0

    @property
    def samples(self) -> bool:
        """Whether this chunk reaches the end of the request's tokens, so its logits are sampled."""
        return self.num_computed_before + self.num_new_tokens - self.num_spec_tokens == self.request.num_tokens


@dataclass
class SchedulerOutput:
    scheduled: list[ScheduledRequest] = field(default_factory=list)
    block_copies: list[tuple[int, int]] = field(default_factory=list)  # copy-on-write (src, dst)
    preempted: list[Request] = field(default_factory=list)
    kv_transfers: list = field(default_factory=list)  # KV tier copies (TransferOp), before block_copies
    state_copies: list[tuple[int, int]] = field(default_factory=list)  # a hybrid's forked state slots (src, dst)
    # A hybrid's state snapshots to save this step: (request id, tokens into its chunk, snapshot slot).
    state_snapshots: list[tuple[str, int, int]] = field(default_factory=list)
    # Images to encode before the forward (pagoda.core.encoder_cache): (cache key, item).
    encoder_work: list = field(default_factory=list)

    @property
    def num_batched_tokens(self) -> int:
        return sum(s.num_new_tokens for s in self.scheduled)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled


class WaitingQueue:
    """Requests not yet running. FCFS: arrival order, preempted ones back at the front.
    Priority: lowest `priority` value first, then arrival."""

    def __init__(self, policy: str) -> None:
        self.policy = policy
        self._fifo: deque[Request] = deque()
        self._heap: list[tuple[int, float, int, Request]] = []
        self._counter = itertools.count()

    def __len__(self) -> int:
        return len(self._fifo) if self.policy == "fcfs" else len(self._heap)

    def __iter__(self):
        if self.policy == "fcfs":
            return iter(self._fifo)
        return (entry[-1] for entry in sorted(self._heap))

    def push(self, request: Request) -> None:
        if self.policy == "fcfs":
            self._fifo.append(request)
        else:
            heapq.heappush(self._heap, self._key(request))

    def push_front(self, request: Request) -> None:
        if self.policy == "fcfs":
            self._fifo.appendleft(request)
        else:  # its original arrival time already ranks it ahead of later peers
            heapq.heappush(self._heap, self._key(request))

    def peek(self) -> Request:
        return self._fifo[0] if self.policy == "fcfs" else self._heap[0][-1]

    def pop(self) -> Request:
        return self._fifo.popleft() if self.policy == "fcfs" else heapq.heappop(self._heap)[-1]

    def remove(self, request: Request) -> None:
        if self.policy == "fcfs":
            self._fifo.remove(request)
        else:
            self._heap = [e for e in self._heap if e[-1] is not request]
            heapq.heapify(self._heap)

    def _key(self, request: Request) -> tuple[int, float, int, Request]:
        return (request.priority, request.arrival_time, next(self._counter), request)


class Scheduler:
    def __init__(
        self,
        kv_cache: KVCacheManager,
        *,
        max_num_seqs: int,
        max_num_batched_tokens: int,
        max_model_len: int,
        enable_chunked_prefill: bool = True,
        policy: str = "fcfs",
        draft_shares_blocks: bool = False,
        max_loras: int | None = None,
        long_rope_boundary: int | None = None,
        num_micro_batches: int = 1,
    ) -> None:
        self.kv_cache = kv_cache
        self.num_micro_batches = num_micro_batches
        self._in_flight: set[int] = set()  # ids of requests scheduled in a step not yet updated
        # LongRoPE: the longest request computed with the short factors (None: one set of factors).
        self.long_rope_boundary = long_rope_boundary
        self.num_rope_recomputes = 0  # requests recomputed on the long factors after crossing
        # LoRA: at most this many distinct adapters in the running set (so in any step).
        self.adapter_limit = AdapterLimit(max_loras, max_bypasses=max_num_seqs) if max_loras else None
        # A draft model keeps its KV in the same blocks: a block is cacheable once both computed it.
        self.draft_shares_blocks = draft_shares_blocks
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.max_model_len = max_model_len
        self.enable_chunked_prefill = enable_chunked_prefill
        self.policy = policy
        self.waiting = WaitingQueue(policy)
        self.running: list[Request] = []
        # Requests whose KV was imported (prefill/decode disaggregation), waiting for a running slot.
        self.imported: deque[Request] = deque()
        self.num_preemptions = 0
        self.num_preemptions_by_mode = {"recompute": 0, "swap": 0}
        self.prefix_cache_queries = 0  # tokens looked up in the prefix cache
        self.prefix_cache_hits = 0  # of which found
        # A vision-language model's encoder outputs and per-step encoder budget (None: text only).
        self.encoder_cache: EncoderCache | None = None
        self.max_num_encoder_tokens = max_num_batched_tokens
        self._encoder_step: EncoderStep | None = None  # the plan of the step being scheduled
        self.whole_images = False  # a chunk never ends inside an image (its tokens attend both ways)

    # ---- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        request.status = RequestStatus.WAITING
        self.waiting.push(request)
        # More samples than --max-num-seqs can never run together: the excess wait as requests
        # of their own (they compute the prompt again, or find it in the prefix cache).
        if request.num_sequences > self.max_num_seqs:
            alone = request.pending_forks[self.max_num_seqs - 1 :]
            request.pending_forks = request.pending_forks[: self.max_num_seqs - 1]
            for sample in alone:
                sample.status = RequestStatus.WAITING
                self.waiting.push(sample)

    def needs_long_rope(self, num_tokens: int) -> bool:
        """Whether a request of `num_tokens` tokens is computed with LongRoPE's long factors."""
        return self.long_rope_boundary is not None and num_tokens > self.long_rope_boundary

    @property
    def num_running_seqs(self) -> int:
        """Sequences the running set holds, counting samples that will fork off a running lead."""
        return sum(r.num_sequences for r in self.running)

    def add_imported(self, request: Request) -> None:
        """A request whose KV is already in place (imported from a prefill engine, its first
        token appended) joins the running set directly, ahead of waiting ones: waiting would
        hold its blocks idle. At once if --max-num-seqs leaves room, else at admit_imported."""
        self.imported.append(request)
        self.admit_imported()

    def admit_imported(self) -> None:
        """Imported requests join the running set as far as --max-num-seqs allows."""
        while self.imported and self.num_running_seqs + self.imported[0].num_sequences <= self.max_num_seqs:
            request = self.imported.popleft()
            request.status = RequestStatus.RUNNING
            request.metrics.first_scheduled_time = time.time()
            self.running.append(request)

    def finish_requests(self, requests: Iterable[Request], status: RequestStatus) -> None:
        """End requests from outside the step (aborts, stop strings). Frees their blocks now."""
        for request in requests:
            if request.is_finished:
                continue
            if request.status == RequestStatus.RUNNING:
                self.running.remove(request)
            elif request in self.waiting:
                self.waiting.remove(request)
            elif request in self.imported:
                self.imported.remove(request)
            self._finish(request, status)
            for child in request.pending_forks:
                self._finish(child, status)
            request.pending_forks = []

    def has_unfinished_requests(self) -> bool:
        return bool(self.running) or len(self.waiting) > 0 or bool(self.imported)

    def not_in_flight(self) -> list[Request]:
        """Running requests free to be scheduled (all of them with one micro-batch)."""
        return [r for r in self.running if id(r) not in self._in_flight]

    def _micro_batch_limit(self) -> int | None:
        """Requests one micro-batch may take: an even share of the work (None: no limit)."""
        if self.num_micro_batches == 1:
            return None
        total = len(self.running) + len(self.waiting)
        return max(1, -(-total // self.num_micro_batches))

    # ---- one step ------------------------------------------------------------------------------

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput()
        budget = self.max_num_batched_tokens
        scheduled_now: dict[int, ScheduledRequest] = {}
        limit = self._micro_batch_limit()
        cache = self.encoder_cache
        self._encoder_step = (
            EncoderStep(cache, self.max_num_encoder_tokens, self.whole_images) if cache is not None else None
        )

        index = 0
        while index < len(self.running) and budget > 0 and (limit is None or len(scheduled_now) < limit):
            request = self.running[index]
            if id(request) in self._in_flight:
                index += 1
                continue
            if not request.long_rope and self.needs_long_rope(request.num_tokens):
                self._recompute_on_long_rope(request)  # the next one shifted into `index`
                continue
            num_new = self._encodable(request, request.num_computed_tokens, budget)
            if num_new <= 0:
                index += 1
                continue
            num_spec = self._num_spec_tokens(request, budget - num_new)
            num_new += num_spec
            num_preempted = len(output.preempted)
            while not self.kv_cache.allocate_slots(request, num_new):
                victim = self._pick_victim()
                refund = scheduled_now.pop(id(victim), None)
                if refund is not None:
                    budget += refund.num_new_tokens
                self._preempt(victim)
                output.preempted.append(victim)
                if victim is request:
                    break
            if request.status != RequestStatus.RUNNING:
                continue  # preempted itself; the next request shifted into `index`
            scheduled_now[id(request)] = ScheduledRequest(request, num_new, request.num_computed_tokens, num_spec)
            budget -= num_new
            if len(output.preempted) == num_preempted:
                index += 1
            else:  # victims standing before it shifted the list
                index = self.running.index(request) + 1

        # Admitting new work right after preempting would only thrash the cache.
        if not output.preempted and (limit is None or len(scheduled_now) < limit):
            budget = self._admit_waiting(budget, scheduled_now, output, limit)

        output.scheduled = list(scheduled_now.values())
        if self.num_micro_batches > 1:
            self._in_flight.update(id(entry.request) for entry in output.scheduled)
        output.block_copies = self.kv_cache.take_pending_copies()
        if self.kv_cache.state_slots is not None and output.scheduled:
            # a step without work never reaches the runner: its state copies wait for the next one
            output.state_copies = self.kv_cache.state_slots.take_pending_copies()
            output.state_snapshots = self.kv_cache.take_state_snapshots()
        output.kv_transfers = self.kv_cache.take_transfers()
        if self._encoder_step is not None:
            output.encoder_work = self._encoder_step.work
        now = time.time()
        for entry in output.scheduled:
            if entry.request.metrics.first_scheduled_time is None:
                entry.request.metrics.first_scheduled_time = now
        return output

    def _admit_waiting(
        self, budget: int, scheduled_now: dict[int, ScheduledRequest], output: SchedulerOutput, batch_limit: int | None
    ) -> int:
        limit = self.adapter_limit
        if limit is None:
            return self._admit_in_order(budget, scheduled_now, output, None, batch_limit)
        # Requests whose adapter does not fit step aside, to the front again afterwards.
        passed_over: list[Request] = []
        try:
            return self._admit_in_order(budget, scheduled_now, output, (limit, passed_over), batch_limit)
        finally:
            for request in reversed(passed_over):
                self.waiting.push_front(request)

    def _admit_in_order(
        self,
        budget: int,
        scheduled_now: dict[int, ScheduledRequest],
        output: SchedulerOutput,
        adapters: tuple[AdapterLimit, list[Request]] | None,
        batch_limit: int | None,
    ) -> int:
        active = AdapterLimit.adapters_of(self.running) if adapters is not None else set()
        while len(self.waiting) and budget > 0 and (batch_limit is None or len(scheduled_now) < batch_limit):
            request = self.waiting.peek()
            if adapters is not None:
                limit, passed_over = adapters
                if not limit.may_pass(passed_over):
                    break  # one stepped aside often enough: nothing overtakes it any more
                if not limit.fits(request, active):
                    if not limit.may_pass([request]):
                        break
                    passed_over.append(self.waiting.pop())
                    continue
            swapped = self.kv_cache.is_swapped(request)  # its computed KV waits in the host tier
            # Prompt logprobs and embeddings need every prompt position computed: no cache hits.
            # Scoring ("classify") reads the last position only, which is never a hit (rerank's
            # pairs share their query's blocks).
            cached = (
                []
                if swapped
                or request.sampling_params.prompt_logprobs is not None
                or request.sampling_params.pooling not in (None, "classify")
                else self.kv_cache.find_cached_prefix(request)
            )
            num_cached = request.num_computed_tokens if swapped else len(cached) * self.kv_cache.block_size
            num_new = request.prefill_limit - num_cached
            if not self.enable_chunked_prefill and num_new > budget:
                break
            num_new = self._encodable(request, num_cached, budget)
            if num_new <= 0 < request.prefill_limit - num_cached:
                break  # its next image waits for the next step's encoder budget
            admitted = self.num_running_seqs + request.num_sequences <= self.max_num_seqs and (
                self.kv_cache.swap_in(request, num_new)
                if swapped
                else self.kv_cache.allocate_slots(request, num_new, cached)
            )
            if not admitted:
                victim = self._lower_priority_victim(request)
                if victim is None:
                    break
                refund = scheduled_now.pop(id(victim), None)
                if refund is not None:
                    budget += refund.num_new_tokens
                self._preempt(victim)
                output.preempted.append(victim)
                continue
            self.waiting.pop()
            if not swapped:
                self.prefix_cache_queries += request.num_tokens
                self.prefix_cache_hits += num_cached
                if request.num_cached_tokens < 0:
                    request.num_cached_tokens = num_cached
                request.num_computed_tokens = num_cached
                request.spec.num_draft_computed_tokens = num_cached
            request.status = RequestStatus.RUNNING
            self.running.append(request)
            if adapters is not None:
                adapters[0].admitted(request, active, adapters[1])
            if num_new > 0:
                scheduled_now[id(request)] = ScheduledRequest(request, num_new, num_cached)
                budget -= num_new
            else:  # the cache served everything up to the fork point
                self._fork_pending(request)
        return budget

    def _encodable(self, request: Request, start: int, budget: int) -> int:
        """Tokens to compute from `start` within the budget, cut before an image this step's
        encoder budget cannot encode."""
        num_new = min(request.prefill_limit - start, budget)
        if self._encoder_step is None or not request.media or num_new <= 0:
            return num_new
        return self._encoder_step.limit(request, start, num_new)

    def _num_spec_tokens(self, request: Request, budget: int) -> int:
        """Drafted tokens to verify after a decoding request's real token, within the budget,
        the context length and the tokens it may still emit."""
        if not request.spec.num_wanted or request.num_computed_tokens != request.num_tokens - 1:
            return 0
        remaining_output = request.max_output_tokens - request.num_output_tokens - 1
        room = self.max_model_len - request.num_tokens
        if not request.long_rope and self.long_rope_boundary is not None:
            # Scored on the short factors, drafts must not reach past the boundary.
            room = min(room, self.long_rope_boundary - request.num_tokens)
        return max(0, min(request.spec.num_wanted, budget, remaining_output, room))

    def _lower_priority_victim(self, request: Request) -> Request | None:
        """Under the priority policy, a running request ranked below `request` (it gives way)."""
        if self.policy != "priority" or not self.not_in_flight():
            return None
        victim = self._pick_victim()
        if (victim.priority, victim.arrival_time) > (request.priority, request.arrival_time):
            return victim
        return None

    def _pick_victim(self) -> Request:
        """The lowest-ranked running request not in flight (the one being scheduled never is)."""
        candidates = self.not_in_flight() if self._in_flight else self.running
        if self.policy == "priority":
            return max(candidates, key=lambda r: (r.priority, r.arrival_time))
        return candidates[-1]

    def _preempt(self, request: Request) -> None:
        self.running.remove(request)
        swapped = self.kv_cache.swap_out(request)
        if swapped:
            # The KV (the draft model's too) comes back with the request: only the drafts go.
            request.spec.clear_drafts()
        else:
            self.kv_cache.free(request)
            request.num_computed_tokens = 0
            request.spec.reset()
        self.num_preemptions_by_mode["swap" if swapped else "recompute"] += 1
        request.status = RequestStatus.PREEMPTED
        request.metrics.num_preemptions += 1
        self.num_preemptions += 1
        self.waiting.push_front(request)

    def _recompute_on_long_rope(self, request: Request) -> None:
        """The request grew past LongRoPE's boundary: its KV (short factors) is dropped and it
        waits at the front to be computed again on the long factors, finding what the prefix
        cache holds under its new keys."""
        self.running.remove(request)
        self.kv_cache.free(request)
        request.num_computed_tokens = 0
        request.spec.reset()
        request.long_rope = True
        request.block_hashes = []
        request.status = RequestStatus.PREEMPTED
        self.num_rope_recomputes += 1
        self.waiting.push_front(request)

    # ---- after the forward ---------------------------------------------------------------------

    def update_from_output(self, output: SchedulerOutput, sampled_token_ids: dict[str, list[int]]) -> list[Request]:
        """Advance each scheduled request; append sampled tokens; finish the ones that stopped.

        Returns the requests that received tokens (finished or not)."""
        progressed: list[Request] = []
        now = time.time()
        for entry in output.scheduled:
            request = entry.request
            self._in_flight.discard(id(request))
            if request.is_finished:
                continue
            sampled = sampled_token_ids.get(request.request_id, [])
            if entry.num_spec_tokens:
                # Real token + accepted drafts are computed; KV of rejected drafts is dropped.
                num_accepted = len(sampled) - 1
                request.num_computed_tokens += entry.num_new_tokens - entry.num_spec_tokens + num_accepted
                self.kv_cache.trim(request, request.num_computed_tokens)
            else:
                request.num_computed_tokens += entry.num_new_tokens
            request.spec.after_step(request.num_computed_tokens)
            if not entry.samples:
                self._cache_computed_blocks(request)
                if request.pending_forks and request.num_computed_tokens >= request.prefill_limit:
                    self._fork_pending(request)
                continue
            status = None
            for token_id in sampled:
                request.append_output_token(token_id)
                metrics = request.metrics
                if metrics.first_token_time is None:
                    metrics.first_token_time = now
                metrics.last_token_time = now
                status = self._check_stop(request, token_id)
                if status is not None:
                    break
            self._cache_computed_blocks(request)  # before finishing, so a finished prompt is reusable
            if status is not None:
                self.running.remove(request)
                self._finish(request, status)
            progressed.append(request)
        return progressed

    def _cache_computed_blocks(self, request: Request) -> None:
        cacheable = min(request.num_computed_tokens, request.num_tokens)
        if self.draft_shares_blocks:
            cacheable = min(cacheable, request.spec.num_draft_computed_tokens)
        self.kv_cache.cache_full_blocks(request, cacheable)

    def _check_stop(self, request: Request, token_id: int) -> RequestStatus | None:
        params = request.sampling_params
        if request.num_output_tokens >= params.min_tokens:
            if not params.ignore_eos and token_id in request.eos_token_ids:
                return RequestStatus.FINISHED_STOPPED
            if token_id in params.stop_token_ids:
                request.stop_reason = token_id
                return RequestStatus.FINISHED_STOPPED
        if request.num_output_tokens >= request.max_output_tokens or request.num_tokens >= self.max_model_len:
            return RequestStatus.FINISHED_LENGTH
        return None

    def _fork_pending(self, lead: Request) -> None:
        """The lead has computed all but the last prompt token: its samples start from here,
        sharing its blocks; each computes the last prompt token itself (copy-on-write)."""
        position = self.running.index(lead) + 1
        for child in lead.pending_forks:
            self.kv_cache.fork(lead, child)
            child.status = RequestStatus.RUNNING
            child.num_cached_tokens = lead.num_cached_tokens
            child.metrics.first_scheduled_time = lead.metrics.first_scheduled_time
            self.running.insert(position, child)
            position += 1
        lead.pending_forks = []

    def _finish(self, request: Request, status: RequestStatus) -> None:
        request.status = status
        request.metrics.finished_time = time.time()
        self.kv_cache.free(request)
        if self.adapter_limit is not None:
            self.adapter_limit.forget(request)
