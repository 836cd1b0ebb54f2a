"""Reasoning models: chat_template_kwargs reach the template, --reasoning-parser splits the
thinking into reasoning_content (streamed or not, the same split), and structured output
applies to the answer after `</think>`."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from pagoda.http_client.sse import iter_sse_events
from pagoda.serve.api.reasoning import ReasoningStream, get_reasoning_parser
from reasoning_model import build_reasoning_model, token_id
from server_utils import MODEL_NAME, LiveServer, start_server

HELLO = [{"role": "user", "content": "Hello"}]


@pytest.mark.parametrize(
    "name, opened, text, expected",
    [
        ("qwen3", False, "<think>\nplan</think>\n\nanswer", ("plan", "answer")),
        ("qwen3", False, "just an answer", (None, "just an answer")),
        ("qwen3", False, "<think>cut short", ("cut short", "")),
        ("qwen3", True, "plan</think>answer", ("plan", "answer")),
        ("deepseek_r1", False, "plan</think>answer", ("plan", "answer")),
        ("deepseek_r1", False, "never closed", ("never closed", "")),
    ],
)
def test_split_whole_and_streamed_agree(name: str, opened: bool, text: str, expected: tuple) -> None:
    parser = get_reasoning_parser(name)
    opened = opened or parser.opened_by_prompt("")
    assert parser.split(text, opened) == expected
    for size in (1, 2, 3, 7):  # any chunking of the text streams the same split
        stream, reasoning, answer = ReasoningStream(parser, opened), "", ""
        for end in range(size, len(text) + size, size):
            new_reasoning, new_answer = stream.step(text[:end], end >= len(text))
            reasoning, answer = reasoning + new_reasoning, answer + new_answer
        assert (reasoning or None if expected[0] is None else reasoning, answer) == expected


def test_prompt_markers() -> None:
    qwen3 = get_reasoning_parser("qwen3")
    assert qwen3.opened_by_prompt("assistant:<think>\n") and not qwen3.closed_by_prompt("assistant:<think>\n")
    assert qwen3.closed_by_prompt("assistant:<think>\n\n</think>\n\n")
    assert not qwen3.opened_by_prompt("assistant:") and not qwen3.closed_by_prompt("assistant:")


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_reasoning_model(tmp_path_factory.mktemp("qwen3"))


@pytest.fixture(scope="module")
def r1_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_reasoning_model(tmp_path_factory.mktemp("r1"), opens_thinking=True)


@pytest.fixture(scope="module")
def qwen3(qwen3_dir: Path) -> LiveServer:
    live = start_server(qwen3_dir, reasoning_parser="qwen3")
    yield live
    live.stop()


@pytest.fixture(scope="module")
def r1(r1_dir: Path) -> LiveServer:
    live = start_server(r1_dir, reasoning_parser="deepseek_r1")
    yield live
    live.stop()


def chat(server: LiveServer, **fields) -> dict:
    response = httpx.post(
        server.base_url + "/chat/completions",
        timeout=120,
        json={"model": MODEL_NAME, "messages": HELLO, "max_tokens": 8, "temperature": 0, **fields},
    )
    assert response.status_code == 200, response.text
    return response.json()


def streamed(server: LiveServer, **fields) -> tuple[str, str]:
    reasoning = content = ""
    with httpx.stream(
        "POST",
        server.base_url + "/chat/completions",
        timeout=120,
        json={"model": MODEL_NAME, "messages": HELLO, "max_tokens": 8, "temperature": 0, "stream": True, **fields},
    ) as response:
        assert response.status_code == 200
        for event in iter_sse_events(response.iter_lines()):
            if not event.done:
                delta = event.json()["choices"][0]["delta"]
                reasoning += delta.get("reasoning_content") or ""
                content += delta.get("content") or ""
    return reasoning, content


def test_chat_template_kwargs_reach_the_template(qwen3: LiveServer) -> None:
    thinking = chat(qwen3, max_tokens=1)["usage"]["prompt_tokens"]
    closed = chat(qwen3, max_tokens=1, chat_template_kwargs={"enable_thinking": False})
    assert closed["usage"]["prompt_tokens"] > thinking  # the template wrote <think></think>
    message = chat(qwen3, chat_template_kwargs={"enable_thinking": False})["choices"][0]["message"]
    assert message["reasoning_content"] is None  # thinking closed in the prompt: all answer
    for bad in ({"tokenize": True}, {"add_generation_prompt": False}, "x"):
        response = httpx.post(
            qwen3.base_url + "/chat/completions",
            timeout=60,
            json={"model": MODEL_NAME, "messages": HELLO, "max_tokens": 1, "chat_template_kwargs": bad},
        )
        assert response.status_code == 400 and response.json()["error"]["param"] == "chat_template_kwargs"


def test_open_thinking_is_reasoning_content_streamed_or_not(r1: LiveServer) -> None:
    message = chat(r1)["choices"][0]["message"]
    assert message["reasoning_content"]  # a short random output never closes the thinking
    assert streamed(r1) == (message["reasoning_content"], message["content"] or "")


def test_structured_output_follows_the_thinking(r1: LiveServer, r1_dir: Path) -> None:
    """The thinking is free; the answer after </think> follows the schema. The bias starts the
    answer at once; it cannot push anything past the grammar."""
    schema = {"type": "string", "enum": ["alpha", "beta"]}
    fields = {
        "max_tokens": 24,
        "logit_bias": {str(token_id(r1_dir, "</think>")): 100},
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}},
    }
    choice = chat(r1, **fields)["choices"][0]
    assert choice["message"]["reasoning_content"] == ""
    assert json.loads(choice["message"]["content"]) in schema["enum"]
    assert streamed(r1, **fields) == ("", choice["message"]["content"])
