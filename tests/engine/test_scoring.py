"""Scoring and classification (LLM.score, LLM.classify): the classifier head over the last
token equals transformers' within 1e-4, for `*ForSequenceClassification` checkpoints and for a
causal LM read as a yes/no reranker (--score-tokens, or vLLM's config keys)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

from model_factory import build_model
from pagoda import LLM, SamplingParams
from pagoda.errors import InvalidRequest

QUERIES = ["def fibonacci(n):", "import os"]
DOCUMENTS = ["    if n < 2:\n        return n", "The quick brown fox", "for i in range(10):\n    print(i * i)"]
TOLERANCE = 1e-4


def hf_classifier_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


def hf_yes_no_logit(model_dir: Path, ids: list[int], no: int, yes: int) -> float:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, -1]
    return (logits[yes] - logits[no]).item()


def engine(model_dir: Path, **kwargs) -> LLM:
    # A small token budget: the longer pairs are computed in more than one chunk.
    return LLM(model=str(model_dir), num_kv_blocks=32, max_num_batched_tokens=16, max_num_seqs=4, **kwargs)


@pytest.mark.parametrize("architecture", ["llama_classifier", "qwen3_classifier"])
def test_cross_encoder_scores_equal_transformers(tmp_path: Path, architecture: str) -> None:
    model_dir = build_model(tmp_path / architecture, architecture)
    llm = engine(model_dir)
    tokenizer = llm.get_tokenizer()
    outputs = llm.score(QUERIES[0], DOCUMENTS)
    assert len(outputs) == len(DOCUMENTS)
    for output, document in zip(outputs, DOCUMENTS):
        ids = tokenizer(QUERIES[0], text_pair=document)["input_ids"]
        assert output.prompt_token_ids == ids
        expected = torch.sigmoid(hf_classifier_logits(model_dir, ids)[0]).item()  # one label: sigmoid
        assert abs(output.outputs.score - expected) < TOLERANCE
    # Lists pair one to one.
    paired = llm.score(QUERIES, DOCUMENTS[:2])
    ids = tokenizer(QUERIES[1], text_pair=DOCUMENTS[1])["input_ids"]
    assert abs(paired[1].outputs.score - torch.sigmoid(hf_classifier_logits(model_dir, ids)[0]).item()) < TOLERANCE
    with pytest.raises(ValueError, match="text_1 has 2 texts"):
        llm.score(QUERIES, DOCUMENTS)


def test_scores_reuse_the_query_prefix(tmp_path: Path) -> None:
    # The query's blocks, cached by the first call, are hits for the second: only the last
    # position is read, and it is always computed.
    model_dir = build_model(tmp_path / "llama_classifier", "llama_classifier")
    llm = engine(model_dir)
    query = QUERIES[0] * 8  # 40 tokens: two full blocks of 16 shared by every pair
    first = [o.outputs.score for o in llm.score(query, DOCUMENTS)]
    scheduler = llm.engine.core.scheduler
    hits_before = scheduler.prefix_cache_hits
    second = llm.score(query, DOCUMENTS)
    assert scheduler.prefix_cache_hits - hits_before >= 2 * 16 * len(DOCUMENTS)
    ids = llm.get_tokenizer()(query, text_pair=DOCUMENTS[0])["input_ids"]
    expected = torch.sigmoid(hf_classifier_logits(model_dir, ids)[0]).item()
    assert abs(second[0].outputs.score - expected) < TOLERANCE
    assert [o.outputs.score for o in second] == pytest.approx(first, abs=TOLERANCE)


def test_classification_equals_transformers(tmp_path: Path) -> None:
    model_dir = build_model(tmp_path / "qwen2_classifier", "qwen2_classifier")
    # --max-num-seqs from its default: a model that never decodes has no decode step to calibrate.
    llm = LLM(model=str(model_dir), num_kv_blocks=32, max_num_batched_tokens=16, max_num_seqs_itl_ms=50.0)
    assert llm.engine.core.max_num_seqs_choice.itl_budget_ms is None
    tokenizer = llm.get_tokenizer()
    outputs = llm.classify(DOCUMENTS)
    for output, text in zip(outputs, DOCUMENTS):
        expected = torch.softmax(hf_classifier_logits(model_dir, tokenizer.encode(text)), -1)
        assert output.outputs.num_classes == 3
        assert torch.allclose(torch.tensor(output.outputs.probs), expected, atol=TOLERANCE, rtol=0)
    assert llm.engine.classifier.labels == ("negative", "neutral", "positive")
    # A sequence-classification checkpoint has no LM head: it does not generate.
    with pytest.raises(InvalidRequest, match="does not generate"):
        llm.generate(["hello"], SamplingParams(max_tokens=2))
    with pytest.raises(ValueError, match="one-label"):
        llm.score("a", "b")


@pytest.fixture(scope="module")
def reranker_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("reranker") / "qwen3", "qwen3")


def test_yes_no_reranker_from_score_tokens(reranker_dir: Path) -> None:
    llm = engine(reranker_dir, score_tokens="n,y")
    tokenizer = llm.get_tokenizer()
    no, yes = tokenizer.convert_tokens_to_ids(["n", "y"])
    outputs = llm.score(QUERIES[0], DOCUMENTS)
    for output, document in zip(outputs, DOCUMENTS):
        ids = tokenizer.encode(QUERIES[0] + document)  # the texts joined, formatted by the caller
        assert output.prompt_token_ids == ids
        expected = torch.sigmoid(torch.tensor(hf_yes_no_logit(reranker_dir, ids, no, yes))).item()
        assert abs(output.outputs.score - expected) < TOLERANCE
    # The LM head stays: it still generates.
    (generated,) = llm.generate(["import os"], SamplingParams(temperature=0.0, max_tokens=2))
    assert len(generated.outputs[0].token_ids) == 2


def test_yes_no_reranker_from_config_keys(reranker_dir: Path, tmp_path: Path) -> None:
    # vLLM's --hf-overrides for Qwen3-Reranker, written into config.json.
    model_dir = tmp_path / "reranker"
    shutil.copytree(reranker_dir, model_dir)
    config = json.loads((model_dir / "config.json").read_text())
    config.update(
        architectures=["Qwen3ForSequenceClassification"],
        classifier_from_token=["n", "y"],
        is_original_qwen3_reranker=True,
    )
    (model_dir / "config.json").write_text(json.dumps(config))
    llm = engine(model_dir)
    tokenizer = llm.get_tokenizer()
    no, yes = tokenizer.convert_tokens_to_ids(["n", "y"])
    (probs,) = llm.classify([QUERIES[1] + DOCUMENTS[2]])
    logit = hf_yes_no_logit(reranker_dir, tokenizer.encode(QUERIES[1] + DOCUMENTS[2]), no, yes)
    assert abs(probs.outputs.probs[0] - torch.sigmoid(torch.tensor(logit)).item()) < TOLERANCE
    del llm
    # Without is_original_qwen3_reranker: one label per token, softmax over their logits.
    config.pop("is_original_qwen3_reranker")
    (model_dir / "config.json").write_text(json.dumps(config))
    (two_labels,) = engine(model_dir).classify([QUERIES[1] + DOCUMENTS[2]])
    assert two_labels.outputs.probs == pytest.approx(
        torch.softmax(torch.tensor([0.0, logit]), -1).tolist(), abs=TOLERANCE
    )


def test_unknown_score_token_is_refused(reranker_dir: Path, tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="not in the tokenizer"):
        engine(reranker_dir, score_tokens="no-such-token,y")
    with pytest.raises(ValueError, match="its own classifier"):
        engine(build_model(tmp_path / "classifier", "llama_classifier"), score_tokens="n,y")


def test_a_plain_lm_does_not_score(llama_dir: Path) -> None:
    llm = engine(llama_dir)
    with pytest.raises(ValueError, match="no classifier head"):
        llm.score("a", "b")
    with pytest.raises(InvalidRequest, match="no classifier head"):
        llm.generate(["hello"], SamplingParams(max_tokens=1, pooling="classify"))
