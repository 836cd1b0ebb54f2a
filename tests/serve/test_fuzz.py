"""Fuzzing the HTTP API: no request body, however wrong or extreme, gets a 5xx, kills the engine,
leaks KV blocks or grows the server's memory.

Two fuzzers against one live tiny-model server on the process transport (so an engine crash or
an OOM kill shows as a dead engine, not as a dead test process):
- schemathesis generates valid and invalid bodies from the server's own /openapi.json for the
  POST endpoints;
- a seeded mutator starts from valid completion, chat, tokenize and detokenize bodies and sets
  every field of the request models in turn to extreme or wrong values (huge and negative ints,
  nan/inf, wrong types, empty and megabyte strings, deep nesting, unicode edge cases), adds
  field-specific attacks (logit_bias keys, thousands of stop strings, n/best_of/logprobs out of
  range) and sends malformed bodies (truncated JSON, not an object, invalid UTF-8, wrong
  content type).
After both: /health is 200, a small completion succeeds, every KV block is free and the RSS of
the front (this process) and of the engine child grew by less than RSS_GROWTH_BOUND.
"""

from __future__ import annotations

import json
import math
import random
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagoda.http_client.sse import iter_sse_events
from pagoda.serve.api.anthropic_protocol import CountTokensRequest, MessagesRequest
from pagoda.serve.api.embeddings import EmbeddingRequest
from pagoda.serve.api.protocol import ChatCompletionRequest, CompletionRequest, DetokenizeRequest, TokenizeRequest
from pagoda.serve.api.responses_protocol import ResponsesRequest
from server_utils import MODEL_NAME, LiveServer, build_tiny_model, start_server

RSS_GROWTH_BOUND = 500 * 2**20  # bytes, per process
MEGABYTE_STRING = "x" * 2**20
FUZZED_PATHS = (
    "/v1/completions",
    "/v1/chat/completions",
    "/tokenize",
    "/detokenize",
    "/v1/messages",
    "/v1/messages/count_tokens",
    "/v1/embeddings",
    "/v1/responses",
)
ANTHROPIC_PATHS = ("/v1/messages", "/v1/messages/count_tokens")  # errors in Anthropic's shape
SCHEMATHESIS_EXAMPLES = 60  # per operation and generation mode

VALID_BODIES: dict[str, dict[str, Any]] = {
    "/v1/completions": {"model": MODEL_NAME, "prompt": "Hello there", "max_tokens": 3, "temperature": 0.0},
    "/v1/chat/completions": {
        "model": MODEL_NAME,
        "max_tokens": 3,
        "temperature": 0.0,
        "messages": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
    },
    "/tokenize": {"model": MODEL_NAME, "prompt": "Hello there"},
    "/detokenize": {"model": MODEL_NAME, "tokens": [1, 2, 3]},
    "/v1/messages": {
        "model": MODEL_NAME,
        "max_tokens": 3,
        "temperature": 0.0,
        "system": "Be brief.",
        "messages": [{"role": "user", "content": "hi"}],
    },
    "/v1/messages/count_tokens": {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hi"}]},
    "/v1/embeddings": {"model": MODEL_NAME, "input": ["Hello there", "hi"], "dimensions": 8},
    "/v1/responses": {
        "model": MODEL_NAME,
        "input": "hi",
        "instructions": "Be brief.",
        "max_output_tokens": 3,
        "temperature": 0.0,
    },
}
REQUEST_MODELS = {
    "/v1/completions": CompletionRequest,
    "/v1/chat/completions": ChatCompletionRequest,
    "/tokenize": TokenizeRequest,
    "/detokenize": DetokenizeRequest,
    "/v1/messages": MessagesRequest,
    "/v1/messages/count_tokens": CountTokensRequest,
    "/v1/embeddings": EmbeddingRequest,
    "/v1/responses": ResponsesRequest,
}

# Values every field is set to in turn: out-of-range numbers, non-finite floats (Python's json
# writes NaN/Infinity, which lenient parsers accept), wrong types, empties, nesting, unicode.
EXTREME_VALUES: list[Any] = [
    2**31,
    2**63,
    2**64,
    10**40,
    -1,
    -(2**63),
    0,
    1e308,
    -1e308,
    5e-324,
    math.nan,
    math.inf,
    -math.inf,
    True,
    None,
    "",
    "0",
    "nan",
    [],
    {},
    [[[]]],
    [["a"], ["b"]],
    {"a": {"b": [1]}},
    [None],
    [1.5, "x"],
    MEGABYTE_STRING,
    ["x"] * 5000,
    "\u0000",
    "\ufffd\uffff\U0010ffff",
    "\u202e\u200b" * 100,
    "😀" * 1000,
    "\ud800",
    "a\udfffb",
]


def rss_bytes(pid: int | str = "self") -> int | None:
    """VmRSS of a process from /proc, or None where /proc or the process is not there."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def engine_pid(live: LiveServer) -> int | None:
    process = getattr(getattr(live.llm, "_transport", None), "process", None)
    return getattr(process, "pid", None)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LiveServer]:
    # A short context keeps the valid requests (n up to 64, any max_tokens) cheap to serve.
    live = start_server(
        build_tiny_model(tmp_path_factory.mktemp("model")), transport="process", engine={"max_model_len": 128}
    )
    yield live
    live.stop()


@pytest.fixture
def recorder(server: LiveServer) -> Iterator[Recorder]:
    recording = Recorder(server)
    yield recording
    recording.client.close()


class Recorder:
    """Sends requests and collects what a fuzz test must never see: a 5xx, a 4xx whose body is
    not OpenAI's error shape, or an error event inside a 200 stream that blames the server."""

    def __init__(self, live: LiveServer) -> None:
        self.live = live
        self.client = httpx.Client(base_url=live.url, timeout=60)
        self.sent = 0
        self.statuses: dict[int, int] = {}
        self.failures: list[str] = []
        self._lock = threading.Lock()  # the concurrent test records from several threads

    def post(
        self, path: str, *, body: Any = None, content: bytes | None = None, headers: dict[str, str] | None = None
    ) -> httpx.Response:
        if content is None:
            content = json.dumps(body).encode()  # ASCII: a lone surrogate becomes a \ud800 escape
        response = self.client.post(
            path, content=content, headers={"content-type": "application/json", **(headers or {})}
        )
        self.check(path, content, response.status_code, response.text, response.headers.get("content-type", ""))
        return response

    def check(self, path: str, content: bytes, status: int, text: str, content_type: str) -> None:
        with self._lock:
            self._check(path, content, status, text, content_type)

    def _check(self, path: str, content: bytes, status: int, text: str, content_type: str) -> None:
        self.sent += 1
        self.statuses[status] = self.statuses.get(status, 0) + 1
        shown = f"POST {path} {content[:300]!r}{' ...' if len(content) > 300 else ''}"
        if status >= 500:
            self.failures.append(f"{status} for {shown}: {text[:300]}")
        elif status >= 400 and path in ANTHROPIC_PATHS:
            try:
                body = json.loads(text)
                shaped = body["type"] == "error" and {"type", "message"} <= set(body["error"])
            except (ValueError, KeyError, TypeError):
                shaped = False
            if not shaped:
                self.failures.append(f"{status} not in Anthropic's error shape for {shown}: {text[:300]}")
        elif status >= 400:
            try:
                error = json.loads(text)["error"]
                shaped = isinstance(error, dict) and {"message", "type", "param", "code"} <= set(error)
            except (ValueError, KeyError, TypeError):
                shaped = False
            if not shaped:
                self.failures.append(f"{status} not in OpenAI's error shape for {shown}: {text[:300]}")
        elif "text/event-stream" in content_type:
            for event in iter_sse_events(text.splitlines()):
                if event.data.startswith("{") and '"error"' in event.data:
                    error = event.json().get("error")
                    if isinstance(error, dict) and error.get("type") not in ("invalid_request_error",):
                        self.failures.append(f"in-stream error for {shown}: {event.line[:300]}")

    def assert_clean(self) -> None:
        assert not self.failures, f"{len(self.failures)} of {self.sent} requests failed:\n" + "\n".join(
            self.failures[:30]
        )


def assert_server_healthy(live: LiveServer, rss_before: dict[str, int | None]) -> None:
    assert live.llm.is_alive, "the engine died during the fuzzing"
    assert httpx.get(live.url + "/health", timeout=30).status_code == 200
    ok = httpx.post(
        live.base_url + "/completions", timeout=60, json={"model": MODEL_NAME, "prompt": "Hello", "max_tokens": 2}
    )
    assert ok.status_code == 200, ok.text
    assert ok.json()["choices"][0]["finish_reason"] in ("length", "stop")
    stats = live.wait_idle(timeout=30)
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_free_blocks == stats.num_total_blocks, "KV blocks leaked"
    for name, after in current_rss(live).items():
        before = rss_before.get(name)
        if before is not None and after is not None:
            assert after - before < RSS_GROWTH_BOUND, f"{name} RSS grew by {(after - before) / 2**20:.0f} MiB"


def current_rss(live: LiveServer) -> dict[str, int | None]:
    pid = engine_pid(live)
    return {"front": rss_bytes(), "engine": rss_bytes(pid) if pid is not None else None}


# ---- schemathesis on /openapi.json --------------------------------------------------------------


def test_schemathesis_bodies_never_get_a_server_error(server: LiveServer, recorder: Recorder) -> None:
    schemathesis = pytest.importorskip("schemathesis", reason="schemathesis is in the test extra")

    rss_before = current_rss(server)
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    started = time.monotonic()
    for path in FUZZED_PATHS:
        operation = schema[path]["POST"]
        for mode in (schemathesis.GenerationMode.POSITIVE, schemathesis.GenerationMode.NEGATIVE):
            strategy = operation.as_strategy(generation_mode=mode)
            if mode is schemathesis.GenerationMode.POSITIVE:
                # A random model name is a 404 before anything else is looked at; serve the
                # positive cases under the real name so they reach sampling and the engine.
                strategy = strategy.map(_served_model_name)
            _fuzz(strategy, path, server, recorder)
    elapsed = time.monotonic() - started
    print(f"schemathesis: {recorder.sent} requests in {elapsed:.1f} s, statuses {recorder.statuses}")
    recorder.assert_clean()
    assert recorder.statuses.get(200, 0) > 0, "no generated body was ever served"
    assert_server_healthy(server, rss_before)


def _fuzz(strategy: Any, path: str, server: LiveServer, recorder: Recorder) -> None:
    """Send the bodies hypothesis draws from `strategy` to `path`, each checked by `recorder`."""
    from hypothesis import HealthCheck, Phase, given, settings

    @given(case=strategy)
    @settings(
        max_examples=SCHEMATHESIS_EXAMPLES,
        deadline=None,
        database=None,
        derandomize=True,
        phases=[Phase.explicit, Phase.generate],
        suppress_health_check=list(HealthCheck),
    )
    def fuzz(case: Any) -> None:
        response = case.call(base_url=server.url, timeout=60)
        recorder.check(
            path, _case_bytes(case), response.status_code, response.text, response.headers.get("content-type", "")
        )

    fuzz()


def _served_model_name(case: Any) -> Any:
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = MODEL_NAME
    return case


def _case_bytes(case: Any) -> bytes:
    try:
        return json.dumps(case.body).encode()
    except (TypeError, ValueError):
        return repr(case.body).encode("utf-8", "surrogatepass")


# ---- the hand-written mutator -------------------------------------------------------------------


def field_mutations(path: str) -> Iterator[dict[str, Any]]:
    """Field overrides for a valid body: every field of the endpoint's request model set to every
    extreme value, then attacks aimed at particular fields or combinations of them."""
    for name in REQUEST_MODELS[path].model_fields:
        for value in EXTREME_VALUES:
            yield {name: value}
    yield from TARGETED.get(path, ())


def _nested(depth: int, leaf: Any) -> Any:
    for _ in range(depth):
        leaf = [leaf]
    return leaf


def _nested_dict(depth: int) -> dict[str, Any]:
    value: dict[str, Any] = {"type": "text", "text": "hi"}
    for _ in range(depth):
        value = {"type": "text", "text": value}
    return value


_SAMPLING_ATTACKS: list[dict[str, Any]] = [
    {"logit_bias": {"99999999999999999999999": 1}},
    {"logit_bias": {"-1": 5}},
    {"logit_bias": {"abc": 1}},
    {"logit_bias": {"1": 1e308}},
    {"logit_bias": {"1": math.nan}},
    {"logit_bias": {"1": "high"}},
    {"logit_bias": {"": 1}},
    {"logit_bias": {"1.5": 1}},
    {"logit_bias": {str(i): 1.0 for i in range(5000)}},
    {"logit_bias": {"1": -100, "2": 100}},
    {"logit_bias": {str(i): -100 for i in range(2048)}, "temperature": 1.0},
    {"stop": [f"s{i}" for i in range(5000)]},
    {"stop": ["y" * 100_000]},
    {"stop": [""]},
    {"stop": "\ud800"},
    {"stop": ["e", " ", "a"], "include_stop_str_in_output": True},
    {"stop_token_ids": list(range(5000))},
    {"stop_token_ids": [2**40]},
    {"stop_token_ids": [-1]},
    {"n": 129},
    {"n": 65},
    {"n": 64},
    {"n": 0},
    {"n": 2**31},
    {"n": 64, "max_tokens": 60, "seed": 7},
    {"max_tokens": 0},
    {"max_tokens": -5},
    {"max_tokens": 2**31},
    {"max_tokens": 100},
    {"seed": 2**64},
    {"seed": -(2**63) - 1},
    {"temperature": 1e-300},
    {"temperature": 1e300},
    {"temperature": math.inf, "top_k": 3},
    {"temperature": 1e-38, "min_p": 0.5},
    {"top_p": 0.0},
    {"top_p": 1.0000001},
    {"top_p": 1e-300},
    {"top_k": -1},
    {"top_k": 2**40},
    {"min_p": 2.0},
    {"min_p": 1.0},
    {"repetition_penalty": 0.0},
    {"repetition_penalty": math.inf},
    {"presence_penalty": -1e308},
    {"frequency_penalty": math.inf},
    {"min_tokens": 2**31},
    {"min_tokens": 200},
    {"min_tokens": 3, "ignore_eos": True},
    {"stream_options": {"include_usage": "yes"}},
    {"stream": "true"},
    {"stream": True, "stream_options": {"include_usage": True}, "n": 8},
    # Unknown fields are allowed (extra="allow") and must stay inert.
    {"prompt_logprobs": 2**31},
    {"guided_json": {"type": "object"}},
    {"__proto__": {"n": 2**31}},
    {"max_num_seqs": 10**9},
    {"priority": -(2**63)},
]
TARGETED: dict[str, list[dict[str, Any]]] = {
    "/v1/completions": _SAMPLING_ATTACKS
    + [
        {"best_of": 2**31},
        {"best_of": 129},
        {"best_of": 0},
        {"best_of": 1},
        {"best_of": 4, "n": 2},
        {"logprobs": 21},
        {"logprobs": -1},
        {"logprobs": 2**63},
        {"logprobs": 20},
        {"logprobs": 20, "echo": True, "n": 16, "stream": True},
        {"logprobs": 20, "echo": True, "prompt": [[1, 2, 3]] * 40},
        {"prompt": [[]]},
        {"prompt": [2**40]},
        {"prompt": [-1, 5]},
        {"prompt": [[1, 2], [2**63]]},
        {"prompt": ["a"] * 3000},
        {"prompt": ["a"] * 2048, "max_tokens": 1},
        {"prompt": list(range(5000))},
        {"prompt": [1.5]},
        {"prompt": _nested(50, "x")},
        {"prompt": ["", "a"]},
        {"prompt": "\u0000" * 100},
        {"echo": True, "max_tokens": 1},
        {"suffix": MEGABYTE_STRING},
        {"use_beam_search": True, "best_of": 10, "n": 10, "max_tokens": 3},
        {"use_beam_search": True, "best_of": 2**40},
        {"use_beam_search": True, "length_penalty": math.inf},
        {"use_beam_search": True, "early_stopping": [1]},
        {"use_beam_search": True, "max_tokens": 2**40},
        {"use_beam_search": True, "prompt": [[]]},
        {"use_beam_search": True, "prompt": [2**40]},
        {"use_beam_search": True, "stream": True},
    ],
    "/v1/messages": [
        {"max_tokens": 2**63},
        {"max_tokens": 0},
        {"top_k": -5},
        {"top_p": 7},
        {"stream": True, "max_tokens": 2},
        {"stop_sequences": [""] * 50},
        {"system": [{"type": "image"}]},
        {"system": [{"type": "text"}]},
        {"messages": [{"role": "user", "content": [{"type": "tool_result"}]}]},
        {"messages": [{"role": "assistant", "content": [{"type": "tool_use", "id": "t", "name": "f", "input": [1]}]}]},
        {"messages": [{"role": "user", "content": [{"type": "tool_use", "id": "t", "name": "f"}]}]},
        {"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}] * 2000}]},
        {"tools": [{"name": "f"}]},
        {"tools": [{"name": "f", "input_schema": {"type": "wat"}}]},
        {"tools": [{"name": "f", "input_schema": {}}], "tool_choice": {"type": "tool"}},
        {"tool_choice": {"type": "any"}},
        {"thinking": {"type": "enabled", "budget_tokens": -1}},
        {"output_config": {"format": {}}},
    ],
    "/v1/responses": [
        {"max_output_tokens": 2**63},
        {"max_output_tokens": 0},
        {"top_p": 7},
        {"temperature": -1},
        {"stream": True, "max_output_tokens": 2},
        {"store": False},
        {"previous_response_id": "resp-x" * 1000},
        {"previous_response_id": ""},
        {"input": []},
        {"input": [{}]},
        {"input": [{"type": 5}]},
        {"input": [{"role": "user"}]},
        {"input": [{"role": "wizard", "content": "hi"}]},
        {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
        {"input": [{"role": "user", "content": [{"type": "input_audio", "input_audio": {}}]}]},
        {"input": [{"role": "user", "content": [{"type": "input_text"}]}]},
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "hi"}] * 2000}]},
        {"input": [{"role": "user", "content": "hi"}] * 9000},
        {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{nope"}]},
        {
            "input": [
                {"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"},
                {"type": "function_call_output", "call_id": "c", "output": "x"},
            ]
        },
        {"input": [{"type": "function_call", "call_id": "c", "name": "f", "arguments": "[" * 100_000 + "]" * 100_000}]},
        {"input": [{"type": "function_call_output", "call_id": "c", "output": [{"type": "input_file"}]}]},
        {"input": [{"type": "item_reference", "id": "x"}]},
        {"input": [{"type": "reasoning", "summary": []}]},
        {"tools": [{"type": "function"}]},
        {"tools": [{"type": "function", "name": "f", "parameters": 5}]},
        {"tools": [{"type": "function", "name": "f", "parameters": {"type": "wat"}}]},
        {"tools": [{"type": "web_search"}]},
        {"tools": [{"type": "function", "name": "f"}], "tool_choice": "required"},
        {"tool_choice": "required"},
        {"tool_choice": {"type": "allowed_tools"}},
        {"tool_choice": "sometimes"},
        {"text": {"format": {"type": "json_schema"}}},
        {"text": {"format": {"type": "json_schema", "schema": 5}}},
        {"text": {"format": {"type": "json_schema", "name": "x", "schema": {"type": "object"}}}},
        {"text": {"format": {"type": "grammar"}}},
        {"text": {"format": {}}},
        {"text": {"verbosity": "low"}},
        {"background": True},
        {"truncation": "auto"},
        {"top_logprobs": 20},
        {"reasoning": {"effort": "high"}},
    ],
    "/v1/chat/completions": _SAMPLING_ATTACKS
    + [
        {"logprobs": True, "top_logprobs": 21},
        {"logprobs": True, "top_logprobs": -1},
        {"logprobs": True, "top_logprobs": 2**63},
        {"logprobs": True, "top_logprobs": 20, "n": 16},
        {"top_logprobs": 20},
        {"max_completion_tokens": 2**63},
        {"max_completion_tokens": -1},
        {"max_completion_tokens": 5, "max_tokens": 2**63},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}] * 2000}]},
        {"messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}] * 1024}]},
        {"messages": [{"role": "user", "content": "hi"}] * 9000},
        {"messages": [{"role": "user", "content": _nested(200, "deep")}]},
        {"messages": [{"role": "user", "content": [_nested_dict(200)]}]},
        {"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]},
        {"messages": [{"role": "user", "content": [{"type": "text"}]}]},
        {"messages": [{"role": "wizard", "content": "hi"}]},
        {"messages": [{"content": "hi"}]},
        {"messages": [{"role": "user", "content": None}]},
        {"messages": [{"role": "assistant"}]},
        {"messages": [{"role": "system", "content": "only a system message"}]},
        {"messages": [{"role": "assistant", "content": "x"}] * 3, "add_generation_prompt": False},
        {"messages": [{"role": "user", "content": "\ud800\udc00\udbff"}]},
        {"messages": [{"role": "user", "content": "{{ raise_exception('x') }}{% for %}"}]},
        {"messages": [{"role": "user", "content": "hi", "name": {"x": 1}}]},
        {"messages": [{"role": "user", "content": "hi", "tool_calls": [{"id": 1}]}]},
        {"response_format": {"type": "json_schema"}},
        {"tools": [{"type": "function"}]},
        {"tool_choice": {"type": "function", "function": {"name": "nope"}}},
        {"logprobs": True},
        {"functions": [{"name": "f"}], "function_call": {"name": "f"}},
        {"functions": [None]},
        {"functions": [{"name": "f", "parameters": "x"}]},
        {"function_call": {"name": 1}},
        {"messages": [{"role": "assistant", "content": "x"}], "continue_final_message": True},
        {"continue_final_message": True, "add_generation_prompt": True},
        {"chat_template": "{% for %}"},
        {"priority": 2**70},
        {"priority": -1},
        {"use_beam_search": True},
    ],
    "/tokenize": [
        {"messages": [{"role": "user", "content": "hi"}]},
        {"messages": [{"role": "user", "content": "hi"}], "prompt": None},
        {"messages": [{"role": "user", "content": _nested(200, "deep")}], "prompt": None},
        {"prompt": "\ud800"},
        {"prompt": MEGABYTE_STRING, "return_token_strs": True},
    ],
    "/detokenize": [
        {"tokens": [2**31]},
        {"tokens": [-1]},
        {"tokens": [2**63]},
        {"tokens": list(range(8000))},
        {"tokens": [[1]]},
        {"tokens": [1.5]},
        {"tokens": []},
    ],
}


def malformed_requests() -> Iterator[tuple[bytes, dict[str, str]]]:
    """Raw bodies and headers that are not a well-formed JSON object of the right type."""
    valid = json.dumps(VALID_BODIES["/v1/completions"]).encode()
    json_type = {"content-type": "application/json"}
    for cut in (0, 1, len(valid) // 2, len(valid) - 1):
        yield valid[:cut], json_type
    for raw in (
        b"[]",
        b"1",
        b"null",
        b'"a string"',
        b"true",
        b"{",
        b"}",
        b"{,}",
        b"{'a': 1}",
        b'{"prompt": "a"} trailing',
        b"\x00\x01\x02",
        b"\xff\xfe{}",
        b"\xef\xbb\xbf{}",
        b'{"prompt": "a\xed\xa0\x80b", "max_tokens": 1}',  # raw lone surrogate
        b'{"prompt": "\xc3\x28", "max_tokens": 1}',  # invalid UTF-8
        b'{"prompt": "\\ud800", "max_tokens": 1}',  # escaped lone surrogate
        b'{"prompt": "a", "prompt": 5}',
        b'{"max_tokens": 1e999, "prompt": "a"}',
        b'{"prompt": "a", "max_tokens": 1' + b"0" * 5000 + b"}",
        b"[" * 100_000 + b"]" * 100_000,
        b'{"a":' * 50_000 + b"1" + b"}" * 50_000,
    ):
        yield raw, json_type
    for content_type in (
        "text/plain",
        "application/x-www-form-urlencoded",
        "multipart/form-data",
        "application/json; charset=latin-1",
        "",
    ):
        yield valid, {"content-type": content_type}
    yield b"prompt=hi&max_tokens=2", {"content-type": "application/x-www-form-urlencoded"}
    yield valid, {"content-type": "application/json", "content-encoding": "gzip"}


def random_bodies(rng: random.Random, path: str, count: int) -> Iterator[dict[str, Any]]:
    """Bodies with two to four fields mutated at once, from the same value pool."""
    pool = list(field_mutations(path))
    for _ in range(count):
        body = dict(VALID_BODIES[path])
        for overrides in rng.sample(pool, rng.randint(2, 4)):
            if rng.random() < 0.15:
                for name in overrides:
                    body.pop(name, None)
            else:
                body.update(overrides)
        yield body


def busy_bodies(rng: random.Random, path: str, count: int) -> Iterator[dict[str, Any]]:
    """Valid bodies with random in-range sampling settings: the work the engine runs (and
    aborts on a disconnect) while the invalid bodies are refused around it."""
    for _ in range(count):
        body = {
            **VALID_BODIES[path],
            "n": rng.randint(1, 8),
            "max_tokens": rng.randint(1, 60),
            "temperature": rng.choice([0.0, 0.7, 1.5]),
            "seed": rng.randint(0, 2**32),
            "top_k": rng.choice([-1, 1, 40]),
            "stop": rng.choice([None, ["a", "e"]]),
        }
        if path == "/v1/completions":
            body["logprobs"] = rng.choice([None, 0, 5, 20])
        else:
            body.update(rng.choice([{}, {"logprobs": True, "top_logprobs": rng.randint(0, 20)}]))
        yield body


def test_mutated_bodies_never_get_a_server_error(server: LiveServer, recorder: Recorder) -> None:
    rss_before = current_rss(server)
    rng = random.Random(1312)
    started = time.monotonic()
    for path in FUZZED_PATHS:
        for overrides in field_mutations(path):
            recorder.post(path, body={**VALID_BODIES[path], **overrides})
        for body in random_bodies(rng, path, 60):
            recorder.post(path, body=body)
        recorder.post(path, body=VALID_BODIES[path])  # the valid body itself still works
    for path in FUZZED_PATHS:
        for content, headers in malformed_requests():
            recorder.post(path, content=content, headers=headers)
    elapsed = time.monotonic() - started
    print(f"mutator: {recorder.sent} requests in {elapsed:.1f} s, statuses {recorder.statuses}")
    recorder.assert_clean()
    assert recorder.statuses.get(200, 0) > 0 and recorder.statuses.get(400, 0) > 0
    assert_server_healthy(server, rss_before)


def test_concurrent_mutated_streams_and_disconnects_leave_nothing_behind(
    server: LiveServer, recorder: Recorder
) -> None:
    """Mutated bodies from eight clients at once, half streamed and a third of those dropped
    after the first chunk: admission, validation and aborts under concurrency."""
    rss_before = current_rss(server)
    rng = random.Random(2026)
    bodies = [
        (path, body)
        for path in FUZZED_PATHS[:2]
        for body in [*random_bodies(rng, path, 60), *busy_bodies(rng, path, 40)]
    ]
    rng.shuffle(bodies)
    jobs = [(path, body, rng.random() < 0.5, rng.random() < 0.33) for path, body in bodies]

    def send(job: tuple[str, dict[str, Any], bool, bool]) -> None:
        path, body, stream, disconnect = job
        if not stream:
            recorder.post(path, body=body)
            return
        content = json.dumps({**body, "stream": True}).encode()
        with recorder.client.stream(
            "POST", path, content=content, headers={"content-type": "application/json"}
        ) as response:
            if disconnect and response.status_code == 200:
                next(response.iter_bytes(), None)  # then close the connection mid-stream
                recorder.check(path, content, 200, "", "")
                return
            response.read()
            recorder.check(path, content, response.status_code, response.text, response.headers.get("content-type", ""))

    started = time.monotonic()
    with ThreadPoolExecutor(8) as pool:
        list(pool.map(send, jobs))
    elapsed = time.monotonic() - started
    print(f"concurrent: {recorder.sent} requests in {elapsed:.1f} s, statuses {recorder.statuses}")
    recorder.assert_clean()
    assert recorder.statuses.get(200, 0) >= 60
    assert_server_healthy(server, rss_before)


@pytest.mark.parametrize("stream", [False, True])
def test_client_leaving_while_a_big_batch_is_submitted_aborts_all_of_it(server: LiveServer, stream: bool) -> None:
    """Regression: the prompts of a batch were submitted one engine round trip each, with no
    one listening for a disconnect, so a client that gave up on 1024 prompts x n=4 left the
    engine busy with all of them for a minute and more."""
    body = {"model": MODEL_NAME, "prompt": ["a b c"] * 1024, "n": 4, "max_tokens": 50, "stream": stream}
    with httpx.Client(timeout=1.5) as client:
        try:
            with client.stream("POST", server.base_url + "/completions", json=body) as response:
                next(response.iter_bytes(), None)  # a stream's first chunk, then hang up
        except httpx.TimeoutException:
            pass  # the client gave up waiting
    stats = server.wait_idle(timeout=10)
    assert (stats.num_running, stats.num_waiting) == (0, 0)
    assert stats.num_free_blocks == stats.num_total_blocks
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
