"""What one client can do to everyone else: nothing. Huge n, megabyte prompts while others are
served, prompts provably over the context, and lm-eval's prompt-scoring shape."""

from __future__ import annotations

import json
import statistics
import threading
import time

import httpx
import pytest

from server_utils import LiveServer, build_tiny_model, start_server


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    live = start_server(build_tiny_model(tmp_path_factory.mktemp("model")))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def long_context_server(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    """A context so long that multi-megabyte prompts must really be tokenized to be judged."""
    model = build_tiny_model(tmp_path_factory.mktemp("long"))
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 4_000_000
    (model / "config.json").write_text(json.dumps(config))
    live = start_server(model, max_request_bytes=16 * 2**20)
    yield live
    live.stop()


def test_huge_n_is_refused_and_the_engine_lives(server: LiveServer) -> None:
    for body in (
        {"messages": [{"role": "user", "content": "hi"}], "n": 2**31},
        {"messages": [{"role": "user", "content": "hi"}], "n": 65},
    ):  # > max_num_seqs 64
        response = httpx.post(server.base_url + "/chat/completions", json=body, timeout=30)
        assert response.status_code == 400, response.text
        assert response.json()["error"]["param"] == "n"
    ok = httpx.post(server.base_url + "/completions", json={"prompt": "hi", "max_tokens": 2}, timeout=30)
    assert ok.status_code == 200 and httpx.get(server.url + "/health").status_code == 200
    assert server.wait_idle().num_free_blocks == server.stats().num_total_blocks


def test_prompt_provably_over_the_context_is_refused_without_tokenizing(server: LiveServer) -> None:
    started = time.monotonic()
    response = httpx.post(
        server.base_url + "/completions", timeout=60, json={"prompt": "word " * 1_500_000, "max_tokens": 1}
    )  # 7.5 MB
    assert response.status_code == 400
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
    assert time.monotonic() - started < 5
    chat = httpx.post(
        server.base_url + "/chat/completions",
        timeout=60,
        json={"messages": [{"role": "user", "content": "x " * 1_000_000}]},
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"


def test_health_and_small_requests_answer_while_megabyte_prompts_tokenize(long_context_server: LiveServer) -> None:
    url = long_context_server.url
    done = threading.Event()
    statuses: list[int] = []

    def big_prompts() -> None:
        with httpx.Client(timeout=120) as client:
            while not done.is_set():
                statuses.append(
                    client.post(
                        url + "/v1/completions",
                        json={"prompt": "lorem ipsum dolor sit amet " * 150_000, "max_tokens": 1},
                    ).status_code
                )

    senders = [threading.Thread(target=big_prompts) for _ in range(2)]
    for sender in senders:
        sender.start()
    latencies = []
    try:
        time.sleep(0.5)
        with httpx.Client(timeout=30) as client:
            deadline = time.monotonic() + 6
            while time.monotonic() < deadline:
                started = time.monotonic()
                assert client.get(url + "/health").status_code == 200
                latencies.append(time.monotonic() - started)
                time.sleep(0.02)
            small = client.post(url + "/v1/completions", json={"prompt": "hi", "max_tokens": 2})
            assert small.status_code == 200
    finally:
        done.set()
        for sender in senders:
            sender.join(120)
    assert statuses and set(statuses) == {400}  # 4 MB prompts exceed the KV pool: refused
    latencies.sort()
    p99 = latencies[int(0.99 * (len(latencies) - 1))]
    print(
        f"/health under 4 MB prompts: n={len(latencies)} p50 {statistics.median(latencies) * 1000:.1f} ms "
        f"p99 {p99 * 1000:.1f} ms"
    )
    assert p99 < 0.25  # 5.5 s stalls before tokenization left the event loop


def test_echo_with_max_tokens_zero_scores_the_prompt(server: LiveServer) -> None:
    response = httpx.post(
        server.base_url + "/completions",
        timeout=30,
        json={
            "prompt": "def add(a, b):\n    return a + b",
            "max_tokens": 0,
            "echo": True,
            "logprobs": 1,
            "temperature": 0,
        },
    )
    assert response.status_code == 200, response.text
    body = response.json()
    choice = body["choices"][0]
    assert choice["text"] == "def add(a, b):\n    return a + b"
    logprobs = choice["logprobs"]
    assert logprobs["token_logprobs"][0] is None and all(isinstance(v, float) for v in logprobs["token_logprobs"][1:])
    assert len(logprobs["tokens"]) == body["usage"]["prompt_tokens"]
    assert "".join(logprobs["tokens"]).endswith(choice["text"])  # after the BOS token
    assert body["usage"]["completion_tokens"] == 0
    stream = httpx.post(
        server.base_url + "/completions",
        timeout=30,
        json={"prompt": "x", "max_tokens": 0, "echo": True, "stream": True},
    )
    assert stream.status_code == 400 and stream.json()["error"]["param"] == "stream"
    plain = httpx.post(server.base_url + "/completions", timeout=30, json={"prompt": "x", "max_tokens": 0})
    assert plain.status_code == 400 and plain.json()["error"]["param"] == "max_tokens"


def test_openapi_describes_request_and_response_bodies(server: LiveServer) -> None:
    schema = httpx.get(server.url + "/openapi.json", timeout=30).json()
    components = schema["components"]["schemas"]
    for path, request_model, response_model in (
        ("/v1/completions", "CompletionRequest", "CompletionResponse"),
        ("/v1/chat/completions", "ChatCompletionRequest", "ChatCompletionResponse"),
        ("/tokenize", "TokenizeRequest", "TokenizeResponse"),
    ):
        operation = schema["paths"][path]["post"]
        assert operation["requestBody"]["content"]["application/json"]["schema"]["$ref"].endswith(request_model)
        assert operation["responses"]["200"]["content"]["application/json"]["schema"]["$ref"].endswith(response_model)
        assert request_model in components and response_model in components
    assert {"prompt", "max_tokens", "n", "logprobs", "echo"} <= set(components["CompletionRequest"]["properties"])
    assert "messages" in components["ChatCompletionRequest"]["required"]
