"""json_body.py writes, in steps, exactly the bytes starlette's JSONResponse writes at once."""

from __future__ import annotations

import random
from typing import Any

import pytest
from starlette.responses import JSONResponse

import pagoda.serve.api.json_body as json_body
from pagoda.serve.api.json_body import estimated_nodes, json_text, model_json
from pagoda.serve.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionResponse,
    ChatTokenLogprob,
    CompletionChoice,
    CompletionLogprobs,
    CompletionResponse,
    TokenizeResponse,
    TopLogprob,
    Usage,
)

USAGE = Usage(prompt_tokens=3, completion_tokens=4, total_tokens=7)
TEXTS = ["plain", 'é\u2028"quoted"\n\ttab', "\\", "", "日本語", "\x00\x1f", "emoji 🙂"]


@pytest.fixture(params=[4, 64, json_body.STEP_NODES], ids=["tiny-steps", "small-steps", "default"])
def step_nodes(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> int:
    monkeypatch.setattr(json_body, "STEP_NODES", request.param)
    return request.param


def completion(rng: random.Random, num_choices: int, num_tokens: int) -> CompletionResponse:
    choices = []
    for index in range(num_choices):
        logprobs = CompletionLogprobs(
            tokens=[rng.choice(TEXTS) for _ in range(num_tokens)],
            token_logprobs=[None] + [-rng.random() * 10 for _ in range(num_tokens - 1)],
            top_logprobs=[None]
            + [{f"{rng.choice(TEXTS)}{k}": -rng.random() * 1e-6 for k in range(5)} for _ in range(num_tokens - 1)],
            text_offset=list(range(num_tokens)),
        )
        choices.append(
            CompletionChoice(
                index=index,
                text=rng.choice(TEXTS) * 50,
                logprobs=logprobs,
                finish_reason=rng.choice(["length", "stop", None]),
            )
        )
    return CompletionResponse(id="cmpl-1", created=1, model="m", choices=choices, usage=USAGE)


def chat(rng: random.Random, num_choices: int, num_tokens: int) -> ChatCompletionResponse:
    def entry() -> ChatTokenLogprob:
        text = rng.choice(TEXTS)
        return ChatTokenLogprob(
            token=text,
            logprob=-0.0 if rng.random() < 0.1 else -rng.random(),
            bytes=list(text.encode()),
            top_logprobs=[TopLogprob(token=t, logprob=-rng.random(), bytes=None) for t in rng.sample(TEXTS, 3)],
        )

    choices = [
        ChatChoice(
            index=index,
            message=AssistantMessage(
                content=rng.choice(TEXTS),
                tool_calls=[{"id": "c", "function": {"arguments": {"x": [1, 2.5]}}}] if index % 2 else None,
            ),
            logprobs=ChatChoiceLogprobs(content=[entry() for _ in range(num_tokens)]),
            finish_reason="stop",
        )
        for index in range(num_choices)
    ]
    return ChatCompletionResponse(id="chat-1", created=1, model="m", choices=choices, usage=USAGE)


@pytest.mark.parametrize("build", [completion, chat])
@pytest.mark.parametrize("num_choices,num_tokens", [(0, 0), (1, 1), (3, 40), (12, 200)])
def test_models_are_written_as_jsonresponse_writes_them(
    step_nodes: int, build: Any, num_choices: int, num_tokens: int
) -> None:
    model = build(random.Random(num_choices * 1000 + num_tokens), num_choices, num_tokens)
    assert model_json(model).encode() == JSONResponse(model.model_dump()).body


def test_plain_data_and_ready_members(step_nodes: int) -> None:
    data: dict[str, Any] = {
        "ints": list(range(500)),
        "floats": [1e-7, -0.0, 2.5e300, 1 / 3] * 50,
        "none": None,
        "map": {f"k{i}": [i, {"deep": TEXTS}] for i in range(300)},
        "numeric keys": {1: "a", 2.5: "b"},
        "tuple": tuple(range(100)),
        "empty": [[], {}, ""],
        "long text": "x\u2028" * 100_000,
    }
    assert json_text(data).encode() == JSONResponse(data).body
    ready = json_text(data, ready_members={"ints": "[0]", "map": "{}"})
    assert ready.encode() == JSONResponse({**data, "ints": [0], "map": {}}).body
    tokens = TokenizeResponse(count=3, max_model_len=9, tokens=[1, 2, 3], token_strs=TEXTS[:3])
    assert model_json(tokens).encode() == JSONResponse(tokens.model_dump()).body


def test_not_a_number_is_refused_as_jsonresponse_refuses_it(step_nodes: int) -> None:
    data = {"values": [0.5] * 1000 + [float("nan")]}
    with pytest.raises(ValueError):
        JSONResponse(data)
    with pytest.raises(ValueError):
        json_text(data)


def test_estimates_see_inside_records_and_sample_long_lists() -> None:
    record = {"id": "x", "object": "o", "created": 1, "choices": [{"v": list(range(1000))}] * 50}
    assert estimated_nodes(record) > 50 * 1000
    assert estimated_nodes("y" * 6400) == 1 + 6400 // json_body.STRING_CHARS_PER_NODE
    assert estimated_nodes(completion(random.Random(0), 4, 100)) > 4 * 100 * 5
