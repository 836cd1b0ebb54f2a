"""Chat templates and old clients: --chat-template, a request's chat_template (trusted servers
only), add_generation_prompt / continue_final_message, and the deprecated functions API."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import openai
import pytest

from pagoda.serve.api.chat_template import load_chat_template
from pagoda.serve.settings import ServerSettings
from server_utils import MODEL_NAME, LiveServer, build_tiny_model, start_server

TEMPLATE = (
    "{%- if tools %}[tools:{% for t in tools %}{{ t.function.name }}{% endfor %}]{% endif %}"
    "{%- for m in messages %}<{{ m.role }}>{{ m.content }}{% if not loop.last or not continue_final_message %}"
    "</{{ m.role }}>{% endif %}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"
)
WEATHER = {
    "name": "get_weather",
    "description": "the weather",
    "parameters": {
        "type": "object",
        "additionalProperties": False,
        "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 8}},
    },
}
HI = [{"role": "user", "content": "hi"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server(model_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    template_file = tmp_path_factory.mktemp("template") / "chat.jinja"
    template_file.write_text(TEMPLATE)
    live = start_server(model_dir, chat_template=str(template_file))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def http(server: LiveServer) -> httpx.Client:
    with httpx.Client(base_url=server.url, timeout=60) as client:
        yield client


def rendered(http: httpx.Client, **body) -> str:
    response = http.post("/tokenize", json={"messages": HI, **body})
    assert response.status_code == 200, response.text
    return http.post("/detokenize", json={"tokens": response.json()["tokens"]}).json()["prompt"]


def test_chat_template_flag_reads_a_file_or_takes_inline_text(tmp_path: Path) -> None:
    path = tmp_path / "t.jinja"
    path.write_text("{{ messages }}")
    assert load_chat_template(str(path)) == "{{ messages }}"
    assert load_chat_template("{{ messages }}") == "{{ messages }}"
    assert ServerSettings(chat_template=str(path)).chat_template == "{{ messages }}"
    with pytest.raises(ValueError, match="neither a file nor"):
        ServerSettings(chat_template=str(tmp_path / "missing.jinja"))


def test_server_template_renders_and_prompt_endings(http: httpx.Client) -> None:
    assert rendered(http) == "<user>hi</user><assistant>"
    assert rendered(http, add_generation_prompt=False) == "<user>hi</user>"
    prefilled = [*HI, {"role": "assistant", "content": "The answer is"}]
    assert rendered(http, messages=prefilled, continue_final_message=True) == "<user>hi</user><assistant>The answer is"
    response = http.post(
        "/v1/chat/completions",
        json={"messages": prefilled, "continue_final_message": True, "max_tokens": 2, "temperature": 0},
    )
    assert response.status_code == 200, response.text
    both = http.post(
        "/v1/chat/completions",
        json={"messages": prefilled, "continue_final_message": True, "add_generation_prompt": True, "max_tokens": 2},
    )
    assert both.status_code == 400 and both.json()["error"]["param"] == "continue_final_message"


def test_request_template_needs_a_trusting_server(http: httpx.Client, model_dir: Path) -> None:
    body = {"messages": HI, "max_tokens": 2, "chat_template": "{{ messages[0].content }}!"}
    refused = http.post("/v1/chat/completions", json=body)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "chat_template"
    live = start_server(model_dir, trust_request_chat_template=True)
    try:
        with httpx.Client(base_url=live.url, timeout=60) as trusting:
            assert rendered(trusting, chat_template="{{ messages[0].content }}!") == "hi!"
            assert trusting.post("/v1/chat/completions", json=body).status_code == 200
            broken = trusting.post("/v1/chat/completions", json={**body, "chat_template": "{% if %}"})
            assert broken.status_code == 400, broken.text
    finally:
        live.stop()


def test_functions_are_tools_answered_as_a_function_call(server: LiveServer, http: httpx.Client) -> None:
    body = {
        "messages": HI,
        "functions": [WEATHER],
        "function_call": {"name": "get_weather"},
        "max_tokens": 60,
        "temperature": 0,
    }
    response = http.post("/v1/chat/completions", json=body)
    assert response.status_code == 200, response.text
    choice = response.json()["choices"][0]
    assert choice["finish_reason"] == "function_call" and choice["message"]["tool_calls"] is None
    call = choice["message"]["function_call"]
    assert call["name"] == "get_weather" and set(json.loads(call["arguments"])) == {"city"}

    client = openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0)
    stream = client.chat.completions.create(model=MODEL_NAME, stream=True, **body)
    name, arguments, finish = "", "", None
    for chunk in stream:
        delta = chunk.choices[0].delta
        assert not delta.tool_calls
        if delta.function_call is not None:
            name += delta.function_call.name or ""
            arguments += delta.function_call.arguments or ""
        finish = chunk.choices[0].finish_reason or finish
    assert (name, json.loads(arguments), finish) == ("get_weather", json.loads(call["arguments"]), "function_call")


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"functions": [WEATHER], "tools": [{"type": "function", "function": WEATHER}]}, "functions"),
        ({"functions": "get_weather"}, "functions"),
        ({"functions": [WEATHER], "function_call": {"name": "other"}}, "function_call"),
        ({"functions": [WEATHER], "function_call": "always"}, "function_call"),
        ({"function_call": "auto"}, "function_call"),
    ],
)
def test_bad_function_requests(http: httpx.Client, fields: dict, param: str) -> None:
    response = http.post("/v1/chat/completions", json={"messages": HI, "max_tokens": 2, **fields})
    assert response.status_code == 400, response.text
    assert response.json()["error"]["param"] == param
