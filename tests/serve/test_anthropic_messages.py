"""Anthropic's Messages API through the `anthropic` SDK (sampling knobs the SDK no longer
types, such as temperature, go in extra_body as its users send them): create, stream, a tool loop with
tool_result, count_tokens, both ways of sending the key, thinking blocks, and errors in
Anthropic's shape."""

from __future__ import annotations

from pathlib import Path

import httpx
import pytest

from pagoda.serve.admission.tenants import TenantRegistry
from reasoning_model import build_reasoning_model
from server_utils import MODEL_NAME, LiveServer, start_server

anthropic = pytest.importorskip("anthropic", reason="the anthropic SDK is in the test extra")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the test extra")

KEY = "sk-test"
WEATHER = {
    "name": "get_weather",
    "description": "Weather of a city",
    "input_schema": {
        "type": "object",
        "additionalProperties": False,
        "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 8}},
    },
}
HELLO = [{"role": "user", "content": "Hello"}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_reasoning_model(tmp_path_factory.mktemp("anthropic"), opens_thinking=True)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> LiveServer:
    live = start_server(model_dir, tenants=TenantRegistry.single_key(KEY), engine_transport="thread")
    yield live
    live.stop()


@pytest.fixture(scope="module")
def thinking_server(model_dir: Path) -> LiveServer:
    live = start_server(model_dir, reasoning_parser="deepseek_r1")
    yield live
    live.stop()


def client(server: LiveServer, **auth: str) -> anthropic.Anthropic:
    return anthropic.Anthropic(base_url=server.url, max_retries=0, timeout=120, **(auth or {"api_key": KEY}))


def test_create_and_stream_agree(server: LiveServer) -> None:
    sdk = client(server)
    message = sdk.messages.create(
        model=MODEL_NAME, max_tokens=8, messages=HELLO, system="Be brief.", extra_body={"temperature": 0}
    )
    assert message.type == "message" and message.role == "assistant" and message.model == MODEL_NAME
    assert message.stop_reason in ("max_tokens", "end_turn")
    assert message.usage.output_tokens <= 8 and message.usage.input_tokens > 0
    text = "".join(block.text for block in message.content if block.type == "text")
    with sdk.messages.stream(
        model=MODEL_NAME, max_tokens=8, messages=HELLO, system="Be brief.", extra_body={"temperature": 0}
    ) as stream:
        streamed = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert streamed == text
    assert final.stop_reason == message.stop_reason
    assert final.usage.output_tokens == message.usage.output_tokens


def test_stream_event_sequence(server: LiveServer) -> None:
    with client(server).messages.stream(model=MODEL_NAME, max_tokens=4, messages=HELLO) as stream:
        kinds = [event.type for event in stream]
    assert kinds[0] == "message_start" and kinds[-1] == "message_stop"
    assert kinds[-2] == "message_delta"
    if "content_block_start" in kinds:
        assert kinds.index("content_block_start") < kinds.index("content_block_stop")


def test_stop_sequence(server: LiveServer) -> None:
    sdk = client(server)
    text = "".join(
        b.text
        for b in sdk.messages.create(
            model=MODEL_NAME, max_tokens=12, messages=HELLO, extra_body={"temperature": 0}
        ).content
        if b.type == "text"
    )
    if len(text.strip()) < 3:
        pytest.skip("the random model wrote too little text to stop on")
    stop = text.strip()[1:3]
    message = sdk.messages.create(
        model=MODEL_NAME, max_tokens=12, messages=HELLO, extra_body={"temperature": 0}, stop_sequences=[stop]
    )
    assert message.stop_reason == "stop_sequence" and message.stop_sequence == stop


def test_tool_loop_with_tool_result(server: LiveServer) -> None:
    sdk = client(server)
    messages = [{"role": "user", "content": "Weather in Oslo?"}]
    for _ in range(2):
        message = sdk.messages.create(
            model=MODEL_NAME,
            max_tokens=64,
            messages=messages,
            tools=[WEATHER],
            tool_choice={"type": "any"},
            extra_body={"temperature": 1.0},
        )
        assert message.stop_reason == "tool_use", message
        uses = [block for block in message.content if block.type == "tool_use"]
        assert uses and uses[0].name == "get_weather" and uses[0].id.startswith("toolu_")
        jsonschema.validate(uses[0].input, WEATHER["input_schema"])
        messages += [
            {"role": "assistant", "content": [block.model_dump() for block in message.content]},
            {
                "role": "user",
                "content": [
                    {
                        "type": "tool_result",
                        "tool_use_id": uses[0].id,
                        "content": [{"type": "text", "text": "Sunny, 21 C"}],
                    }
                ],
            },
        ]
    with sdk.messages.stream(
        model=MODEL_NAME,
        max_tokens=64,
        messages=messages,
        tools=[WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
    ) as stream:
        final = stream.get_final_message()
    assert final.stop_reason == "tool_use"
    use = next(block for block in final.content if block.type == "tool_use")
    jsonschema.validate(use.input, WEATHER["input_schema"])
    none = sdk.messages.create(
        model=MODEL_NAME, max_tokens=4, messages=HELLO, tools=[WEATHER], tool_choice={"type": "none"}
    )
    assert none.stop_reason != "tool_use"


def test_count_tokens_matches_usage(server: LiveServer) -> None:
    sdk = client(server)
    counted = sdk.messages.count_tokens(model=MODEL_NAME, messages=HELLO, system="Be brief.", tools=[WEATHER])
    used = sdk.messages.create(model=MODEL_NAME, max_tokens=1, messages=HELLO, system="Be brief.", tools=[WEATHER])
    assert counted.input_tokens == used.usage.input_tokens + used.usage.cache_read_input_tokens > 0


def test_bearer_and_x_api_key_are_the_same_tenant(server: LiveServer) -> None:
    for auth in ({"api_key": KEY}, {"auth_token": KEY}):
        assert client(server, **auth).messages.create(model=MODEL_NAME, max_tokens=1, messages=HELLO).id
    with pytest.raises(anthropic.AuthenticationError) as raised:
        client(server, api_key="wrong").messages.create(model=MODEL_NAME, max_tokens=1, messages=HELLO)
    assert raised.value.body["type"] == "error"
    assert raised.value.body["error"]["type"] == "authentication_error"


@pytest.mark.parametrize(
    "body, status, mentions",
    [
        ({"model": MODEL_NAME, "messages": HELLO}, 400, "max_tokens"),
        (
            {
                "model": MODEL_NAME,
                "max_tokens": 4,
                "messages": [
                    {
                        "role": "user",
                        "content": [
                            {"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": "AA=="}}
                        ],
                    }
                ],
            },
            400,
            "image",
        ),
        ({"model": MODEL_NAME, "max_tokens": 4, "messages": [{"role": "system", "content": "x"}]}, 400, "role"),
        ({"model": MODEL_NAME, "max_tokens": 4, "messages": []}, 400, "messages"),
        (
            {
                "model": MODEL_NAME,
                "max_tokens": 4,
                "messages": HELLO,
                "tools": [WEATHER],
                "tool_choice": {"type": "tool", "name": "nope"},
            },
            400,
            "nope",
        ),
        (
            {
                "model": MODEL_NAME,
                "max_tokens": 4,
                "messages": HELLO,
                "tools": [{"type": "web_search_20250305", "name": "web_search"}],
            },
            400,
            "tools",
        ),
        ({"model": MODEL_NAME, "max_tokens": 4, "messages": HELLO, "mcp_servers": [{"url": "x"}]}, 400, "mcp_servers"),
        ({"model": "claude-nope", "max_tokens": 4, "messages": HELLO}, 404, "claude-nope"),
    ],
)
def test_errors_in_anthropic_shape(server: LiveServer, body: dict, status: int, mentions: str) -> None:
    response = httpx.post(server.url + "/v1/messages", json=body, headers={"x-api-key": KEY}, timeout=60)
    assert response.status_code == status, response.text
    error = response.json()
    assert error["type"] == "error" and set(error["error"]) == {"type", "message"}
    assert mentions in error["error"]["message"]


def test_null_max_tokens_through_the_sdk(server: LiveServer) -> None:
    with pytest.raises(anthropic.BadRequestError) as raised:
        client(server).messages.create(model=MODEL_NAME, max_tokens=1, messages=HELLO, extra_body={"max_tokens": None})
    assert raised.value.body["error"]["type"] == "invalid_request_error"


def test_thinking_blocks(thinking_server: LiveServer) -> None:
    """The R1-style template opens <think> in the prompt: a short random output never closes it,
    so it is all thinking, streamed or not."""
    sdk = anthropic.Anthropic(base_url=thinking_server.url, api_key="any", max_retries=0, timeout=120)
    message = sdk.messages.create(model=MODEL_NAME, max_tokens=6, messages=HELLO, extra_body={"temperature": 0})
    kinds = [block.type for block in message.content]
    assert kinds[0] == "thinking", kinds
    thinking = message.content[0].thinking
    with sdk.messages.stream(model=MODEL_NAME, max_tokens=6, messages=HELLO, extra_body={"temperature": 0}) as stream:
        final = stream.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].thinking == thinking
