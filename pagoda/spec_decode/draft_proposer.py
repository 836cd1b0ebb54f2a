"""Draft-model proposals: a small model with the target's tokenizer guesses the next K tokens.

The draft keeps its KV in the same blocks as the target (same block ids and slots, its own
tensors), so it is allocated, freed, preempted and prefix-cached in step with the target's
without a second block manager. Each step it first catches up on every scheduled request's
real tokens (so its cache never falls behind), which also yields the first draft for the
requests that speculate; then K - 1 single-token passes yield the rest.

Drafts of a constrained request are sampled under its grammar (the draft logits masked as the
target's are), so the draft model never spends a position on a token the verifier must reject:
each draft advances the request's matcher tentatively, and all of them are rolled back before
the target's masks are computed for verification.
"""

from __future__ import annotations

import torch

from pagoda.core.scheduler import SchedulerOutput
from pagoda.kernels.bitmask import allocate_bitmask, apply_bitmask
from pagoda.request import Request
from pagoda.worker.model_runner import PagedModel, Segment, build_batch
from pagoda.worker.sampler import DraftedRow, Sampler


class DraftModelProposer(PagedModel):
    """The draft model with its own KV tensors (PagedModel), proposing drafts each step."""

    def run(self, scheduler_output: SchedulerOutput, sampler: Sampler) -> dict[str, torch.Tensor | None]:
        """Fill `spec.token_ids` of the speculating requests. Returns, per such request, the
        draft distributions [K, V] its drafts were sampled from (None for greedy requests)."""
        segments: list[Segment] = []
        speculating: list[tuple[int, Request, int]] = []  # (segment index, request, drafts wanted)
        for entry in scheduler_output.scheduled:
            request = entry.request
            end = entry.num_computed_before + entry.num_new_tokens - entry.num_spec_tokens
            start = request.spec.num_draft_computed_tokens
            if start >= end:
                continue
            segments.append(Segment(request, start, request.all_token_ids[start:end]))
            request.spec.num_draft_computed_tokens = end
            if entry.num_spec_tokens:
                request.spec.token_ids = []
                speculating.append((len(segments) - 1, request, entry.num_spec_tokens))
        if not segments:
            return {}
        logits = self._forward(segments, [index for index, _, _ in speculating])
        distributions: dict[str, list[torch.Tensor]] = {request.request_id: [] for _, request, _ in speculating}
        try:
            self._propose(logits, [request for _, request, _ in speculating], sampler, distributions)
            for step in range(1, max((wanted for _, _, wanted in speculating), default=0)):
                active = [request for _, request, wanted in speculating if wanted > step]
                segments = []
                for request in active:
                    position = request.spec.num_draft_computed_tokens
                    segments.append(Segment(request, position, [request.spec.token_ids[-1]]))
                    request.spec.num_draft_computed_tokens = position + 1
                logits = self._forward(segments, list(range(len(segments))))
                self._propose(logits, active, sampler, distributions)
        finally:  # the target verifies from the matchers' real state
            for _, request, _ in speculating:
                if request.structured_output is not None:
                    request.structured_output.rollback_drafts()

        return {request_id: torch.stack(probs) if probs else None for request_id, probs in distributions.items()}

    def _forward(self, segments: list[Segment], wanted: list[int]) -> torch.Tensor:
        """Run the draft on the segments; logits at the last token of each wanted segment."""
        input_ids, positions, layouts = build_batch(
            segments, self.block_size, self.device, long_rope_boundary=self.model.config.long_rope_boundary
        )
        hidden = self.model(input_ids, positions, self.forward_context(layouts))
        if not wanted:
            return hidden.new_empty(0, self.model.config.vocab_size)
        last_rows = layouts[0].query_start_loc[1:] - 1
        return self.model.compute_logits(hidden[last_rows[wanted]])

    @staticmethod
    def mask_to_grammar(logits: torch.Tensor, requests: list[Request]) -> None:
        """Constrained requests' draft logits masked by their grammars at the drafts' position
        (before penalties and temperature, as the target's)."""
        constrained = [i for i, request in enumerate(requests) if request.structured_output is not None]
        if not constrained:
            return
        bitmask = allocate_bitmask(len(constrained), logits.shape[-1])
        for position, i in enumerate(constrained):
            requests[i].structured_output.fill_mask(bitmask, position)
        apply_bitmask(logits, bitmask, torch.tensor(constrained, device=logits.device))

    def _propose(
        self,
        logits: torch.Tensor,
        requests: list[Request],
        sampler: Sampler,
        distributions: dict[str, list[torch.Tensor]],
    ) -> None:
        rows = [DraftedRow(request, request.spec.token_ids) for request in requests]
        self.mask_to_grammar(logits, requests)
        processed = sampler.process(logits, rows)
        for i, (request, row) in enumerate(zip(requests, rows)):
            if request.sampling_params.is_greedy:
                token = int(processed[i].argmax())
            else:
                probs = sampler.probabilities(processed[i : i + 1], [row])[0]
                token = sampler.draw(probs, row)
                distributions[request.request_id].append(probs)
            request.spec.token_ids.append(token)
            if request.structured_output is not None:
                request.structured_output.advance_draft(token)
