"""`tool_choice: auto` through the server, for every parser: once the model starts a call, the
rest of it follows the tools' schemas.

A random model rarely starts a call by itself, so each test forces the start with logit_bias
toward the parser's trigger token. The bias cannot push anything past the grammar (the mask
is applied first: a masked token stays at -inf), so after the trigger the call is the model's
own, under the grammar alone. The tokenizer is the bundled one plus the formats' marker tokens,
special where the real models have them special ([TOOL_CALLS] in Mistral's, <|python_tag|> in
Llama 3.1's, DeepSeek-V3's call markers) and plain text where they are not (<tool_call> in
Qwen2.5's).
"""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from pagoda.config import DEFAULT_MODEL_DIR
from pagoda.http_client.sse import iter_sse_events
from server_utils import MODEL_NAME, TOKENIZER_FILES, LiveServer, start_server

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the test extra")

TEMPLATE = (
    "{%- if tools %}Tools: {% for tool in tools %}{{ tool | tojson }}{% endfor %}\n{% endif %}"
    "{%- for message in messages %}{{ message.role }}: {{ message.content }}\n{% endfor %}assistant:"
)
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["city", "unit"],
            "properties": {"city": {"type": "string", "maxLength": 10}, "unit": {"enum": ["celsius", "fahrenheit"]}},
        },
    },
}
TIME = {
    "type": "function",
    "function": {
        "name": "get_time",
        "parameters": {
            "type": "object",
            "additionalProperties": False,
            "required": ["zone"],
            "properties": {"zone": {"type": "integer", "minimum": -12, "maximum": 14}},
        },
    },
}
TOOLS = [WEATHER, TIME]
PARAMETERS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
# (parser, the trigger forced at the start of the output): llama3_json has two call forms
CASES = [
    ("hermes", "<tool_call>"),
    ("mistral", "[TOOL_CALLS]"),
    ("llama3_json", "<|python_tag|>"),
    ("llama3_json", "{"),
    ("qwen3_coder", "<tool_call>"),
    ("pythonic", "["),
    ("deepseek_v3", "<｜tool▁calls▁begin｜>"),
]
DEEPSEEK_MARKERS = [
    "<｜tool▁calls▁begin｜>",
    "<｜tool▁calls▁end｜>",
    "<｜tool▁call▁begin｜>",
    "<｜tool▁call▁end｜>",
    "<｜tool▁sep｜>",
]


def build_model_with_markers(directory: Path) -> Path:
    from model_factory import build_model
    from tokenizers import AddedToken, Tokenizer

    tokenizer = Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json"))
    tokenizer.add_tokens(
        [
            AddedToken("<tool_call>", special=False, normalized=False),
            AddedToken("</tool_call>", special=False, normalized=False),
        ]
    )
    tokenizer.add_special_tokens(
        [
            AddedToken(marker, special=True, normalized=False)
            for marker in ("[TOOL_CALLS]", "<|python_tag|>", *DEEPSEEK_MARKERS)
        ]
    )
    build_model(directory, "llama", vocab_size=tokenizer.get_vocab_size())
    for name in TOKENIZER_FILES:
        (directory / name).write_bytes((DEFAULT_MODEL_DIR / name).read_bytes())
    tokenizer.save(str(directory / "tokenizer.json"))
    config = json.loads((directory / "tokenizer_config.json").read_text())
    config.pop("added_tokens_decoder", None)  # tokenizer.json lists them all
    config["chat_template"] = TEMPLATE
    (directory / "tokenizer_config.json").write_text(json.dumps(config))
    return directory


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model_with_markers(tmp_path_factory.mktemp("markers"))


@pytest.fixture(scope="module")
def server(request: pytest.FixtureRequest, model_dir: Path) -> LiveServer:
    """A server with `--tool-call-parser` request.param (one per parser, shared by its tests)."""
    live = start_server(model_dir, tool_call_parser=request.param)
    yield live
    live.stop()


def trigger_id(model_dir: Path, trigger: str) -> int:
    from tokenizers import Tokenizer

    ids = Tokenizer.from_file(str(model_dir / "tokenizer.json")).encode(trigger, add_special_tokens=False).ids
    assert len(ids) == 1, (trigger, ids)
    return ids[0]


def body(trigger_token: int, **fields) -> dict:
    return {
        "model": MODEL_NAME,
        "messages": [{"role": "user", "content": "Weather in Oslo, and the time?"}],
        "tools": TOOLS,
        "tool_choice": "auto",
        "parallel_tool_calls": False,
        "max_tokens": 160,
        "logit_bias": {str(trigger_token): 100},
        **fields,
    }


def streamed(http: httpx.Client, request: dict) -> tuple[list[dict], str | None, str]:
    calls: dict[int, dict] = {}
    finish, content = None, ""
    with http.stream("POST", "/v1/chat/completions", json={**request, "stream": True}) as response:
        assert response.status_code == 200
        for event in iter_sse_events(response.iter_lines()):
            if event.done:
                continue
            choice = event.json()["choices"][0]
            finish = choice["finish_reason"] or finish
            content += choice["delta"].get("content") or ""
            for delta in choice["delta"].get("tool_calls") or []:
                entry = calls.setdefault(delta["index"], {"name": "", "arguments": ""})
                if "id" in delta:
                    entry["name"] = delta["function"]["name"]
                entry["arguments"] += delta["function"].get("arguments", "")
    return [calls[i] for i in sorted(calls)], finish, content


@pytest.mark.parametrize("server, trigger", CASES, indirect=["server"])
def test_auto_call_once_started_is_schema_valid_streamed_or_not(
    server: LiveServer, model_dir: Path, trigger: str
) -> None:
    token = trigger_id(model_dir, trigger)
    with httpx.Client(base_url=server.url, timeout=120) as http:
        for seed, temperature in ((0, 0.0), (1, 1.0), (2, 1.0)):
            request = body(token, seed=seed, temperature=temperature)
            response = http.post("/v1/chat/completions", json=request)
            assert response.status_code == 200, response.text
            choice = response.json()["choices"][0]
            assert choice["finish_reason"] == "tool_calls", choice
            calls = choice["message"]["tool_calls"]
            assert len(calls) == 1 and not choice["message"]["content"]
            for call in calls:
                arguments = json.loads(call["function"]["arguments"])
                jsonschema.validate(arguments, PARAMETERS[call["function"]["name"]])
            streamed_calls, finish, content = streamed(http, request)
            assert finish == "tool_calls" and not content.strip()
            assert streamed_calls == [
                {"name": c["function"]["name"], "arguments": c["function"]["arguments"]} for c in calls
            ]
    stats = server.wait_idle()
    assert stats.num_free_blocks == stats.num_total_blocks


@pytest.mark.parametrize("server", sorted({parser for parser, _ in CASES}), indirect=True)
def test_auto_without_a_call_is_content(server: LiveServer) -> None:
    with httpx.Client(base_url=server.url, timeout=120) as http:
        request = body(0, max_tokens=12, temperature=0)
        request.pop("logit_bias")
        choice = http.post("/v1/chat/completions", json=request).json()["choices"][0]
    if choice["finish_reason"] != "tool_calls":  # a random model: text, unless it happens to call
        assert choice["message"]["content"] is not None and not choice["message"].get("tool_calls")
