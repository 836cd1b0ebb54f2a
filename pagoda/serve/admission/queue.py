"""Admission control: a bounded queue in front of the engine.

A prompt is "queued" from admission until its first output arrives (it has been scheduled and
computed its prompt). The queue counts sequences (every prompt of a batch times `n`) against
--max-queued-requests and prompt tokens against --max-queued-tokens; past either, new requests
are refused at once with a 503 instead of waiting without bound. A request that could not fit
even into an empty queue gets a 400 naming the limit and what it allows. The token limit is
never below the context length, so one prompt of any valid length always fits.

Admission is two steps so that refusals come before the costly work (and while the queue is
full, `refusal_of_any` lets the server refuse before it even reads the body: fast_refusal.py): `reserve` decides from
the
body alone (sequence count, latency targets, a queue already full of tokens) before anything is
tokenized; `charge_tokens` adds the prompt tokens once they are known. With latency targets
(latency_targets.py), requests are also refused while the admitted ones miss them, whatever
the queue holds.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, MutableMapping
from dataclasses import dataclass
from typing import Any

from pagoda.serve.admission.latency_targets import LatencyGuard, LatencyTargets
from pagoda.serve.admission.work import RequestWork, never_fits
from pagoda.serve.errors import APIError, overloaded

RETRY_AFTER_SECONDS = 1.0


@dataclass
class QueueSlot:
    """One prompt's place in the queue (its `n` sequences); `leave` when it starts or ends
    (idempotent)."""

    controller: AdmissionController
    num_sequences: int
    num_tokens: int = 0
    left: bool = False

    def leave(self) -> None:
        if not self.left:
            self.left = True
            self.controller._leave(self)


# The ASGI scope key holding the controller that counts a request as arriving, and its entry.
ARRIVING = "pagoda.arriving"
# How long a request counts as arriving: a burst reaches admission well within it, while a client
# that sends its body slowly cannot hold a queue slot with it (the body deadline is longer).
ARRIVAL_WINDOW_S = 1.0


@dataclass
class _Arrival:
    started: float
    counted: bool = True


def end_arrival(scope: MutableMapping[str, Any]) -> None:
    """The request reached admission (any model's), or ended before it: it no longer counts as
    arriving where it was counted. Once per request; a no-op for requests never counted."""
    held = scope.pop(ARRIVING, None)
    if held is not None:
        controller, arrival = held
        controller._uncount(arrival)


class AdmissionController:
    """Counts queued sequences and tokens, and the requests still arriving (past the fast
    refusal, their bodies being read: one sequence each). Used from the event loop thread only."""

    def __init__(
        self,
        max_queued_requests: int | None,
        max_queued_tokens: int | None,
        latency_targets: LatencyTargets | None = None,
        *,
        max_model_len: int = 0,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.max_queued_requests = max_queued_requests
        self.max_queued_tokens = max(max_queued_tokens, max_model_len) if max_queued_tokens is not None else None
        self.queued_sequences = 0
        self.queued_tokens = 0
        self.arriving = 0  # counted arrivals: started within ARRIVAL_WINDOW_S, not yet admitted
        self._arrivals: deque[_Arrival] = deque()  # oldest first; ended ones leave lazily
        self._clock = clock
        self.latency = LatencyGuard(latency_targets) if latency_targets and latency_targets.enabled else None

    def observe_first_token(self, seconds: float) -> None:
        if self.latency is not None:
            self.latency.observe_ttft(seconds)

    def observe_inter_token(self, seconds: float, num_tokens: int = 1) -> None:
        """`num_tokens` arrived `seconds` after the previous ones."""
        if self.latency is not None and num_tokens > 0:
            self.latency.observe_itl(seconds / num_tokens, num_tokens)

    def refusal_of_any(self) -> APIError | None:
        """The 503 `reserve` answers now to any request, whatever its size (the queue holds its
        limit of sequences or of tokens, counting the requests still arriving as one sequence
        each for at most ARRIVAL_WINDOW_S), or None when that depends on the request. Reads counters and changes
        nothing: the
        server asks it before a request's body is read. Counting the arriving matters in a burst:
        every request of it passes this check before the first one reaches `reserve`."""
        limit = self.max_queued_requests
        self._age_arrivals()
        if limit is not None and self.queued_sequences + self.arriving >= limit:
            return overloaded(
                f"Server overloaded: {self.queued_sequences} sequences queued and "
                f"{self.arriving} arriving (limit {limit}). Retry later.",
                RETRY_AFTER_SECONDS,
            )
        if self.max_queued_tokens is not None and self.queued_tokens >= self.max_queued_tokens:
            return self._tokens_full()
        return None

    def arrival_started(self, scope: dict) -> None:
        """A request passed the fast refusal and goes on to have its body read."""
        arrival = _Arrival(self._clock())
        self._arrivals.append(arrival)
        self.arriving += 1
        scope[ARRIVING] = (self, arrival)

    def _uncount(self, arrival: _Arrival) -> None:
        if arrival.counted:
            arrival.counted = False
            self.arriving -= 1

    def _age_arrivals(self) -> None:
        """Drop ended arrivals from the front, and stop counting those older than the window."""
        cutoff = self._clock() - ARRIVAL_WINDOW_S
        arrivals = self._arrivals
        while arrivals and (not arrivals[0].counted or arrivals[0].started < cutoff):
            self._uncount(arrivals.popleft())

    def reserve(self, work: RequestWork) -> list[QueueSlot]:
        """Queue slots for one HTTP request's prompts (no tokens yet), or a 400 / 503."""
        refusal = self.latency.check() if self.latency is not None else None
        if refusal is not None:
            raise overloaded(refusal.message, refusal.retry_after_s)
        limit = self.max_queued_requests
        if limit is not None:
            if work.num_sequences > limit:
                raise never_fits(
                    f"This request runs {work.describe_sequences()}; the server queues at most "
                    f"{limit} sequences (--max-queued-requests). Send fewer prompts or a smaller n.",
                    param="n" if work.n > 1 else "prompt",
                )
            if self.queued_sequences + work.num_sequences > limit:
                raise overloaded(
                    f"Server overloaded: {self.queued_sequences} sequences queued (limit {limit}); "
                    f"this request needs {work.num_sequences}. Retry later.",
                    RETRY_AFTER_SECONDS,
                )
        if self.max_queued_tokens is not None and self.queued_tokens >= self.max_queued_tokens:
            raise self._tokens_full()
        slots = [QueueSlot(self, work.n) for _ in range(work.num_prompts)]
        self.queued_sequences += work.num_sequences
        return slots

    def charge_tokens(self, slots: list[QueueSlot], prompt_token_counts: list[int]) -> None:
        """Add the reserved prompts' token counts (one per slot), or raise a 400 / 503 (the
        caller still owns the slots and leaves them)."""
        limit = self.max_queued_tokens
        num_tokens = sum(prompt_token_counts)
        if limit is not None:
            if num_tokens > limit:
                raise never_fits(
                    f"This request's prompts hold {num_tokens} tokens; the server queues at most "
                    f"{limit} prompt tokens (--max-queued-tokens). Send fewer or shorter prompts.",
                    param="prompt",
                )
            if self.queued_tokens + num_tokens > limit:
                raise self._tokens_full()
        for slot, count in zip(slots, prompt_token_counts, strict=True):
            slot.num_tokens = count
        self.queued_tokens += num_tokens

    def _tokens_full(self) -> APIError:
        return overloaded(
            f"Server overloaded: {self.queued_tokens} prompt tokens queued "
            f"(limit {self.max_queued_tokens}). Retry later.",
            RETRY_AFTER_SECONDS,
        )

    def _leave(self, slot: QueueSlot) -> None:
        self.queued_sequences -= slot.num_sequences
        self.queued_tokens -= slot.num_tokens
