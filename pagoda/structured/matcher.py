"""The per-request grammar state: advances with each accepted token, rolls back drafts."""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import torch


class RequestMatcher:
    """One sample's position in its grammar.

    Preemption needs nothing here: a preempted request keeps its output tokens (only their KV
    is recomputed), so the matcher's state stays valid. Speculative drafts are checked before
    they are verified: n-gram drafts are cut at the first token the grammar rejects
    (`grammar_prefix`); a draft model samples under the grammar, each draft advancing the
    matcher tentatively (`advance_draft`) until the drafts are rolled back (`rollback_drafts`)
    before verification, whose accepted tokens then advance it for real (`accept`).
    """

    __slots__ = ("matcher", "kind", "num_accepted", "failed", "executor", "num_drafted")

    def __init__(self, matcher: llguidance.LLMatcher, kind: str, executor: llguidance.LLExecutor | None = None) -> None:
        self.matcher = matcher
        self.kind = kind
        self.num_accepted = 0
        self.failed = False
        self.executor = executor  # shared thread pool that fills many rows' masks at once
        self.num_drafted = 0  # draft tokens consumed tentatively, rolled back before verification

    def accept(self, token_ids: Sequence[int]) -> int:
        """Advance over sampled tokens, stopping at the grammar's end or at a token it rejects
        (possible only when something outside the grammar, e.g. min_tokens, overrode the
        mask). Returns how many tokens were consumed."""
        consumed = 0
        if self.failed:  # its row was not masked: whatever was sampled there is not kept
            return 0
        for token_id in token_ids:
            if self.is_terminated:
                break
            try:
                ok = self.matcher.consume_token(int(token_id))
            except (RuntimeError, ValueError):
                ok = False
            if not ok:
                self.failed = True
                break
            consumed += 1
        self.num_accepted += consumed
        return consumed

    def grammar_prefix(self, drafts: Sequence[int]) -> int:
        """How many leading `drafts` the grammar accepts from the current state (unchanged).
        A failed matcher constrains nothing, so every draft stands."""
        if self.failed or not drafts:
            return len(drafts)
        try:
            return self.matcher.validate_tokens([int(t) for t in drafts])
        except (RuntimeError, ValueError):
            return 0

    def advance_draft(self, token_id: int) -> bool:
        """Consume one draft tentatively (the next draft's mask depends on it). False when the
        grammar rejects it or has ended: drafting under the grammar stops there."""
        if self.failed or self.is_terminated or self.matcher.try_consume_tokens([int(token_id)]) != 1:
            return False
        self.num_drafted += 1
        return True

    def rollback_drafts(self) -> None:
        if self.num_drafted:
            self.matcher.rollback(self.num_drafted)
            self.num_drafted = 0

    @property
    def is_terminated(self) -> bool:
        """The grammar is complete and admits nothing more (EOS aside): the request is done."""
        return self.matcher.is_stopped()

    @property
    def is_accepting(self) -> bool:
        return self.matcher.is_accepting()

    def fill_mask(self, bitmask: torch.Tensor, row: int) -> None:
        """Write the allowed-token bits for the current position into bitmask[row] (int32, CPU).

        A matcher in error (e.g. llguidance's per-step limits on a pathological grammar) marks
        the request failed and leaves its row all-allowed, so the batch samples normally; the
        engine stops the request after this step."""
        target = bitmask[row]
        try:
            self.matcher.unsafe_compute_mask_ptr(target.data_ptr(), target.numel() * target.element_size())
        except (RuntimeError, ValueError):
            self.failed = True
        if self.failed or self.matcher.is_error():
            self.failed = True
            target.fill_(-1)

    def check_filled(self, bitmask: torch.Tensor, row: int) -> None:
        """After a batched fill: the same error handling as fill_mask."""
        if self.failed or self.matcher.is_error():
            self.failed = True
            bitmask[row].fill_(-1)

    def fill_draft_masks(self, bitmask: torch.Tensor, first_row: int, drafts: Sequence[int]) -> None:
        """Masks for the positions of a speculative step: the current one, then after each draft.
        A draft the grammar rejects ends the chain (its row and later ones repeat the last valid
        mask: the verifier rejects that draft anyway, since its masked probability is zero)."""
        consumed = 0
        self.fill_mask(bitmask, first_row)
        if self.failed:
            bitmask[first_row : first_row + len(drafts) + 1] = -1
            return
        for i, draft in enumerate(drafts):
            row = first_row + i + 1
            if consumed == i and self.matcher.try_consume_tokens([int(draft)]) == 1:
                consumed += 1
                self.fill_mask(bitmask, row)
            else:
                bitmask[row] = bitmask[row - 1]
        if consumed:
            self.matcher.rollback(consumed)
