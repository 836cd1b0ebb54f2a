"""POST /v1/embeddings as the `openai` client sees it, against transformers' last hidden state."""

from __future__ import annotations

import base64
import json
import struct

import httpx
import openai
import pytest
import torch

from pagoda.serve.api.embeddings import model_pooling
from server_utils import MODEL_NAME, LiveServer, build_tiny_model, start_server

TEXTS = ["def fibonacci(n):", "import os\nimport sys", "hello"]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server(model_dir) -> LiveServer:
    live = start_server(model_dir, engine={"max_num_batched_tokens": 8}, pooling="mean")
    yield live
    live.stop()


@pytest.fixture(scope="module")
def expected(model_dir, server: LiveServer) -> list[torch.Tensor]:
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    tokenizer = server.llm.tokenizer
    with torch.no_grad():
        states = [model.model(torch.tensor([tokenizer.encode(t)])).last_hidden_state[0] for t in TEXTS]
    return [s.mean(dim=0) for s in states]


def test_embeddings_equal_transformers(server: LiveServer, expected: list[torch.Tensor]) -> None:
    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=60)
    result = client.embeddings.create(model=MODEL_NAME, input=TEXTS, encoding_format="float")
    assert [d.index for d in result.data] == [0, 1, 2]
    for item, want in zip(result.data, expected):
        assert torch.allclose(torch.tensor(item.embedding), torch.nn.functional.normalize(want, dim=0), atol=1e-4)
    assert result.usage.prompt_tokens == result.usage.total_tokens > 0
    decoded = client.embeddings.create(model=MODEL_NAME, input=TEXTS[0])  # the SDK asks for base64
    assert decoded.data[0].embedding == pytest.approx(result.data[0].embedding, abs=1e-6)
    stats = server.stats()
    assert stats.num_free_blocks == stats.num_total_blocks  # no KV is kept


def post(server: LiveServer, body: dict) -> httpx.Response:
    return httpx.post(server.url + "/v1/embeddings", json={"model": MODEL_NAME, **body}, timeout=60)


def test_raw_dimensions_base64_and_token_ids(server: LiveServer, expected: list[torch.Tensor]) -> None:
    raw = post(server, {"input": TEXTS[0], "normalize": False}).json()["data"][0]["embedding"]
    assert torch.allclose(torch.tensor(raw), expected[0], atol=1e-4)
    cut = post(server, {"input": TEXTS[0], "dimensions": 8, "encoding_format": "base64"}).json()
    vector = struct.unpack("<8f", base64.b64decode(cut["data"][0]["embedding"]))
    want = torch.nn.functional.normalize(expected[0][:8], dim=0)
    assert torch.allclose(torch.tensor(vector), want, atol=1e-4)
    tokens = server.llm.tokenizer.encode(TEXTS[0])
    by_ids = post(server, {"input": [tokens, tokens], "normalize": False}).json()["data"]
    assert len(by_ids) == 2 and by_ids[1]["embedding"] == pytest.approx(raw, abs=1e-5)


def test_invocations_dispatch_embeddings(server: LiveServer) -> None:
    response = httpx.post(server.url + "/invocations", json={"input": "hello"}, timeout=60)
    assert response.status_code == 200 and response.json()["data"][0]["object"] == "embedding"


@pytest.mark.parametrize(
    "body, param",
    [
        ({"input": ""}, "input"),
        ({"input": []}, "input"),
        ({"input": [10**7]}, "input"),
        ({"input": "x", "dimensions": 0}, "dimensions"),
        ({"input": "x", "dimensions": 10**6}, "dimensions"),
        ({"input": "x", "encoding_format": "int8"}, "encoding_format"),
        ({"input": 5}, "input"),
        ({"input": "x", "truncate_prompt_tokens": 0}, "truncate_prompt_tokens"),
    ],
)
def test_bad_input_is_a_400(server: LiveServer, body: dict, param: str) -> None:
    response = post(server, body)
    assert response.status_code == 400, response.text
    assert param in (response.json()["error"]["param"] or "")


def test_pooling_from_sentence_transformers_config(tmp_path) -> None:
    assert model_pooling(str(tmp_path)) is None
    (tmp_path / "1_Pooling").mkdir()
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_mean_tokens": True}))
    (tmp_path / "modules.json").write_text(
        json.dumps([{"idx": 1, "name": "1", "path": "1_Pooling", "type": "sentence_transformers.models.Pooling"}])
    )
    assert model_pooling(str(tmp_path)) == "mean"
    (tmp_path / "1_Pooling" / "config.json").write_text(json.dumps({"pooling_mode_lasttoken": True}))
    assert model_pooling(str(tmp_path)) == "last"
