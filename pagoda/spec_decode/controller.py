"""SpecDecodeController: the one owner of speculative decoding in the engine.

Each step it decides which requests speculate and how many drafts they want (`plan`, before
the scheduler), proposes the drafts (n-gram lookup before scheduling, the draft model inside
the runner's step: `propose`), verifies them against the target's logits (`verify`, the
rejection sampler) and keeps the acceptance counters (`record`). The model runner reaches it
through the small `Speculator` interface it defines, so worker code never imports this package.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagoda.config import SpeculativeConfig
from pagoda.core.scheduler import SchedulerOutput
from pagoda.request import Request
from pagoda.spec_decode.draft_proposer import DraftModelProposer
from pagoda.spec_decode.ngram_proposer import NgramProposer
from pagoda.spec_decode.rejection_sampler import Verification, verify
from pagoda.worker.sampler import Sampler


@dataclass
class SpecDecodeStats:
    """Cumulative speculative-decoding counters (vLLM's names, pagoda: prefix)."""

    num_drafts: int = 0  # request-steps that verified drafts
    num_draft_tokens: int = 0
    num_accepted_tokens: int = 0
    accepted_per_position: list[int] = field(default_factory=list)  # index i: drafts accepted at position i

    @property
    def acceptance_rate(self) -> float:
        return self.num_accepted_tokens / self.num_draft_tokens if self.num_draft_tokens else 0.0

    @property
    def mean_accepted_length(self) -> float:
        """Tokens emitted per verifying step: accepted drafts plus the target's own token."""
        return 1 + self.num_accepted_tokens / self.num_drafts if self.num_drafts else 0.0


class SpecDecodeController:
    def __init__(self, config: SpeculativeConfig, drafter: DraftModelProposer | None = None) -> None:
        self.method = config.speculative  # None, "ngram" or "draft"
        self.num_speculative_tokens = config.num_speculative_tokens
        self.max_batch = config.speculative_max_batch
        self.ngram = NgramProposer(config.ngram_min, config.ngram_max) if self.method == "ngram" else None
        self.drafter = drafter
        self._stats = SpecDecodeStats(accepted_per_position=[0] * config.num_speculative_tokens)

    def reset_stats(self) -> None:
        """Zero the counters (the engine's startup calibration steps are not traffic)."""
        self._stats = SpecDecodeStats(accepted_per_position=[0] * len(self._stats.accepted_per_position))

    @property
    def kv_caches(self) -> list[tuple[torch.Tensor, torch.Tensor]]:
        """The draft model's KV tensors (same block ids as the target's), for copy-on-write."""
        return self.drafter.distinct_kv_caches if self.drafter is not None else []

    def plan(self, running: Sequence[Request]) -> None:
        """Decide each decoding request's drafts for this step. Beyond speculative_max_batch
        running requests a step is compute-bound and verifying drafts costs more than it saves,
        so speculation pauses (see benchmarks/spec_decode.py for the measurement)."""
        if self.method is None:
            return
        enabled = len(running) <= self.max_batch
        k = self.num_speculative_tokens
        for request in running:
            spec = request.spec
            if not enabled or request.num_computed_tokens != request.num_tokens - 1 or request.pending_forks:
                spec.clear_drafts()
            elif self.ngram is not None:
                drafts = self.ngram.propose(request.all_token_ids, k)
                if request.structured_output is not None:  # a draft the grammar rejects ends the drafts
                    drafts = drafts[: request.structured_output.grammar_prefix(drafts)]
                spec.token_ids = drafts
                spec.num_wanted = len(drafts)
            else:
                spec.num_wanted = k  # the draft model fills spec.token_ids in `propose`

    def propose(self, scheduler_output: SchedulerOutput, sampler: Sampler) -> dict[str, torch.Tensor | None]:
        """Run the draft model for the scheduled step (n-gram drafts were made in `plan`).
        Returns per speculating request the draft distributions its drafts were sampled from."""
        if self.drafter is None:
            return {}
        return self.drafter.run(scheduler_output, sampler)

    def verify(
        self,
        sampler: Sampler,
        logits: torch.Tensor,
        request: Request,
        drafts: list[int],
        draft_probs: torch.Tensor | None,
    ) -> Verification:
        return verify(sampler, logits, request, drafts, draft_probs)

    def record(self, scheduler_output: SchedulerOutput, num_accepted: dict[str, int]) -> None:
        stats = self._stats
        for entry in scheduler_output.scheduled:
            accepted = num_accepted.get(entry.request.request_id)
            if accepted is None:
                continue
            stats.num_drafts += 1
            stats.num_draft_tokens += entry.num_spec_tokens
            stats.num_accepted_tokens += accepted
            for position in range(accepted):
                stats.accepted_per_position[position] += 1

    def stats(self) -> SpecDecodeStats:
        """A copy of the counters, safe to hand to another thread."""
        s = self._stats
        return SpecDecodeStats(s.num_drafts, s.num_draft_tokens, s.num_accepted_tokens, list(s.accepted_per_position))
