"""Every request field pagoda knows, per endpoint: supported, accepted and ignored, or refused.

One table per endpoint answers "what happens to field X", so nothing a client sends is
silently dropped when it would change the answer. A field is *ignored* only when it cannot
change the output (bookkeeping such as `user`, `metadata`, `store`); a field that would change
the output and that pagoda does not implement is *refused* with a 400 naming it, whatever the
client meant by it. A refused field set to its inert value (false, null, empty) is accepted:
`"return_tokens_as_token_ids": false` asks for nothing. Fields missing from the table are unknown and are
ignored, as vLLM does (OpenAI's own unknown-field check is the pydantic model's business, not
ours). Each endpoint class holds its table as `fields`, and the endpoint table (serve/endpoints.py)
names it beside the endpoint's route; tests/serve/test_request_fields.py walks them.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from enum import Enum
from typing import Any

from pagoda.serve.errors import bad_request


class Support(Enum):
    SUPPORTED = "supported"
    IGNORED = "ignored"  # accepted; cannot change the output
    REFUSED = "refused"  # 400 naming the field unless it holds an inert value


@dataclass(frozen=True)
class Field:
    support: Support
    why: str = ""  # for refused and ignored fields: what the client should know
    example: Any = None  # a non-inert value, for the table's test
    # The values that ask for nothing; None means the usual null / false / empty.
    inert: tuple[Any, ...] | None = None


S, I, R = Support.SUPPORTED, Support.IGNORED, Support.REFUSED

_SHARED = {
    **{
        name: Field(S)
        for name in (
            "model",
            "max_tokens",
            "temperature",
            "top_p",
            "n",
            "stream",
            "stream_options",
            "stop",
            "seed",
            "presence_penalty",
            "frequency_penalty",
            "logit_bias",
            "top_k",
            "min_p",
            "repetition_penalty",
            "min_tokens",
            "ignore_eos",
            "stop_token_ids",
            "include_stop_str_in_output",
            "skip_special_tokens",
            "spaces_between_special_tokens",
            "response_format",
            "structured_outputs",
            "guided_json",
            "guided_regex",
            "guided_choice",
            "guided_grammar",
            "prompt_logprobs",
            "allowed_token_ids",
            "bad_words",
            "truncate_prompt_tokens",
            "truncation_side",
            "return_token_ids",
            "use_beam_search",
            "length_penalty",
            "early_stopping",
        )
    },
    "user": Field(I, "recorded nowhere; tenants are identified by API key", "u-1"),
    "metadata": Field(I, "not stored", {"k": "v"}),
    "store": Field(I, "pagoda stores no completions", True),
    "service_tier": Field(I, "one tier; priority comes from the tenant", "flex"),
    "priority": Field(
        S,
        "with --scheduling-policy priority (lower runs first), within the API key's "
        "priority_range (default: its own priority or lower ranks); a 400 outside",
    ),
    "request_id": Field(I, "pagoda assigns its own ids", "my-id"),
    "guided_decoding_backend": Field(I, "pagoda has one grammar engine (llguidance)", "xgrammar"),
    "cache_salt": Field(I, "prefix caches are salted per tenant by the server", "salt"),
    "guided_whitespace_pattern": Field(R, "not supported", "[ ]?"),
    "return_tokens_as_token_ids": Field(R, "not supported", True),
    "kv_transfer_params": Field(R, "KV transfer is the router's (serve --replica-roles), not per request", {"x": 1}),
    "lora_request": Field(R, "pick a LoRA adapter by its name in `model`", {"name": "a"}),
    "logits_processors": Field(R, "custom logits processors are not supported", ["x"]),
}

COMPLETIONS: dict[str, Field] = {
    **_SHARED,
    **{name: Field(S) for name in ("prompt", "echo", "logprobs", "best_of")},
    "suffix": Field(R, "insertion (suffix) is not supported", "tail"),
}

CHAT: dict[str, Field] = {
    **_SHARED,
    **{
        name: Field(S)
        for name in (
            "messages",
            "max_completion_tokens",
            "logprobs",
            "top_logprobs",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "add_generation_prompt",
            "chat_template_kwargs",
            "continue_final_message",
        )
    },
    "functions": Field(S, "the deprecated functions API: tools, answered as message.function_call"),
    "function_call": Field(S, "the deprecated functions API: tool_choice"),
    "chat_template": Field(S, "only with serve --trust-request-chat-template; otherwise a 400"),
    "documents": Field(R, "not supported", [{"text": "d"}]),
    "echo": Field(R, "chat echo is not supported", True),
    "modalities": Field(R, "text only", ["audio"]),
    "audio": Field(R, "text only", {"voice": "x"}),
    "prediction": Field(R, "predicted outputs are not supported", {"type": "content", "content": "x"}),
    "reasoning_effort": Field(
        R,
        "not supported; a reasoning model's thinking is switched by its "
        'template, e.g. chat_template_kwargs {"enable_thinking": false}',
        "low",
    ),
    "web_search_options": Field(R, "not supported", {}, inert=()),  # {} asks for a web search
}

# Anthropic's Messages API (and its count_tokens, whose body is a subset).
MESSAGES: dict[str, Field] = {
    **{
        name: Field(S)
        for name in (
            "model",
            "messages",
            "max_tokens",
            "system",
            "stop_sequences",
            "temperature",
            "top_p",
            "top_k",
            "stream",
            "tools",
            "tool_choice",
        )
    },
    "thinking": Field(
        S,
        "type switches the template's enable_thinking; budget_tokens is not enforced "
        "(max_tokens bounds the thinking and the answer together)",
    ),
    "metadata": Field(I, "not stored", {"user_id": "u-1"}),
    "service_tier": Field(I, "one tier; priority comes from the tenant", "auto"),
    "cache_control": Field(I, "prefix caching is automatic", {"type": "ephemeral"}),
    "inference_geo": Field(I, "one location", "us"),
    "speed": Field(I, "one speed", "fast"),
    "diagnostics": Field(I, "not recorded", {"x": 1}),
    "user_profile_id": Field(I, "tenants are identified by API key", "p-1"),
    "workspace_id": Field(I, "tenants are identified by API key", "w-1"),
    "output_config": Field(
        R,
        "not supported; structured output is the OpenAI endpoints' response_format",
        {"format": {"type": "json_schema", "schema": {}}},
    ),
    "container": Field(R, "code execution containers are not supported", "c-1"),
    "mcp_servers": Field(R, "MCP servers are not supported", [{"type": "url", "url": "x", "name": "m"}]),
}

EMBEDDINGS: dict[str, Field] = {
    **{
        name: Field(S)
        for name in (
            "model",
            "input",
            "encoding_format",
            "dimensions",
            "normalize",
            "truncate_prompt_tokens",
            "truncation_side",
        )
    },
    "user": Field(I, "recorded nowhere; tenants are identified by API key", "u-1"),
}

# vLLM's scoring endpoints (serve/api/scoring.py); rerank takes Cohere's and Jina's bodies.
SCORE: dict[str, Field] = {
    **{name: Field(S) for name in ("model", "text_1", "text_2", "truncate_prompt_tokens", "use_activation")},
    "user": Field(I, "recorded nowhere; tenants are identified by API key", "u-1"),
}
RERANK: dict[str, Field] = {
    **{
        name: Field(S)
        for name in (
            "model",
            "query",
            "documents",
            "top_n",
            "return_documents",
            "truncate_prompt_tokens",
            "use_activation",
        )
    },
    "user": Field(I, "recorded nowhere; tenants are identified by API key", "u-1"),
    "rank_fields": Field(R, 'documents are strings or {"text": ...} objects; no other field is ranked', ["title"]),
    "max_chunks_per_doc": Field(R, "documents are not chunked (truncate_prompt_tokens cuts a long pair)", 4),
    "max_tokens_per_doc": Field(R, "documents are not cut on their own (truncate_prompt_tokens cuts a long pair)", 512),
}
CLASSIFY: dict[str, Field] = {
    **{name: Field(S) for name in ("model", "input", "truncate_prompt_tokens", "use_activation")},
    "user": Field(I, "recorded nowhere; tenants are identified by API key", "u-1"),
}

# OpenAI's Responses API.
RESPONSES: dict[str, Field] = {
    **{
        name: Field(S)
        for name in (
            "model",
            "input",
            "instructions",
            "max_output_tokens",
            "temperature",
            "top_p",
            "tools",
            "tool_choice",
            "parallel_tool_calls",
            "stream",
            "previous_response_id",
        )
    },
    "text": Field(
        S, "format (text, json_object, json_schema) is enforced by the grammar engine; verbosity is not applied"
    ),
    "store": Field(
        S,
        "kept in the server's memory, per API key, bounded in count and age "
        "(--responses-store-size, --responses-store-ttl; none with --no-responses-store)",
    ),
    "metadata": Field(I, "echoed in the response and stored with it", {"k": "v"}),
    "user": Field(I, "recorded nowhere; tenants are identified by API key", "u-1"),
    "safety_identifier": Field(I, "recorded nowhere; tenants are identified by API key", "s-1"),
    "prompt_cache_key": Field(I, "prefix caching is automatic (salted per tenant)", "k-1"),
    "prompt_cache_retention": Field(I, "prefix caching is automatic", "24h"),
    "service_tier": Field(I, "one tier; priority comes from the tenant", "flex"),
    "include": Field(
        I, "no extra output data (logprobs, encrypted reasoning) is included", ["reasoning.encrypted_content"]
    ),
    "reasoning": Field(
        I,
        "effort and summary are not applied; a reasoning model's thinking is switched by its template",
        {"effort": "low"},
    ),
    "stream_options": Field(I, "no obfuscation padding is sent", {"include_obfuscation": False}),
    "truncation": Field(
        R, "input is never truncated; a conversation over the context length is a 400", "auto", inert=("disabled",)
    ),
    "max_tool_calls": Field(R, "not supported; use tool_choice", 1),
    "top_logprobs": Field(R, "not returned by this endpoint; use chat completions' logprobs", 2, inert=(0,)),
    "background": Field(R, "background responses are not supported", True),
    "conversation": Field(R, "the Conversations API is not supported; use previous_response_id", "conv_1"),
    "prompt": Field(R, "stored prompt templates are not supported", {"id": "pmpt_1"}),
    "context_management": Field(R, "not supported", [{"type": "compaction"}]),
}


def is_inert(value: Any, field: Field | None = None) -> bool:
    if value is None:
        return True
    if field is not None and field.inert is not None:
        return any(value == inert for inert in field.inert)
    return value is False or value == "" or value == [] or value == {}


def check_fields(body: Any, table: Mapping[str, Field]) -> None:
    """Raise a 400 naming the first refused field the body sets to a non-inert value; `table`
    is the endpoint's (its `fields`)."""
    present = dict(getattr(body, "model_extra", None) or {})
    for name in getattr(body, "model_fields_set", ()):
        present[name] = getattr(body, name)
    for name, value in present.items():
        field = table.get(name)
        if field is not None and field.support is Support.REFUSED and not is_inert(value, field):
            raise bad_request(f"{name} is not supported: {field.why}.", param=name, code="unsupported_field")
