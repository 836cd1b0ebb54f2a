"""vLLM's `prompt_logprobs` on completions and chat: the shape vLLM answers with, values equal
to transformers' on the tiny model, and refusals for what it cannot do."""

from __future__ import annotations

import httpx
import pytest
import torch

from server_utils import MODEL_NAME, LiveServer, build_tiny_model, start_server

PROMPT = "def fibonacci(n):\n    if n < 2:"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server(model_dir) -> LiveServer:
    live = start_server(model_dir)
    yield live
    live.stop()


def post(server: LiveServer, path: str, body: dict) -> httpx.Response:
    return httpx.post(server.url + path, json={"model": MODEL_NAME, **body}, timeout=60)


def test_completion_prompt_logprobs_match_transformers(server: LiveServer, model_dir) -> None:
    from transformers import AutoModelForCausalLM

    tokens = post(server, "/tokenize", {"prompt": PROMPT}).json()["tokens"]
    response = post(
        server, "/v1/completions", {"prompt": tokens, "max_tokens": 1, "temperature": 0, "prompt_logprobs": 3}
    )
    assert response.status_code == 200, response.text
    (choice,) = response.json()["choices"]
    entries = choice["prompt_logprobs"]
    assert len(entries) == len(tokens) and entries[0] is None
    model = AutoModelForCausalLM.from_pretrained(model_dir, torch_dtype=torch.float32)
    with torch.no_grad():
        expected = model(torch.tensor([tokens])).logits[0].float().log_softmax(-1)
    for position, entry in enumerate(entries[1:], start=1):
        token = tokens[position]
        assert str(token) in entry and 3 <= len(entry) <= 4
        assert entry[str(token)]["logprob"] == pytest.approx(expected[position - 1, token].item(), abs=2e-3)
        ranks = sorted(v["rank"] for k, v in entry.items() if k != str(token) or v["rank"] <= 3)
        assert ranks[:3] == [1, 2, 3]
        assert all(isinstance(v["decoded_token"], str) for v in entry.values())


def test_prompt_logprobs_equal_echoed_logprobs(server: LiveServer) -> None:
    body = {"prompt": PROMPT, "max_tokens": 2, "temperature": 0, "n": 2}
    scored = post(server, "/v1/completions", {**body, "prompt_logprobs": 0}).json()
    echoed = post(server, "/v1/completions", {**body, "echo": True, "logprobs": 0}).json()
    num_prompt = scored["usage"]["prompt_tokens"]
    echo_values = echoed["choices"][0]["logprobs"]["token_logprobs"][:num_prompt]
    for choice in scored["choices"]:  # each sample of the prompt carries its scores
        entries = choice["prompt_logprobs"]
        assert len(entries) == num_prompt
        values = [None if e is None else next(iter(e.values()))["logprob"] for e in entries]
        assert values[0] is None and echo_values[0] is None
        assert values[1:] == pytest.approx(echo_values[1:], abs=1e-5)
    plain = post(server, "/v1/completions", body).json()
    assert all(c["prompt_logprobs"] is None for c in plain["choices"])


def test_batched_prompts_each_score_their_own(server: LiveServer) -> None:
    response = post(server, "/v1/completions", {"prompt": [PROMPT, "import os"], "max_tokens": 1, "prompt_logprobs": 1})
    choices = sorted(response.json()["choices"], key=lambda c: c["index"])
    lengths = [len(c["prompt_logprobs"]) for c in choices]
    assert lengths[0] != lengths[1]


def test_chat_prompt_logprobs(server: LiveServer) -> None:
    messages = [{"role": "user", "content": "Hello there"}]
    response = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2, "prompt_logprobs": 2})
    assert response.status_code == 200, response.text
    body = response.json()
    entries = body["prompt_logprobs"]
    assert len(entries) == body["usage"]["prompt_tokens"] and entries[0] is None
    assert all(2 <= len(e) <= 3 for e in entries[1:])
    plain = post(server, "/v1/chat/completions", {"messages": messages, "max_tokens": 2}).json()
    assert plain["prompt_logprobs"] is None


@pytest.mark.parametrize(
    "path, base",
    [
        ("/v1/completions", {"prompt": PROMPT}),
        ("/v1/chat/completions", {"messages": [{"role": "user", "content": "hi"}]}),
    ],
)
@pytest.mark.parametrize(
    "extra, param",
    [
        ({"prompt_logprobs": 1, "stream": True}, "prompt_logprobs"),
        ({"prompt_logprobs": -1}, "prompt_logprobs"),
        ({"prompt_logprobs": 21}, "prompt_logprobs"),
    ],
)
def test_refusals(server: LiveServer, path: str, base: dict, extra: dict, param: str) -> None:
    response = post(server, path, {**base, "max_tokens": 1, **extra})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
