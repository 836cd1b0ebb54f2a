"""Typed request errors: InvalidRequest carries param and code from where it is raised
(SamplingParams, the engine's request checks, the tokenizer's message checks) to OpenAI's
error body, with no guessing on the way."""

from __future__ import annotations

import pickle

import httpx
import pytest

from pagoda.config import EngineConfig
from pagoda.engine.threads import engine_thread_count
from pagoda.engine.validation import EngineLimits, validate_request
from pagoda.errors import InvalidRequest
from pagoda.sampling_params import SamplingParams
from pagoda.serve.errors import invalid_request
from pagoda.tokenizer import normalize_messages
from server_utils import MODEL_NAME, LiveServer, build_tiny_model, start_server

LIMITS = EngineLimits(
    max_model_len=512,
    vocab_size=1000,
    num_kv_blocks=64,
    block_size=16,
    max_num_batched_tokens=256,
    enable_chunked_prefill=True,
)


def raised(call, *args, **kwargs) -> InvalidRequest:
    with pytest.raises(InvalidRequest) as info:
        call(*args, **kwargs)
    return info.value


@pytest.mark.parametrize(
    "fields, param",
    [
        ({"top_p": 1.5}, "top_p"),
        ({"n": 0}, "n"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"min_tokens": 5, "max_tokens": 2}, "min_tokens"),
        ({"logprobs": 99}, "logprobs"),
        ({"stop": [""]}, "stop"),
    ],
)
def test_sampling_params_name_the_field(fields: dict, param: str) -> None:
    error = raised(SamplingParams, **fields)
    assert error.param == param and isinstance(error, ValueError)


@pytest.mark.parametrize(
    "prompt, fields, limits, param, code",
    [
        ([], {}, LIMITS, "prompt", None),
        ([1, 5000], {}, LIMITS, "prompt", None),
        ([1, -1], {}, LIMITS, "prompt", None),
        ([1] * 600, {"max_tokens": 4}, LIMITS, "prompt", "context_length_exceeded"),
        ([1] * 512, {"max_tokens": None}, LIMITS, "prompt", "context_length_exceeded"),
        ([1] * 100, {"max_tokens": 500}, LIMITS, "max_tokens", "context_length_exceeded"),
        ([1] * 10, {"logit_bias": {5000: 1.0}}, LIMITS, "logit_bias", None),
        (
            [1] * 10,
            {"max_tokens": 100},
            EngineLimits(
                512, 1000, num_kv_blocks=4, block_size=16, max_num_batched_tokens=256, enable_chunked_prefill=True
            ),
            "max_tokens",
            None,
        ),
        (
            [1] * 300,
            {"max_tokens": 4},
            EngineLimits(
                512, 1000, num_kv_blocks=64, block_size=16, max_num_batched_tokens=256, enable_chunked_prefill=False
            ),
            "prompt",
            None,
        ),
    ],
)
def test_engine_checks_name_the_field(prompt, fields, limits, param, code) -> None:
    error = raised(validate_request, prompt, SamplingParams(**fields), limits)
    assert (error.param, error.code) == (param, code)


def test_valid_request_returns_its_output_budget() -> None:
    assert validate_request([1] * 100, SamplingParams(max_tokens=None), LIMITS) == 412
    assert validate_request([1] * 100, SamplingParams(max_tokens=7), LIMITS) == 7


def test_error_survives_the_engine_process_pipe() -> None:
    error = pickle.loads(pickle.dumps(InvalidRequest("too long", param="prompt", code="c")))
    assert (error.message, error.param, error.code) == ("too long", "prompt", "c")


def test_messages_are_normalized_once() -> None:
    messages = normalize_messages(
        [
            {"role": "developer", "content": [{"type": "text", "text": "a"}, {"type": "text", "text": "b"}]},
            {"role": "user", "content": None},
        ]
    )
    assert messages == [{"role": "system", "content": "a\nb"}, {"role": "user", "content": ""}]
    for bad in ([], [{"role": "user", "content": [{"type": "image_url"}]}], ["x"]):
        assert raised(normalize_messages, bad).param == "messages"
    assert raised(normalize_messages, [{"role": "wizard", "content": "x"}], roles=("user",)).param == "messages"


def test_server_maps_and_renames() -> None:
    error = invalid_request(InvalidRequest("m", param="prompt", code="context_length_exceeded"), {"prompt": "messages"})
    assert error.status == 400 and error.body()["error"] == {
        "message": "m",
        "type": "invalid_request_error",
        "param": "messages",
        "code": "context_length_exceeded",
    }
    assert invalid_request(InvalidRequest("m", param="top_p")).param == "top_p"


def test_thread_policy_has_one_owner(tmp_path) -> None:
    assert engine_thread_count(EngineConfig(model=str(tmp_path), num_threads=3), serving=False) == 3
    assert engine_thread_count(EngineConfig(model=str(tmp_path)), serving=False) is None
    assert engine_thread_count(EngineConfig(model=str(tmp_path)), serving=True) >= 1


# ---- over HTTP ---------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    live = start_server(build_tiny_model(tmp_path_factory.mktemp("model")))
    yield live
    live.stop()


def test_prompt_alone_over_the_context_names_the_prompt(server: LiveServer) -> None:
    with httpx.Client(base_url=server.base_url, timeout=30) as http:
        long_prompt = [5] * 600  # the tiny model's context is 512
        completion = http.post("/completions", json={"model": MODEL_NAME, "prompt": long_prompt})
        error = completion.json()["error"]
        assert completion.status_code == 400 and error["param"] == "prompt"
        assert error["code"] == "context_length_exceeded" and "512" in error["message"]
        words = " ".join(["word"] * 700)
        chat = http.post(
            "/chat/completions",
            json={"model": MODEL_NAME, "messages": [{"role": "user", "content": words}], "max_tokens": 2},
        )
        assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"
        too_many = http.post(
            "/chat/completions",
            json={"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}], "max_completion_tokens": 600},
        )
        assert too_many.json()["error"]["param"] == "max_completion_tokens"
        assert too_many.json()["error"]["code"] == "context_length_exceeded"
    assert server.wait_idle().num_running == 0
