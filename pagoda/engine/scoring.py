"""Scoring and classification over a model's classifier head, as vLLM does them: what pairs a
score call makes, how a pair becomes one prompt, and how the head's logits become scores and
class probabilities. Used by the offline `LLM.score` / `LLM.classify` and by the server's
/v1/score, /v1/rerank and /classify (serve/api/scoring.py).

The engine computes the logits (a "classify" pooling request: the last token's final-norm
hidden state through the head, worker/pooling.py); everything here is on either side of it.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from pagoda.model.classifier_config import ClassifierConfig
from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer import Tokenizer


def classify_params() -> SamplingParams:
    """A scoring or classification request: the prefill's one token is computed and dropped."""
    return SamplingParams(temperature=0.0, max_tokens=1, pooling="classify")


def score_pairs(text_1: str | Sequence[str], text_2: str | Sequence[str]) -> list[tuple[str, str]]:
    """vLLM's pairing: one text_1 is scored against every text_2; lists are paired one to one
    (ValueError when their lengths differ or either is empty)."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    if not first or not second:
        raise ValueError("text_1 and text_2 must not be empty")
    if len(first) == 1:
        first = first * len(second)
    if len(first) != len(second):
        raise ValueError(
            f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text_1, or as many as text_2"
        )
    return list(zip(first, second))


def pair_prompt(
    tokenizer: Tokenizer, classifier: ClassifierConfig, text_1: str, text_2: str, max_length: int | None = None
) -> list[int]:
    """One pair as one prompt. A cross-encoder (a sequence-classification checkpoint) reads
    the tokenizer's text pair (its separators and special tokens); a causal LM read as a
    reranker reads the two texts joined as they are, formatted by the caller (Qwen3-Reranker's
    instruction prefix on the query, its suffix on the document), as vLLM does. `max_length`:
    cut by the tokenizer's truncation (the longer text first, for a pair), as vLLM's
    truncate_prompt_tokens does."""
    cut = {"truncation": True, "max_length": max_length} if max_length is not None else {}
    if classifier.from_tokens is None:
        return list(tokenizer.hf(text_1, text_pair=text_2, verbose=False, **cut)["input_ids"])
    return list(tokenizer.hf(text_1 + text_2, verbose=False, **cut)["input_ids"])


def pair_score(logits: Sequence[float], classifier: ClassifierConfig, activate: bool | None = None) -> float:
    """A pair's score from a one-label head: sigmoid of its logit, or the logit itself where the
    checkpoint's sentence-transformers config asks for no activation (`activate`, vLLM's
    use_activation, overrides the config)."""
    if len(logits) != 1:
        raise ValueError(f"scoring needs a one-label classifier; this model has {len(logits)} labels (use /classify)")
    return sigmoid(logits[0]) if (classifier.activate_scores if activate is None else activate) else float(logits[0])


def class_probs(logits: Sequence[float], activate: bool = True) -> list[float]:
    """Class probabilities: softmax over the labels, sigmoid of a one-label head's logit; the
    logits as they are without `activate`."""
    if not activate:
        return list(logits)
    if len(logits) == 1:
        return [sigmoid(logits[0])]
    top = max(logits)
    exps = [math.exp(x - top) for x in logits]
    total = sum(exps)
    return [e / total for e in exps]


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))
