"""/v1/score, /v1/rerank (Cohere's and Jina's bodies, under /rerank, /v1/rerank and /v2/rerank) and
/classify through the server, in vLLM's shapes, against transformers' classifier logits."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest
import torch

from model_factory import build_model
from server_utils import MODEL_NAME, LiveServer, start_server

QUERY = "def fibonacci(n):"
DOCUMENTS = ["    if n < 2:\n        return n", "The quick brown fox", "import os\nimport sys", "hello"]
TOLERANCE = 1e-4


def hf_logits(model_dir: Path, ids: list[int]) -> torch.Tensor:
    from transformers import AutoModelForSequenceClassification

    model = AutoModelForSequenceClassification.from_pretrained(model_dir, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(torch.tensor([ids])).logits[0]


@pytest.fixture(scope="module")
def cross_encoder_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("cross-encoder") / "model", "llama_classifier")


@pytest.fixture(scope="module")
def cross_encoder(cross_encoder_dir: Path) -> LiveServer:
    live = start_server(cross_encoder_dir, engine={"num_kv_blocks": 64, "max_num_seqs": 8})
    yield live
    live.stop()


@pytest.fixture(scope="module")
def expected_scores(cross_encoder_dir: Path, cross_encoder: LiveServer) -> list[float]:
    tokenizer = cross_encoder.llm.tokenizer.hf
    return [
        torch.sigmoid(hf_logits(cross_encoder_dir, tokenizer(QUERY, text_pair=d)["input_ids"])[0]).item()
        for d in DOCUMENTS
    ]


def post(server: LiveServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL_NAME, **body}, timeout=60)


def test_score_equals_transformers(cross_encoder: LiveServer, expected_scores: list[float]) -> None:
    for path in ("/v1/score", "/score"):
        response = post(cross_encoder, path, {"text_1": QUERY, "text_2": DOCUMENTS})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["object"] == "list" and body["model"] == MODEL_NAME
        assert [d["index"] for d in body["data"]] == list(range(len(DOCUMENTS)))
        assert all(d["object"] == "score" for d in body["data"])
        assert [d["score"] for d in body["data"]] == pytest.approx(expected_scores, abs=TOLERANCE)
        assert body["usage"]["prompt_tokens"] == body["usage"]["total_tokens"] > 0
    paired = post(cross_encoder, "/v1/score", {"text_1": [QUERY, QUERY], "text_2": DOCUMENTS[2:]}).json()
    assert [d["score"] for d in paired["data"]] == pytest.approx(expected_scores[2:], abs=TOLERANCE)
    mismatched = post(cross_encoder, "/v1/score", {"text_1": [QUERY, QUERY], "text_2": DOCUMENTS})
    assert mismatched.status_code == 400 and mismatched.json()["error"]["param"] == "text_2"
    stats = cross_encoder.stats()
    assert stats.num_free_blocks == stats.num_total_blocks  # no KV is kept


@pytest.mark.parametrize("path", ["/v1/rerank", "/rerank", "/v2/rerank"])
def test_rerank_sorts_documents_by_score(cross_encoder: LiveServer, expected_scores: list[float], path: str) -> None:
    # Jina's and Cohere's documents: strings, or objects with `text`.
    documents = [DOCUMENTS[0], {"text": DOCUMENTS[1]}, *DOCUMENTS[2:]]
    response = post(cross_encoder, path, {"query": QUERY, "documents": documents, "top_n": 3})
    assert response.status_code == 200, response.text
    body = response.json()
    best_first = sorted(range(len(DOCUMENTS)), key=lambda i: -expected_scores[i])[:3]
    assert [r["index"] for r in body["results"]] == best_first
    for result in body["results"]:
        assert result["relevance_score"] == pytest.approx(expected_scores[result["index"]], abs=TOLERANCE)
        assert result["document"] == {"text": DOCUMENTS[result["index"]]}
    assert body["model"] == MODEL_NAME and body["usage"]["total_tokens"] > 0
    bare = post(cross_encoder, path, {"query": QUERY, "documents": DOCUMENTS, "return_documents": False}).json()
    assert len(bare["results"]) == len(DOCUMENTS) and all("document" not in r for r in bare["results"])


@pytest.mark.parametrize(
    "body, param, code",
    [
        ({"query": QUERY, "documents": []}, "documents", None),
        ({"query": QUERY, "documents": DOCUMENTS, "top_n": -1}, "top_n", None),
        ({"query": QUERY, "documents": DOCUMENTS, "rank_fields": ["title"]}, "rank_fields", "unsupported_field"),
        ({"query": QUERY, "documents": DOCUMENTS, "truncate_prompt_tokens": 0}, "truncate_prompt_tokens", None),
    ],
)
def test_rerank_refusals_name_the_field(cross_encoder: LiveServer, body: dict, param: str, code: str | None) -> None:
    response = post(cross_encoder, "/v1/rerank", body)
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["param"] == param and (code is None or error["code"] == code)


def test_use_activation_false_answers_logits(
    cross_encoder_dir: Path, cross_encoder: LiveServer, expected_scores: list[float]
) -> None:
    raw = post(cross_encoder, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS, "use_activation": False}).json()
    logits = torch.tensor([d["score"] for d in raw["data"]])
    assert torch.sigmoid(logits).tolist() == pytest.approx(expected_scores, abs=TOLERANCE)
    (item,) = post(cross_encoder, "/classify", {"input": QUERY, "use_activation": False}).json()["data"]
    logit = hf_logits(cross_encoder_dir, cross_encoder.llm.tokenizer.encode(QUERY))[0].item()
    assert item["probs"] == pytest.approx([logit], abs=TOLERANCE)


def test_truncation_cuts_the_pair(cross_encoder: LiveServer) -> None:
    body = post(
        cross_encoder, "/v1/score", {"text_1": QUERY, "text_2": DOCUMENTS[0], "truncate_prompt_tokens": 4}
    ).json()
    assert body["usage"]["prompt_tokens"] == 4


def test_one_label_classify_and_no_generation(cross_encoder: LiveServer, expected_scores: list[float]) -> None:
    tokens = cross_encoder.llm.tokenizer.encode(DOCUMENTS[1])
    body = post(cross_encoder, "/classify", {"input": [tokens]}).json()
    (item,) = body["data"]
    assert item["num_classes"] == 1 and item["label"] == "LABEL_0" and 0 < item["probs"][0] < 1
    refused = post(cross_encoder, "/v1/completions", {"prompt": "hello", "max_tokens": 2})
    assert refused.status_code == 400 and "does not generate" in refused.json()["error"]["message"]


def test_classify_equals_transformers(tmp_path: Path) -> None:
    model_dir = build_model(tmp_path / "classifier", "qwen2_classifier")
    live = start_server(model_dir, engine={"num_kv_blocks": 64, "max_num_seqs": 8})
    try:
        response = post(live, "/classify", {"input": DOCUMENTS})
        assert response.status_code == 200, response.text
        body = response.json()
        assert body["object"] == "list" and [d["index"] for d in body["data"]] == list(range(len(DOCUMENTS)))
        labels = ["negative", "neutral", "positive"]
        for item, text in zip(body["data"], DOCUMENTS):
            probs = torch.softmax(hf_logits(model_dir, live.llm.tokenizer.encode(text)), -1)
            assert item["probs"] == pytest.approx(probs.tolist(), abs=TOLERANCE)
            assert item["num_classes"] == 3 and item["label"] == labels[int(probs.argmax())]
        # Scores need one label.
        refused = post(live, "/v1/rerank", {"query": QUERY, "documents": DOCUMENTS})
        assert refused.status_code == 400 and "one-label" in refused.json()["error"]["message"]
    finally:
        live.stop()


def test_invocations_dispatch_score_and_rerank(cross_encoder: LiveServer, expected_scores: list[float]) -> None:
    score = post(cross_encoder, "/invocations", {"text_1": QUERY, "text_2": DOCUMENTS[0]}).json()
    assert score["data"][0]["score"] == pytest.approx(expected_scores[0], abs=TOLERANCE)
    rerank = post(cross_encoder, "/invocations", {"query": QUERY, "documents": DOCUMENTS[:2]}).json()
    assert len(rerank["results"]) == 2


def test_openapi_documents_the_bodies(cross_encoder: LiveServer) -> None:
    paths = httpx.get(cross_encoder.url + "/openapi.json", timeout=30).json()["paths"]
    for path in ("/v1/score", "/v1/rerank", "/v2/rerank", "/classify"):
        assert "requestBody" in paths[path]["post"]


@pytest.mark.parametrize(
    "path, body",
    [
        ("/v1/rerank", {"query": "", "documents": [""]}),
        ("/v1/score", {"text_1": [], "text_2": "x"}),
        ("/v1/score", {"text_1": "x", "text_2": []}),
        ("/v1/score", {"text_1": "x", "text_2": "y", "truncate_prompt_tokens": 10**9}),
        ("/classify", {"input": []}),
        ("/classify", {"input": ""}),
        ("/classify", {"input": [10**9]}),
    ],
)
def test_bad_bodies_are_400s(cross_encoder: LiveServer, path: str, body: dict) -> None:
    response = post(cross_encoder, path, body)
    assert response.status_code == 400, response.text
