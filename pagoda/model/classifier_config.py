"""ClassifierConfig: a sequence classifier's labels and where its head comes from, read from
config.json or from --score-tokens (the head itself: pagoda/model/classifier.py)."""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

# A sentence-transformers cross-encoder's activation, as its config names it.
_IDENTITY_ACTIVATIONS = ("torch.nn.modules.linear.Identity", "torch.nn.Identity")


@dataclass(frozen=True)
class ClassifierConfig:
    num_labels: int
    labels: tuple[str, ...]  # one name per label (config.json's id2label; LABEL_i where it names none)
    # LM-head tokens whose rows make the head (a causal LM read as a classifier); None: the
    # checkpoint's own head.
    from_tokens: tuple[str, ...] | None = None
    two_way: bool = False  # from_tokens is (false, true): one label, the true row minus the false row
    token_ids: tuple[int, ...] | None = None  # from_tokens' ids, resolved by the tokenizer at load
    # A score's activation: sigmoid for one label (softmax over several), as vLLM's cross-encoders;
    # False where the checkpoint's sentence-transformers config names Identity.
    activate_scores: bool = True

    @property
    def generates(self) -> bool:
        """Whether the model keeps its LM head (a reranker read from tokens does)."""
        return self.from_tokens is not None

    def with_token_ids(self, token_ids: tuple[int, ...]) -> ClassifierConfig:
        return replace(self, token_ids=token_ids)


def read_classifier(config: dict[str, Any], sequence_classifier: bool) -> ClassifierConfig | None:
    """The classifier a config.json declares: a sequence-classification architecture's head, or
    vLLM's `classifier_from_token` keys on a causal LM; None for a plain LM."""
    tokens = config.get("classifier_from_token")
    if tokens is not None:
        two_way = bool(config.get("is_original_qwen3_reranker")) or config.get("method") == "from_2_way_softmax"
        return token_classifier(tokens, "classifier_from_token", two_way)
    if not sequence_classifier:
        return None
    id2label = config.get("id2label") or {}
    num_labels = int(config.get("num_labels") or len(id2label) or 2)
    labels = tuple(str(id2label.get(str(i), id2label.get(i, f"LABEL_{i}"))) for i in range(num_labels))
    sentence_transformers = config.get("sentence_transformers") or {}
    activation = sentence_transformers.get("activation_fn") or config.get("sbert_ce_default_activation_function")
    return ClassifierConfig(num_labels, labels, activate_scores=activation not in _IDENTITY_ACTIVATIONS)


def token_classifier(tokens: Any, source: str, two_way: bool = True) -> ClassifierConfig:
    """A classifier from LM-head rows. two_way (Qwen3-Reranker's): two tokens, false then true
    (e.g. no,yes), make one label, their difference; otherwise one label per token, its row as
    it is (vLLM's `classifier_from_token` without a method)."""
    if isinstance(tokens, str):
        tokens = [t.strip() for t in tokens.split(",")]
    if not isinstance(tokens, (list, tuple)) or not tokens or not all(isinstance(t, str) and t for t in tokens):
        raise ValueError(f"{source}: give the tokens as a list (e.g. no,yes), got {tokens!r}")
    if two_way and len(tokens) != 2:
        raise ValueError(f"{source}: a yes/no reranker takes two tokens, false then true (e.g. no,yes), got {tokens!r}")
    if two_way:
        return ClassifierConfig(1, ("score",), from_tokens=tuple(tokens), two_way=True)
    return ClassifierConfig(len(tokens), tuple(tokens), from_tokens=tuple(tokens))
