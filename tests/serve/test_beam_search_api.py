"""Beam search over HTTP: `use_beam_search` on completions (and chat) answers the n best beams
ordered by score, the same as the offline engine; a beam request is charged its width in
sequences; what beam search cannot do is a 400 in OpenAI's error shape."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagoda import LLM, SamplingParams
from pagoda.serve.admission.tenants import Tenant, TenantLimits, TenantRegistry
from pagoda.serve.api.protocol import ChatCompletionRequest, CompletionRequest
from server_utils import MODEL_NAME, LiveServer, build_tiny_model, start_server

PROMPT = "def fibonacci(n):\n    if n < 2:"
TENANTS = {"key-open": Tenant("open"), "key-capped": Tenant("capped", TenantLimits(max_concurrent_requests=4))}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server(model_dir: Path) -> Iterator[LiveServer]:
    live = start_server(model_dir, engine={"dtype": "float32"}, tenants=TenantRegistry(TENANTS))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def offline(model_dir: Path) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", num_threads=1, num_kv_blocks=256)


def post(server: LiveServer, path: str, key: str = "key-open", **body: Any) -> httpx.Response:
    return httpx.post(
        server.base_url + path,
        json={"model": MODEL_NAME, **body},
        timeout=60,
        headers={"Authorization": f"Bearer {key}"},
    )


def beams_body(**fields: Any) -> dict[str, Any]:
    return {"prompt": PROMPT, "use_beam_search": True, "max_tokens": 8, "return_token_ids": True, **fields}


def test_completions_answer_the_n_best_beams_ordered_by_score(server: LiveServer, offline: LLM) -> None:
    response = post(server, "/completions", **beams_body(n=3, logprobs=0, length_penalty=1.0))
    assert response.status_code == 200, response.text
    body = response.json()
    choices = body["choices"]
    assert [c["index"] for c in choices] == [0, 1, 2]
    # length_penalty 1: the score is the mean logprob of the beam's tokens
    scores = [sum(c["logprobs"]["token_logprobs"]) / len(c["token_ids"]) for c in choices]
    assert scores == sorted(scores, reverse=True)
    expected = offline.generate([PROMPT], SamplingParams(use_beam_search=True, n=3, max_tokens=8))[0]
    assert [c["token_ids"] for c in choices] == [s.token_ids for s in expected.outputs]
    assert [c["text"] for c in choices] == [s.text for s in expected.outputs]
    assert body["usage"]["completion_tokens"] == sum(len(c["token_ids"]) for c in choices)
    stats = server.wait_idle()
    assert stats.num_free_blocks == stats.num_total_blocks


def test_best_of_is_the_width_and_n_the_beams_returned(server: LiveServer) -> None:
    wide = post(server, "/completions", **beams_body(n=4)).json()["choices"]
    best_two = post(server, "/completions", **beams_body(n=2, best_of=4)).json()["choices"]
    assert [c["token_ids"] for c in best_two] == [c["token_ids"] for c in wide[:2]]


def test_streamed_beams_arrive_once_ranked(server: LiveServer) -> None:
    whole = post(server, "/completions", **beams_body(n=2)).json()["choices"]
    texts = {0: "", 1: ""}
    with httpx.stream(
        "POST",
        server.base_url + "/completions",
        timeout=60,
        headers={"Authorization": "Bearer key-open"},
        json={"model": MODEL_NAME, "stream": True, **beams_body(n=2)},
    ) as response:
        assert response.status_code == 200
        for line in response.iter_lines():
            if line.startswith("data: ") and line != "data: [DONE]":
                for choice in json.loads(line[6:])["choices"]:
                    texts[choice["index"]] += choice["text"]
    assert texts == {0: whole[0]["text"], 1: whole[1]["text"]}


def test_chat_beams(server: LiveServer) -> None:
    response = post(
        server,
        "/chat/completions",
        messages=[{"role": "user", "content": "Hi"}],
        use_beam_search=True,
        n=2,
        max_tokens=6,
        early_stopping=True,
    )
    assert response.status_code == 200, response.text
    assert [c["index"] for c in response.json()["choices"]] == [0, 1]


def test_a_beam_request_is_charged_its_width() -> None:
    assert CompletionRequest(prompt="x", n=2, best_of=6, use_beam_search=True).sequences_per_prompt == 6
    assert ChatCompletionRequest(messages=[], n=3, use_beam_search=True).sequences_per_prompt == 3
    assert SamplingParams(use_beam_search=True, n=2, best_of=6).num_sequences == 6


def test_a_beam_request_over_the_tenant_cap_is_refused(server: LiveServer) -> None:
    refused = post(server, "/completions", key="key-capped", **beams_body(n=1, best_of=6))
    assert refused.status_code == 400
    assert "6 sequences" in refused.json()["error"]["message"]
    assert post(server, "/completions", key="key-capped", **beams_body(n=2, best_of=4)).status_code == 200


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"n": 17}, "n"),
        ({"n": 2, "best_of": 1}, "best_of"),
        ({"stop": ["\n"]}, "stop"),
        ({"presence_penalty": 0.5}, "presence_penalty"),
        ({"response_format": {"type": "json_object"}}, "structured_outputs"),
        ({"echo": True, "logprobs": 1}, "prompt_logprobs"),
    ],
)
def test_what_beam_search_cannot_do_is_a_400(server: LiveServer, fields: dict[str, Any], param: str) -> None:
    response = post(server, "/completions", **beams_body(**fields))
    assert response.status_code == 400, response.text
    error = response.json()["error"]
    assert error["type"] == "invalid_request_error" and param in (error["param"] or "") + error["message"]


def test_malformed_beam_fields_are_400s(server: LiveServer) -> None:
    for fields in ({"early_stopping": "sometimes"}, {"length_penalty": "long"}, {"use_beam_search": "maybe"}):
        response = post(server, "/completions", **{**beams_body(), **fields})
        assert response.status_code == 400, response.text
        assert "error" in response.json()
    without_beams = post(server, "/completions", prompt=PROMPT, n=1, best_of=2)
    assert without_beams.status_code == 400 and without_beams.json()["error"]["param"] == "best_of"
