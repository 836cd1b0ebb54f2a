"""OpenAI's Responses API through the `openai` SDK: create and stream (the event sequence the
SDK parses), usage with cached tokens, a tool loop with function_call_output, structured output
by text.format, previous_response_id, stored responses per tenant (GET / DELETE, bounds,
--no-responses-store), reasoning items, and errors in OpenAI's shape."""

from __future__ import annotations

import json
from pathlib import Path

import httpx
import pytest

from pagoda.serve.admission.tenants import Tenant, TenantRegistry
from pagoda.serve.api.responses_store import ResponsesStore
from pagoda.serve.errors import APIError
from reasoning_model import build_reasoning_model
from server_utils import MODEL_NAME, LiveServer, start_server

openai = pytest.importorskip("openai", reason="the openai SDK is in the test extra")
jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the test extra")

ALICE, BOB = "key-alice", "key-bob"
WEATHER = {
    "type": "function",
    "name": "get_weather",
    "description": "Weather of a city",
    "parameters": {
        "type": "object",
        "additionalProperties": False,
        "required": ["city"],
        "properties": {"city": {"type": "string", "maxLength": 8}},
    },
}
LONG_PROMPT = "Tell me a story about a lighthouse keeper and the sea, " * 6


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_reasoning_model(tmp_path_factory.mktemp("responses"), opens_thinking=True)


@pytest.fixture(scope="module")
def server(model_dir: Path) -> LiveServer:
    tenants = TenantRegistry({ALICE: Tenant("alice"), BOB: Tenant("bob")})
    live = start_server(model_dir, tenants=tenants, responses_store_size=4)
    yield live
    live.stop()


def client(server: LiveServer, key: str = ALICE) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=120)


def test_create_and_stream_agree(server: LiveServer) -> None:
    sdk = client(server)
    response = sdk.responses.create(
        model=MODEL_NAME, input="Hello", instructions="Be brief.", max_output_tokens=8, temperature=0
    )
    assert response.object == "response" and response.model == MODEL_NAME
    assert response.status in ("completed", "incomplete")
    if response.status == "incomplete":
        assert response.incomplete_details.reason == "max_output_tokens"
    assert [item.type for item in response.output] == ["message"]
    assert response.usage.output_tokens <= 8 and response.usage.input_tokens > 0
    assert response.usage.total_tokens == response.usage.input_tokens + response.usage.output_tokens
    with sdk.responses.stream(
        model=MODEL_NAME, input="Hello", instructions="Be brief.", max_output_tokens=8, temperature=0
    ) as stream:
        events = list(stream)
        final = stream.get_final_response()
    streamed = "".join(event.delta for event in events if event.type == "response.output_text.delta")
    assert streamed == response.output_text == final.output_text
    assert final.status == response.status and final.usage.output_tokens == response.usage.output_tokens
    kinds = [event.type for event in events]
    assert kinds[:4] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
    ]
    assert kinds[-4:] == [
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.completed",
    ]
    assert [event.sequence_number for event in events] == list(range(len(events)))


def test_stream_true_and_cached_tokens(server: LiveServer) -> None:
    sdk = client(server)
    first = sdk.responses.create(model=MODEL_NAME, input=LONG_PROMPT, max_output_tokens=2, store=False)
    kinds = [
        event.type
        for event in sdk.responses.create(model=MODEL_NAME, input=LONG_PROMPT, max_output_tokens=2, stream=True)
    ]
    assert kinds[0] == "response.created" and kinds[-1] == "response.completed"
    again = sdk.responses.create(model=MODEL_NAME, input=LONG_PROMPT, max_output_tokens=2, store=False)
    assert again.usage.input_tokens == first.usage.input_tokens
    assert again.usage.input_tokens_details.cached_tokens > 0


def test_tool_loop_with_function_call_output(server: LiveServer) -> None:
    sdk = client(server)
    conversation: list = [{"role": "user", "content": "Weather in Oslo?"}]
    for _ in range(2):
        response = sdk.responses.create(
            model=MODEL_NAME,
            input=conversation,
            tools=[WEATHER],
            tool_choice="required",
            max_output_tokens=64,
            temperature=1.0,
        )
        calls = [item for item in response.output if item.type == "function_call"]
        assert calls and calls[0].name == "get_weather", response.output
        jsonschema.validate(json.loads(calls[0].arguments), WEATHER["parameters"])
        conversation += [item.model_dump() for item in response.output]
        conversation.append({"type": "function_call_output", "call_id": calls[0].call_id, "output": "Sunny, 21 C"})
    with sdk.responses.stream(
        model=MODEL_NAME,
        input=conversation,
        tools=[WEATHER],
        max_output_tokens=64,
        tool_choice={"type": "function", "name": "get_weather"},
    ) as stream:
        kinds = [event.type for event in stream]
        final = stream.get_final_response()
    assert "response.function_call_arguments.delta" in kinds
    call = next(item for item in final.output if item.type == "function_call")
    jsonschema.validate(json.loads(call.arguments), WEATHER["parameters"])
    none = sdk.responses.create(
        model=MODEL_NAME, input="Hello", tools=[WEATHER], tool_choice="none", max_output_tokens=4
    )
    assert all(item.type == "message" for item in none.output)


def test_text_format_json_schema(server: LiveServer) -> None:
    schema = {
        "type": "object",
        "additionalProperties": False,
        "required": ["answer"],
        "properties": {"answer": {"enum": ["yes", "no"]}},
    }
    response = client(server).responses.create(
        model=MODEL_NAME,
        input="Yes or no?",
        max_output_tokens=32,
        text={"format": {"type": "json_schema", "name": "verdict", "schema": schema, "strict": True}},
    )
    jsonschema.validate(json.loads(response.output_text), schema)


def test_previous_response_id_continues_the_conversation(server: LiveServer) -> None:
    sdk = client(server)
    first = sdk.responses.create(model=MODEL_NAME, input="My name is Ada.", max_output_tokens=4)
    assert first.store is True
    second = sdk.responses.create(
        model=MODEL_NAME, input="What is my name?", max_output_tokens=4, previous_response_id=first.id
    )
    alone = sdk.responses.create(model=MODEL_NAME, input="What is my name?", max_output_tokens=4)
    assert second.previous_response_id == first.id
    assert second.usage.input_tokens > alone.usage.input_tokens  # the history was rendered too
    third = sdk.responses.create(
        model=MODEL_NAME, input="And again?", max_output_tokens=4, previous_response_id=second.id
    )
    assert third.usage.input_tokens > second.usage.input_tokens
    with pytest.raises(openai.NotFoundError):
        sdk.responses.create(model=MODEL_NAME, input="hi", previous_response_id="resp-unknown")


def test_stored_responses_belong_to_their_tenant(server: LiveServer) -> None:
    alice, bob = client(server, ALICE), client(server, BOB)
    response = alice.responses.create(model=MODEL_NAME, input="Hello", max_output_tokens=3)
    assert alice.responses.retrieve(response.id).output_text == response.output_text
    for attempt in (
        lambda: bob.responses.retrieve(response.id),
        lambda: bob.responses.delete(response.id),
        lambda: bob.responses.create(model=MODEL_NAME, input="hi", previous_response_id=response.id),
    ):
        with pytest.raises(openai.NotFoundError) as raised:
            attempt()
        assert raised.value.body["type"] == "not_found_error"
    alice.responses.delete(response.id)
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(response.id)
    unstored = alice.responses.create(model=MODEL_NAME, input="Hello", max_output_tokens=2, store=False)
    assert unstored.store is False
    with pytest.raises(openai.NotFoundError):
        alice.responses.retrieve(unstored.id)


def test_store_keeps_the_newest_responses(server: LiveServer) -> None:
    sdk = client(server)
    ids = [sdk.responses.create(model=MODEL_NAME, input=f"Hello {i}", max_output_tokens=1).id for i in range(5)]
    with pytest.raises(openai.NotFoundError):  # --responses-store-size 4
        sdk.responses.retrieve(ids[0])
    assert sdk.responses.retrieve(ids[-1]).id == ids[-1]


def test_store_ttl_and_size() -> None:
    now = [0.0]
    store = ResponsesStore(max_entries=2, ttl_s=10, clock=lambda: now[0])
    for name in ("a", "b", "c"):
        store.put(name, "alice", [], {"id": name})
    assert len(store) == 2
    with pytest.raises(APIError) as raised:
        store.get("alice", "a")
    assert raised.value.status == 404
    now[0] = 11
    with pytest.raises(APIError):
        store.get("alice", "c")
    assert len(store) == 0
    with pytest.raises(ValueError):
        ResponsesStore(max_entries=0, ttl_s=1)


def test_no_responses_store(model_dir: Path) -> None:
    live = start_server(model_dir, responses_store=False)
    try:
        sdk = client(live)
        response = sdk.responses.create(model=MODEL_NAME, input="Hello", max_output_tokens=2)
        assert response.store is False
        with pytest.raises(openai.NotFoundError):
            sdk.responses.retrieve(response.id)
        with pytest.raises(openai.BadRequestError) as raised:
            sdk.responses.create(model=MODEL_NAME, input="hi", previous_response_id=response.id)
        assert raised.value.body["param"] == "previous_response_id"
    finally:
        live.stop()


def test_reasoning_items(model_dir: Path) -> None:
    """The R1-style template opens <think> in the prompt: a short random output never closes it,
    so the output is one reasoning item, streamed or not."""
    live = start_server(model_dir, reasoning_parser="deepseek_r1")
    try:
        sdk = client(live)
        response = sdk.responses.create(model=MODEL_NAME, input="Hello", max_output_tokens=6, temperature=0)
        assert [item.type for item in response.output] == ["reasoning"]
        thinking = response.output[0].content[0].text
        assert 0 < response.usage.output_tokens_details.reasoning_tokens <= 6
        with sdk.responses.stream(model=MODEL_NAME, input="Hello", max_output_tokens=6, temperature=0) as stream:
            deltas = "".join(e.delta for e in stream if e.type == "response.reasoning_text.delta")
            final = stream.get_final_response()
        assert deltas == thinking == final.output[0].content[0].text
    finally:
        live.stop()


@pytest.mark.parametrize(
    "body, status, param",
    [
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:x"}]}]},
            400,
            "input[0].content[0]",
        ),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, 400, "input[0]"),
        ({"input": [{"type": "web_search_call", "id": "ws_1"}]}, 400, "input[0].type"),
        ({"input": []}, 400, "input"),
        ({"input": "hi", "tools": [{"type": "web_search"}]}, 400, "tools[0].type"),
        ({"input": "hi", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, 400, "tool_choice"),
        (
            {"input": "hi", "text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "wat"}}}},
            400,
            "text.format.schema",
        ),
        ({"input": "hi", "max_output_tokens": 0}, 400, "max_output_tokens"),
        ({"input": "hi", "background": True}, 400, "background"),
        ({"input": "hi", "previous_response_id": "resp-nope"}, 404, "previous_response_id"),
        ({"model": "gpt-nope", "input": "hi"}, 404, "model"),
        ({"input": 5}, 400, "input"),
    ],
)
def test_errors_in_openai_shape(server: LiveServer, body: dict, status: int, param: str) -> None:
    response = httpx.post(
        server.base_url + "/responses",
        json={"model": MODEL_NAME, **body},
        headers={"Authorization": f"Bearer {ALICE}"},
        timeout=60,
    )
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["param"] == param, error
