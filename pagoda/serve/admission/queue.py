"""Admission control: a bounded queue in front of the engine.

A request is "queued" from admission until its first output arrives (it has been scheduled
and computed its prompt). Past --max-queued-requests or --max-queued-tokens (prompt tokens of
queued requests) new requests are refused at once with a 503 instead of waiting without
bound. An empty queue always admits, so one prompt larger than the token limit can still run.
With latency targets (latency_targets.py), requests are also refused while the admitted ones
miss them, whatever the queue holds.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.serve.errors import overloaded
from pagoda.serve.admission.latency_targets import LatencyGuard, LatencyTargets

RETRY_AFTER_SECONDS = 1.0


@dataclass
class QueueSlot:
    """One engine request's place in the queue; `leave` when it starts or ends (idempotent)."""

    controller: "AdmissionController"
    num_tokens: int
    left: bool = False

    def leave(self) -> None:
        if not self.left:
            self.left = True
            self.controller._leave(self)


class AdmissionController:
    """Counts queued requests and tokens. Used from the event loop thread only."""

    def __init__(self, max_queued_requests: int | None, max_queued_tokens: int | None,
                 latency_targets: LatencyTargets | None = None) -> None:
        self.max_queued_requests = max_queued_requests
        self.max_queued_tokens = max_queued_tokens
        self.queued_requests = 0
        self.queued_tokens = 0
        self.latency = LatencyGuard(latency_targets) if latency_targets and latency_targets.enabled else None

    def observe_first_token(self, seconds: float) -> None:
        if self.latency is not None:
            self.latency.observe_ttft(seconds)

    def observe_inter_token(self, seconds: float, num_tokens: int = 1) -> None:
        """`num_tokens` arrived `seconds` after the previous ones."""
        if self.latency is not None and num_tokens > 0:
            self.latency.observe_itl(seconds / num_tokens, num_tokens)

    def admit(self, prompt_token_counts: list[int]) -> list[QueueSlot]:
        """Queue slots for the engine requests of one HTTP request (one per prompt), or 503."""
        refusal = self.latency.check() if self.latency is not None else None
        if refusal is not None:
            raise overloaded(refusal.message, refusal.retry_after_s)
        if self.queued_requests > 0:
            num_requests = self.queued_requests + len(prompt_token_counts)
            if self.max_queued_requests is not None and num_requests > self.max_queued_requests:
                raise overloaded(
                    f"Server overloaded: {self.queued_requests} requests queued "
                    f"(limit {self.max_queued_requests}). Retry later.", RETRY_AFTER_SECONDS)
            num_tokens = self.queued_tokens + sum(prompt_token_counts)
            if self.max_queued_tokens is not None and num_tokens > self.max_queued_tokens:
                raise overloaded(
                    f"Server overloaded: {self.queued_tokens} prompt tokens queued "
                    f"(limit {self.max_queued_tokens}). Retry later.", RETRY_AFTER_SECONDS)
        slots = [QueueSlot(self, n) for n in prompt_token_counts]
        self.queued_requests += len(slots)
        self.queued_tokens += sum(prompt_token_counts)
        return slots

    def _leave(self, slot: QueueSlot) -> None:
        self.queued_requests -= 1
        self.queued_tokens -= slot.num_tokens
