"""A sequence classifier on the decoder: a linear head over the last token's final-norm hidden
state (what /v1/score, /v1/rerank and /classify run; pagoda/worker/pooling.py applies it).

Two kinds of checkpoints have one:
- `*ForSequenceClassification`: the checkpoint's `score.weight` [num_labels, hidden], its labels
  from `id2label`. Such a checkpoint has no LM head: the model scores and classifies only.
- a causal LM read as a reranker by two of its tokens (Qwen3-Reranker's style, vLLM's
  `classifier_from_token` with `is_original_qwen3_reranker`, or pagoda's `--score-tokens no,yes`):
  one label whose weight is the LM head's "true" row minus its "false" row, so that
  sigmoid(logit) = softmax(logit_false, logit_true)[true]; `classifier_from_token` without that
  flag makes one label per token, its row as it is. The LM head stays: it still generates.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pagoda.model.classifier_config import ClassifierConfig


class ClassifierHead(nn.Module):
    """The classifier's weight [num_labels, hidden], named `score` on the model as the
    checkpoints name it; replicated on every tensor-parallel rank (the hidden states it reads
    are whole). Logits come out in float32."""

    def __init__(self, config: ClassifierConfig, hidden_size: int, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.config = config
        self.weight = nn.Parameter(
            torch.empty(config.num_labels, hidden_size, dtype=dtype, device=device), requires_grad=False
        )

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return F.linear(hidden.float(), self.weight.float())

    def fill_from_head(self, head: torch.Tensor) -> None:
        """The weight from the LM head's (or tied embedding's) full [vocab, hidden] matrix: the
        tokens' rows, or for a two-way head the true token's row minus the false token's
        (computed in float32)."""
        assert self.config.token_ids is not None
        rows = head.float()[list(self.config.token_ids)]
        weight = (rows[1] - rows[0]).unsqueeze(0) if self.config.two_way else rows
        self.weight.data.copy_(weight.to(self.weight.dtype))
