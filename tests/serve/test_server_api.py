"""The OpenAI-compatible API as the official `openai` client sees it."""

from __future__ import annotations

import httpx
import openai
import pytest

from server_utils import MODEL_NAME, LiveServer, build_tiny_model, start_server

PROMPT = "def fibonacci(n):\n    if n < 2:"
MESSAGES = [
    {"role": "system", "content": "You write Python."},
    {"role": "user", "content": "Print the squares of 0 to 9."},
]


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    live = start_server(build_tiny_model(tmp_path_factory.mktemp("model")))
    yield live
    live.stop()


@pytest.fixture(scope="module")
def client(server: LiveServer) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key="unused", max_retries=0, timeout=30)


def test_models(client: openai.OpenAI) -> None:
    models = client.models.list()
    assert [m.id for m in models.data] == [MODEL_NAME]


def test_completion_usage_and_finish(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model=MODEL_NAME, prompt=PROMPT, max_tokens=7, temperature=0, extra_body={"ignore_eos": True}
    )
    (choice,) = result.choices
    assert choice.finish_reason == "length"
    assert result.usage.completion_tokens == 7
    assert result.usage.total_tokens == result.usage.prompt_tokens + 7
    assert result.usage.prompt_tokens_details.cached_tokens >= 0
    assert result.id.startswith("cmpl-") and result.model == MODEL_NAME


def test_streamed_completion_equals_non_streamed(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL_NAME, prompt=PROMPT, max_tokens=24, temperature=0)
    whole = client.completions.create(**kwargs).choices[0]
    chunks = list(client.completions.create(stream=True, **kwargs))
    assert "".join(c.choices[0].text for c in chunks) == whole.text
    finish = [c.choices[0].finish_reason for c in chunks if c.choices[0].finish_reason]
    assert finish == [whole.finish_reason]
    assert all(c.usage is None for c in chunks)


def test_stream_include_usage(client: openai.OpenAI) -> None:
    chunks = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=5,
            temperature=0,
            stream=True,
            stream_options={"include_usage": True},
            extra_body={"ignore_eos": True},
        )
    )
    *body, last = chunks
    assert last.choices == [] and last.usage.completion_tokens == 5
    assert all(c.usage is None and len(c.choices) == 1 for c in body)


def test_batched_prompts_n_and_token_ids(server: LiveServer, client: openai.OpenAI) -> None:
    tokens = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()["tokens"]
    result = client.completions.create(
        model=MODEL_NAME,
        prompt=[PROMPT, "import os"],
        n=2,
        max_tokens=4,
        temperature=1.0,
        seed=3,
        extra_body={"ignore_eos": True},
    )
    assert sorted(c.index for c in result.choices) == [0, 1, 2, 3]
    assert result.usage.completion_tokens == 16
    by_text = client.completions.create(model=MODEL_NAME, prompt=PROMPT, max_tokens=6, temperature=0)
    by_ids = client.completions.create(model=MODEL_NAME, prompt=tokens, max_tokens=6, temperature=0)
    assert by_ids.choices[0].text == by_text.choices[0].text
    assert by_ids.usage.prompt_tokens == len(tokens)
    nested = client.completions.create(model=MODEL_NAME, prompt=[tokens, tokens], max_tokens=3, temperature=0)
    assert len(nested.choices) == 2


def test_logprobs_and_echo(client: openai.OpenAI) -> None:
    result = client.completions.create(
        model=MODEL_NAME,
        prompt=PROMPT,
        max_tokens=5,
        temperature=0,
        logprobs=3,
        echo=True,
        extra_body={"ignore_eos": True},
    )
    choice = result.choices[0]
    assert choice.text.startswith(PROMPT)
    lp = choice.logprobs
    n_prompt = result.usage.prompt_tokens
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.text_offset) == n_prompt + 5
    assert lp.token_logprobs[0] is None and lp.top_logprobs[0] is None
    assert all(v is not None and v <= 0 for v in lp.token_logprobs[1:])
    # Keys are token strings, so tokens that decode alike (partial UTF-8) share one entry.
    assert all(1 <= len(top) <= 4 for top in lp.top_logprobs[1:])
    assert lp.text_offset == sorted(lp.text_offset)
    assert "".join(lp.tokens[n_prompt:]) == choice.text[len(PROMPT) :]
    streamed = list(
        client.completions.create(
            model=MODEL_NAME,
            prompt=PROMPT,
            max_tokens=5,
            temperature=0,
            logprobs=3,
            echo=True,
            stream=True,
            extra_body={"ignore_eos": True},
        )
    )
    assert "".join(c.choices[0].text for c in streamed) == choice.text
    assert sum(len(c.choices[0].logprobs.tokens) for c in streamed if c.choices[0].logprobs) == n_prompt + 5


def test_chat(client: openai.OpenAI) -> None:
    result = client.chat.completions.create(
        model=MODEL_NAME, messages=MESSAGES, max_tokens=8, temperature=0, logprobs=True, top_logprobs=2
    )
    (choice,) = result.choices
    assert choice.message.role == "assistant"
    assert choice.finish_reason in ("stop", "length")
    assert len(choice.logprobs.content) == result.usage.completion_tokens
    assert all(len(entry.top_logprobs) == 2 for entry in choice.logprobs.content)
    parts = [
        {
            "role": "user",
            "content": [{"type": "text", "text": "Print the squares"}, {"type": "text", "text": "of 0 to 9."}],
        }
    ]
    with_parts = client.chat.completions.create(
        model=MODEL_NAME, messages=parts, max_completion_tokens=4, temperature=0, response_format={"type": "text"}
    )
    assert with_parts.usage.completion_tokens <= 4


def test_chat_stream(client: openai.OpenAI) -> None:
    kwargs = dict(model=MODEL_NAME, messages=MESSAGES, max_tokens=20, temperature=0, n=2)
    whole = client.chat.completions.create(**kwargs)
    chunks = list(client.chat.completions.create(stream=True, stream_options={"include_usage": True}, **kwargs))
    usage_chunk = chunks[-1]
    assert usage_chunk.choices == [] and usage_chunk.usage.total_tokens == whole.usage.total_tokens
    for index in range(2):
        mine = [c.choices[0] for c in chunks[:-1] if c.choices[0].index == index]
        assert mine[0].delta.role == "assistant"
        assert all(c.delta.role is None for c in mine[1:])
        assert "".join(c.delta.content or "" for c in mine) == whole.choices[index].message.content
        finishes = [c.finish_reason for c in mine if c.finish_reason]
        assert finishes == [whole.choices[index].finish_reason] and mine[-1].finish_reason


def test_unknown_fields_ignored(server: LiveServer) -> None:
    response = httpx.post(
        server.base_url + "/completions",
        json={"model": MODEL_NAME, "prompt": "x", "max_tokens": 2, "metadata": {"a": 1}, "service_tier": "auto"},
    )
    assert response.status_code == 200, response.text


def test_tokenize_detokenize(server: LiveServer) -> None:
    tokenized = httpx.post(server.url + "/tokenize", json={"prompt": PROMPT}).json()
    assert tokenized["count"] == len(tokenized["tokens"]) and tokenized["max_model_len"] == 512
    text = httpx.post(server.url + "/detokenize", json={"tokens": tokenized["tokens"]}).json()
    assert text == {"prompt": PROMPT}
    chat = httpx.post(server.url + "/tokenize", json={"messages": MESSAGES}).json()
    assert chat["count"] > tokenized["count"] - 20


def test_health_and_metrics(server: LiveServer) -> None:
    assert httpx.get(server.url + "/health").status_code == 200
    text = httpx.get(server.url + "/metrics").text
    for name in (
        "pagoda:num_requests_running",
        "pagoda:num_requests_waiting",
        "pagoda:kv_cache_usage_perc",
        "pagoda:prefix_cache_queries_total",
        "pagoda:prefix_cache_hits_total",
        "pagoda:num_preemptions_total",
        "pagoda:prompt_tokens_total",
        "pagoda:generation_tokens_total",
        "pagoda:request_success_total",
        "pagoda:time_to_first_token_seconds_bucket",
        "pagoda:inter_token_latency_seconds_bucket",
        "pagoda:e2e_request_latency_seconds_bucket",
        "pagoda:request_queue_time_seconds_bucket",
    ):
        assert f"{name}{{" in text and f'model_name="{MODEL_NAME}"' in text, name
    assert 'finished_reason="length"' in text
    counts = {
        line.split("{")[0]: float(line.rsplit(" ", 1)[1])
        for line in text.splitlines()
        if line.startswith("pagoda:") and "_count{" in line
    }
    assert counts["pagoda:inter_token_latency_seconds_count"] > 0
    assert counts["pagoda:time_to_first_token_seconds_count"] > 0


def test_speculative_decoding_metrics(tmp_path_factory: pytest.TempPathFactory) -> None:
    live = start_server(build_tiny_model(tmp_path_factory.mktemp("spec")), engine={"speculative": "ngram"})
    try:
        response = httpx.post(
            live.url + "/v1/completions",
            timeout=60,
            json={
                "model": MODEL_NAME,
                "prompt": "a b c d a b c d a b c d a b",
                "max_tokens": 24,
                "temperature": 0,
                "ignore_eos": True,
            },
        )
        assert response.status_code == 200
        usage = response.json()["usage"]
        assert usage["completion_tokens"] == 24  # emitted tokens only, never rejected drafts
        text = httpx.get(live.url + "/metrics").text
        values = {
            line.split(" ")[0]: float(line.rsplit(" ", 1)[1])
            for line in text.splitlines()
            if line.startswith("pagoda:spec_decode")
        }
        drafts = values[f'pagoda:spec_decode_num_drafts_total{{model_name="{MODEL_NAME}"}}']
        proposed = values[f'pagoda:spec_decode_num_draft_tokens_total{{model_name="{MODEL_NAME}"}}']
        accepted = values[f'pagoda:spec_decode_num_accepted_tokens_total{{model_name="{MODEL_NAME}"}}']
        assert drafts > 0 and proposed >= accepted >= 0
        per_position = sum(v for k, v in values.items() if "_per_pos_total" in k)
        assert per_position == accepted
    finally:
        live.stop()
