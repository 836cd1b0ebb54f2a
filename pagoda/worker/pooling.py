"""Pooling a prompt's hidden states into one vector: an embedding (/v1/embeddings) or a
classifier's logits (/v1/score, /v1/rerank, /classify).

A pooling request is an ordinary prefill: its prompt is computed in the same batches as every
other request's, chunk by chunk, and the final-norm hidden states of its rows are pooled here
as they go by ("mean" keeps a running sum on the request, "last" takes the prompt's last row,
"classify" puts the last row through the model's classifier head, pagoda/model/classifier.py).
The vector is ready in the step that computes the prompt's last token.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch

POOLING_METHODS = ("last", "mean", "classify")

Classifier = Callable[[torch.Tensor], torch.Tensor]  # final-norm hidden states -> float32 logits


def pool_prompts(
    scheduled: Sequence, hidden: torch.Tensor, query_starts: list[int], classifier: Classifier | None = None
) -> dict[str, list[float]]:
    """request id -> pooled vector, for each pooling request whose prompt finished in this step.
    `scheduled`: the step's entries; `hidden` [tokens, hidden]: the forward's final-norm
    states, rows laid out by `query_starts`; `classifier`: the model's head for "classify"
    (the engine refuses such requests for a model without one)."""
    pooled: dict[str, list[float]] = {}
    for index, entry in enumerate(scheduled):
        request = entry.request
        method = request.sampling_params.pooling
        if method is None:
            continue
        begin = entry.num_computed_before
        num_real = entry.num_new_tokens - entry.num_spec_tokens
        rows = hidden[query_starts[index] : query_starts[index] + num_real].float()
        if method == "mean":
            # A recomputed prompt (after a preemption) starts its sum again.
            partial = rows.sum(dim=0)
            request.pooled_sum = partial if begin == 0 or request.pooled_sum is None else request.pooled_sum + partial
        if begin + num_real < request.num_prompt_tokens:
            continue
        if method == "mean":
            vector = request.pooled_sum / request.num_prompt_tokens
        elif method == "classify":
            assert classifier is not None
            vector = classifier(rows[-1])
        else:
            vector = rows[-1]
        request.pooled_sum = None
        pooled[request.request_id] = vector.cpu().tolist()
    return pooled
