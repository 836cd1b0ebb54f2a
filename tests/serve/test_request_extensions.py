"""vLLM's request extensions: allowed_token_ids, bad_words, truncate_prompt_tokens (with
truncation_side), return_token_ids, custom chat roles, and the /invocations route."""

from __future__ import annotations

import json
from types import SimpleNamespace

import httpx
import pytest
import torch

from pagoda.sampling_params import SamplingParams, tokenize_bad_words
from pagoda.serve.api.messages import template_renders_role
from pagoda.worker.sampler import Sampler
from server_utils import MODEL_NAME, LiveServer, build_tiny_model, start_server

PROMPT = "def fibonacci(n):\n    if n < 2:"
MESSAGES = [{"role": "user", "content": "Hello there"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    live = start_server(build_tiny_model(tmp_path_factory.mktemp("model")))
    yield live
    live.stop()


def post(server: LiveServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL_NAME, **body}, timeout=60)


def tokenize(server: LiveServer, text: str) -> list[int]:
    return post(server, "/tokenize", {"prompt": text}).json()["tokens"]


def stream_chunks(server: LiveServer, path: str, body: dict) -> list[dict]:
    with httpx.stream(
        "POST", server.url + path, json={"model": MODEL_NAME, "stream": True, **body}, timeout=60
    ) as response:
        assert response.status_code == 200
        lines = [line[6:] for line in response.iter_lines() if line.startswith("data: ")]
    return [json.loads(line) for line in lines if line != "[DONE]"]


# ---- sampler ----------------------------------------------------------------------------------


def row(params: SamplingParams, output: list[int]) -> SimpleNamespace:
    return SimpleNamespace(
        sampling_params=params,
        output_token_ids=output,
        num_output_tokens=len(output),
        eos_token_ids=[],
        all_token_ids=output,
    )


def test_sampler_masks_allowed_tokens_and_bad_word_endings_in_one_batch() -> None:
    sampler = Sampler(10, torch.device("cpu"), 0)
    logits = torch.zeros(3, 10)
    rows = [
        row(SamplingParams(allowed_token_ids=[2, 5]), []),
        row(SamplingParams(bad_words_token_ids=[[7], [3, 4]]), [1, 3]),
        row(SamplingParams(bad_words_token_ids=[[3, 4]]), [1, 2]),
    ]
    processed = sampler.process(logits, rows)
    assert torch.isfinite(processed[0]).nonzero().flatten().tolist() == [2, 5]
    assert torch.isinf(processed[1]).nonzero().flatten().tolist() == [4, 7]  # [3, 4] after a 3
    assert torch.isfinite(processed[2]).all()  # the output does not end with 3
    assert torch.isfinite(logits).all()  # the caller's logits are untouched


def test_bad_words_are_tokenized_as_vllm_does(server: LiveServer) -> None:
    tokenizer = server.llm.tokenizer
    words = tokenize_bad_words(["hello", " world"], tokenizer)
    assert tokenizer.encode("hello", add_special_tokens=False) in words
    assert tokenizer.encode("world", add_special_tokens=False) in words  # leading spaces stripped
    spaced = tokenizer.encode(" hello", add_special_tokens=False)  # kept only when as long as the word
    assert (spaced in words) == (len(spaced) == 1)
    assert tokenizer.encode(" world", add_special_tokens=False) in words


def test_invalid_values_are_refused() -> None:
    for bad in ({"allowed_token_ids": []}, {"allowed_token_ids": [-1]}, {"bad_words": [" "]}):
        with pytest.raises(ValueError):
            SamplingParams(**bad)


# ---- through the server -----------------------------------------------------------------------


def test_allowed_token_ids(server: LiveServer) -> None:
    allowed = tokenize(server, " the a")[-2:]
    body = post(
        server,
        "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": 8,
            "temperature": 1.0,
            "seed": 1,
            "ignore_eos": True,
            "allowed_token_ids": allowed,
            "return_token_ids": True,
        },
    ).json()
    token_ids = body["choices"][0]["token_ids"]
    assert len(token_ids) == 8 and set(token_ids) <= set(allowed)
    response = post(server, "/v1/completions", {"prompt": PROMPT, "allowed_token_ids": [10**7]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "allowed_token_ids"


def test_bad_words_are_never_generated(server: LiveServer) -> None:
    body = {"prompt": PROMPT, "max_tokens": 12, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    plain = post(server, "/v1/completions", body).json()["choices"][0]
    first = post(server, "/detokenize", {"tokens": plain["token_ids"][:1]}).json()["prompt"]
    assert first.strip(), "the first token has text to ban"
    banned = post(server, "/v1/completions", {**body, "bad_words": [first]}).json()["choices"][0]
    assert banned["token_ids"][0] != plain["token_ids"][0]
    assert plain["token_ids"][0] not in banned["token_ids"]


@pytest.mark.parametrize("side", ["left", "right"])
def test_truncate_prompt_tokens(server: LiveServer, side: str) -> None:
    tokens = tokenize(server, PROMPT)
    body = post(
        server,
        "/v1/completions",
        {
            "prompt": PROMPT,
            "max_tokens": 2,
            "truncate_prompt_tokens": 4,
            "truncation_side": side,
            "return_token_ids": True,
            "echo": True,
        },
    ).json()
    choice = body["choices"][0]
    expected = tokens[-4:] if side == "left" else tokens[:4]
    assert choice["prompt_token_ids"] == expected and body["usage"]["prompt_tokens"] == 4
    chat = post(
        server,
        "/v1/chat/completions",
        {
            "messages": MESSAGES,
            "max_tokens": 2,
            "truncate_prompt_tokens": 3,
            "truncation_side": side,
            "return_token_ids": True,
        },
    ).json()
    assert chat["usage"]["prompt_tokens"] == 3 and len(chat["prompt_token_ids"]) == 3


@pytest.mark.parametrize(
    "extra",
    [
        {"truncate_prompt_tokens": 0},
        {"truncate_prompt_tokens": -2},
        {"truncate_prompt_tokens": 10**9},
        {"truncation_side": "middle"},
    ],
)
def test_bad_truncation_is_a_400(server: LiveServer, extra: dict) -> None:
    for path, base in (("/v1/completions", {"prompt": PROMPT}), ("/v1/chat/completions", {"messages": MESSAGES})):
        response = post(server, path, {**base, "max_tokens": 1, **extra})
        assert response.status_code == 400, response.text


def test_truncation_to_the_context_length(server: LiveServer) -> None:
    response = post(server, "/v1/completions", {"prompt": PROMPT, "max_tokens": 1, "truncate_prompt_tokens": -1})
    assert response.status_code == 200


def test_return_token_ids_completions(server: LiveServer) -> None:
    body = {"prompt": PROMPT, "max_tokens": 6, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    whole = post(server, "/v1/completions", body).json()["choices"][0]
    assert whole["prompt_token_ids"] == tokenize(server, PROMPT) and len(whole["token_ids"]) == 6
    chunks = stream_chunks(server, "/v1/completions", body)
    streamed = [t for c in chunks for t in c["choices"][0]["token_ids"]]
    assert streamed == whole["token_ids"]
    assert chunks[0]["choices"][0]["prompt_token_ids"] == whole["prompt_token_ids"]
    assert all("prompt_token_ids" not in c["choices"][0] for c in chunks[1:])
    plain = post(server, "/v1/completions", {**body, "return_token_ids": False}).json()["choices"][0]
    assert plain["token_ids"] is None and plain["prompt_token_ids"] is None


def test_return_token_ids_chat(server: LiveServer) -> None:
    body = {"messages": MESSAGES, "max_tokens": 5, "temperature": 0, "ignore_eos": True, "return_token_ids": True}
    whole = post(server, "/v1/chat/completions", body).json()
    assert len(whole["choices"][0]["token_ids"]) == 5
    assert len(whole["prompt_token_ids"]) == whole["usage"]["prompt_tokens"]
    chunks = stream_chunks(server, "/v1/chat/completions", body)
    assert chunks[0]["prompt_token_ids"] == whole["prompt_token_ids"]
    streamed = [t for c in chunks for t in c["choices"][0].get("token_ids", [])]
    assert streamed == whole["choices"][0]["token_ids"]


def test_custom_roles_go_to_a_template_that_renders_them() -> None:
    class Template:
        def __init__(self, shows_role: bool) -> None:
            self.shows_role = shows_role

        def apply_chat_template(self, messages: list[dict], add_generation_prompt: bool) -> str:
            (message,) = messages
            return (f"<{message['role']}>" if self.shows_role else "") + message["content"]

    assert template_renders_role(Template(True), "my-custom-role")
    assert not template_renders_role(Template(False), "my-custom-role")


def test_a_role_the_template_does_not_render_is_refused(server: LiveServer) -> None:
    # The tiny model's template renders every non-assistant message alike.
    response = post(server, "/v1/chat/completions", {"messages": [{"role": "wizard", "content": "hi"}]})
    assert response.status_code == 400 and response.json()["error"]["param"] == "messages"


def test_invocations_dispatch_on_the_body(server: LiveServer) -> None:
    chat = httpx.post(server.url + "/invocations", json={"messages": MESSAGES, "max_tokens": 2}, timeout=60)
    assert chat.status_code == 200 and chat.json()["object"] == "chat.completion"
    completion = httpx.post(server.url + "/invocations", json={"prompt": PROMPT, "max_tokens": 2}, timeout=60)
    assert completion.status_code == 200 and completion.json()["object"] == "text_completion"
    for bad in ({"nothing": 1}, {"messages": "not a list"}):
        response = httpx.post(server.url + "/invocations", json=bad, timeout=60)
        assert response.status_code == 400 and "suitable handler" in response.json()["error"]["message"]
    invalid = httpx.post(server.url + "/invocations", json={"prompt": PROMPT, "n": 0}, timeout=60)
    assert invalid.status_code == 400 and invalid.json()["error"]["param"] == "n"
