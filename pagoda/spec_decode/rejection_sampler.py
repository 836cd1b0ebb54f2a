"""Verify drafted tokens against the target model in one forward.

Greedy requests accept a draft while it equals the target's argmax, so output is identical
to decoding without speculation. Sampled requests use rejection sampling: accept draft d with
probability min(1, p(d) / q(d)); on rejection draw from the residual max(p - q, 0); if all are
accepted draw one more token from the target. The emitted tokens are then distributed exactly
as the target's sampling distribution p — after the request's penalties, temperature, top-k,
top-p and min-p, which are applied to both p and q. A deterministic proposer (n-gram) has q
equal to a point mass on its draft.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagoda.request import Request
from pagoda.worker.sampler import DraftedRow, Sampler


@dataclass
class Verification:
    token_ids: list[int]  # accepted drafts, then one token from the target
    num_accepted: int


def verify(
    sampler: Sampler, logits: torch.Tensor, request: Request, drafts: list[int], draft_probs: torch.Tensor | None
) -> Verification:
    """logits [K + 1, V]: the target's logits at the last real token and at each draft.
    draft_probs [K, V]: the draft model's (processed) distributions, None for point masses."""
    num_drafts = len(drafts)
    rows = [DraftedRow(request, drafts[:i]) for i in range(num_drafts + 1)]
    processed = sampler.process(logits, rows)
    if request.sampling_params.is_greedy:
        targets = processed.argmax(dim=-1).tolist()
        accepted = 0
        while accepted < num_drafts and drafts[accepted] == targets[accepted]:
            accepted += 1
        return Verification(drafts[:accepted] + [targets[accepted]], accepted)

    probs = sampler.probabilities(processed, rows)
    for i, draft in enumerate(drafts):
        p = probs[i]
        q_draft = float(draft_probs[i, draft]) if draft_probs is not None else 1.0
        if sampler.uniform(rows[i]) < min(1.0, float(p[draft]) / q_draft):
            continue
        q = draft_probs[i] if draft_probs is not None else _point_mass(p, draft)
        token = sampler.draw(residual_distribution(p, q), rows[i])
        return Verification(drafts[:i] + [token], i)
    return Verification(list(drafts) + [sampler.draw(probs[num_drafts], rows[num_drafts])], num_drafts)


def residual_distribution(p: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """What to draw from after rejecting a draft: norm(max(p - q, 0)). Together with the
    acceptance probability min(1, p/q) this makes every emitted token distributed as p."""
    residual = (p - q).clamp_min(0.0)
    total = float(residual.sum())
    return residual / total if total > 0 else p


def _point_mass(like: torch.Tensor, token: int) -> torch.Tensor:
    mass = torch.zeros_like(like)
    mass[token] = 1.0
    return mass
