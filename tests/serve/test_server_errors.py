"""Client mistakes get OpenAI-shaped 4xx answers, never a 500."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from server_utils import MODEL_NAME, LiveServer, build_tiny_model, start_server

MAX_REQUEST_BYTES = 64 * 1024


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    live = start_server(build_tiny_model(tmp_path_factory.mktemp("model")), max_request_bytes=MAX_REQUEST_BYTES)
    yield live
    live.stop()


@pytest.fixture(scope="module")
def http(server: LiveServer) -> httpx.Client:
    with httpx.Client(base_url=server.url, timeout=30) as client:
        yield client


def assert_error(response: httpx.Response, status: int, param: str | None = None) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert isinstance(error["message"], str) and error["message"]
    if param is not None:
        assert error["param"] == param, error
    return error


def completion(http: httpx.Client, **fields: Any) -> httpx.Response:
    return http.post("/v1/completions", json={"model": MODEL_NAME, "prompt": "hello", "max_tokens": 2, **fields})


def chat(http: httpx.Client, **fields: Any) -> httpx.Response:
    body = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, **fields}
    return http.post("/v1/chat/completions", json=body)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"temperature": -1}, "temperature"),
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"logprobs": 50}, "logprobs"),
        ({"presence_penalty": 3}, "presence_penalty"),
        ({"top_k": -5}, "top_k"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"max_tokens": "many"}, "max_tokens"),
        ({"temperature": "hot"}, "temperature"),
        ({"stop": 5}, "stop"),
        ({"prompt": ""}, "prompt"),
        ({"prompt": []}, "prompt"),
        ({"prompt": [[]]}, "prompt"),
        ({"prompt": [1, -2]}, "prompt"),
        ({"prompt": [1, 10**6]}, "prompt"),
        ({"prompt": {"text": "x"}}, "prompt"),
        ({"logit_bias": {"abc": 1}}, "logit_bias"),
        ({"logit_bias": {"999999": 1}}, "logit_bias"),
        ({"stop_token_ids": [-1]}, "stop_token_ids"),
        ({"suffix": "end"}, "suffix"),
        ({"best_of": 3}, "best_of"),
        ({"stream_options": {"include_usage": True}}, "stream_options"),
    ],
)
def test_invalid_completion_parameters(http: httpx.Client, fields: dict, param: str) -> None:
    assert_error(completion(http, **fields), 400, param)


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"messages": []}, "messages"),
        ({"messages": [{"role": "wizard", "content": "hi"}]}, "messages"),
        (
            {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {}}]}]},
            "messages[0].content[0]",
        ),
        ({"messages": "hi"}, "messages"),
        ({"tools": [{"type": "function", "function": {"name": "f"}}]}, "tools"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"response_format": {"type": "xml"}}, "response_format"),
        ({"top_logprobs": 2}, "top_logprobs"),
        ({"logprobs": True, "top_logprobs": 99}, "logprobs"),
        ({"max_completion_tokens": 0}, "max_tokens"),
    ],
)
def test_invalid_chat_parameters(http: httpx.Client, fields: dict, param: str) -> None:
    assert_error(chat(http, **fields), 400, param)


def test_context_length_states_both_numbers(http: httpx.Client) -> None:
    error = assert_error(completion(http, prompt=[5] * 100, max_tokens=500), 400, "max_tokens")
    assert "512" in error["message"] and "600" in error["message"]
    error = assert_error(chat(http, max_completion_tokens=600), 400, "max_completion_tokens")
    assert "512" in error["message"]


@pytest.mark.parametrize("content", [b"{not json", b'{"prompt": "\xff\xfe"}', b"[1, 2]", b"", b'"just a string"'])
def test_malformed_bodies(http: httpx.Client, content: bytes) -> None:
    response = http.post("/v1/completions", content=content, headers={"content-type": "application/json"})
    assert_error(response, 400)


def test_missing_prompt_and_unknown_model(http: httpx.Client) -> None:
    assert_error(http.post("/v1/completions", json={"model": MODEL_NAME}), 400, "prompt")
    error = assert_error(completion(http, model="gpt-4"), 404, "model")
    assert error["code"] == "model_not_found"
    assert_error(chat(http, model="gpt-4"), 404, "model")
    assert_error(http.post("/tokenize", json={"model": "gpt-4", "prompt": "x"}), 404)


def test_body_too_large(http: httpx.Client) -> None:
    assert_error(completion(http, prompt="a " * MAX_REQUEST_BYTES), 413)

    def chunks():  # no Content-Length: the limit must hold for chunked uploads too
        yield b'{"prompt": "'
        for _ in range(MAX_REQUEST_BYTES // 1024 + 1):
            yield b"a" * 1024
        yield b'"}'

    response = http.post("/v1/completions", content=chunks(), headers={"content-type": "application/json"})
    assert_error(response, 413)


def test_tokenize_errors(http: httpx.Client) -> None:
    assert_error(http.post("/tokenize", json={}), 400)
    assert_error(http.post("/detokenize", json={"tokens": [10**6]}), 400, "tokens")
    assert_error(http.post("/detokenize", json={"tokens": "abc"}), 400, "tokens")


def test_unknown_routes_and_methods(http: httpx.Client) -> None:
    assert_error(http.get("/v1/nothing"), 404)
    assert_error(http.get("/v1/completions"), 405)


def test_batch_with_one_bad_prompt_leaves_nothing_running(http: httpx.Client, server: LiveServer) -> None:
    before = server.wait_idle().num_generation_tokens
    response = completion(http, prompt=[[1, 2, 3], [1, 10**6]], max_tokens=400, ignore_eos=True)
    assert_error(response, 400, "prompt")
    stats = server.wait_idle()
    assert stats.num_running == 0 and stats.num_free_blocks == stats.num_total_blocks
    # The valid first prompt was aborted, not left to generate its 400 tokens.
    assert stats.num_generation_tokens - before < 400


def test_still_serving_after_errors(http: httpx.Client, server: LiveServer) -> None:
    assert completion(http).status_code == 200
    assert server.wait_idle().num_running == 0
