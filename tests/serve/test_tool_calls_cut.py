"""Parallel tool calls cut short by max_tokens (tool_choice "required"): the complete calls come
back as tool_calls, the cut one as content (never as a call with half its arguments), with
finish_reason "length". They came back as raw text with the complete calls dropped."""

from __future__ import annotations

import json

import httpx
import pytest

from pagoda.serve.api.tool_parsers.hermes import HermesParser
from server_utils import MODEL_NAME, LiveServer, start_server
from test_tool_calls_auto import build_model_with_markers

PING = {
    "type": "function",
    "function": {
        "name": "ping",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["n"],
            "properties": {"n": {"type": "integer", "minimum": 0, "maximum": 9}},
        },
    },
}


def test_the_parser_keeps_complete_calls_of_a_cut_output() -> None:
    text = (
        '<tool_call>\n{"name": "a", "arguments": {"x": 1}}\n</tool_call>\n'
        '<tool_call>\n{"name": "b", "arguments": {"x": 2}}\n</tool_call>\n<tool_call>\n{"name": "c", "argu'
    )
    parsed = HermesParser().parse_cut(text)
    assert [c.name for c in parsed.tool_calls] == ["a", "b"]
    assert parsed.content == '<tool_call>\n{"name": "c", "argu'


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    live = start_server(build_model_with_markers(tmp_path_factory.mktemp("markers")), tool_call_parser="hermes")
    yield live
    live.stop()


def test_a_cut_parallel_answer_returns_its_complete_calls(server: LiveServer) -> None:
    seen_cut_with_calls = False
    with httpx.Client(base_url=server.url, timeout=120) as client:
        for max_tokens in range(8, 80, 4):
            response = client.post(
                "/v1/chat/completions",
                json={
                    "model": MODEL_NAME,
                    "messages": [{"role": "user", "content": "ping"}],
                    "tools": [PING],
                    "tool_choice": "required",
                    "max_tokens": max_tokens,
                    "min_tokens": max_tokens,
                    "parallel_tool_calls": True,
                    "temperature": 0,
                },
            )  # min_tokens: no EOS, so the grammar goes on to further calls
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            calls = choice["message"].get("tool_calls") or []
            for call in calls:  # a call returned is always whole
                assert json.loads(call["function"]["arguments"])["n"] in range(10)
            content = choice["message"]["content"] or ""
            assert "</tool_call>" not in content  # no complete call left behind in the text
            if choice["finish_reason"] == "length" and calls:
                seen_cut_with_calls = True
    assert seen_cut_with_calls  # a cut right after a complete call still answers that call
