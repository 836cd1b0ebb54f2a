"""POST /v1/chat/completions: messages through the model's chat template, streamed or not."""

from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from pagoda.serve.errors import APIError, bad_request
from pagoda.serve.guardrails import guard_chat_messages
from pagoda.serve.logprobs import chat_logprobs
from pagoda.serve.protocol import (AssistantMessage, ChatChoice, ChatChoiceLogprobs,
                                   ChatCompletionRequest, ChatCompletionResponse, ChatMessage)
from pagoda.serve.sampling import build_sampling_params
from pagoda.serve.serving import EnginePrompt, Generation, ServeContext, new_request_id, respond
from pagoda.serve.sse import SSE_DONE, ChoiceChunks, sse_error, sse_event, to_json
from pagoda.serve.tenants import Tenant

ROLES = ("system", "developer", "user", "assistant")


def reject_unsupported(request: ChatCompletionRequest) -> None:
    if request.tools:
        raise bad_request("tools are not supported.", param="tools")
    if request.functions:
        raise bad_request("functions are not supported.", param="functions")
    if request.tool_choice not in (None, "none"):
        raise bad_request("tool_choice is not supported.", param="tool_choice")
    if request.function_call not in (None, "none"):
        raise bad_request("function_call is not supported.", param="function_call")
    if request.response_format is not None and request.response_format.type != "text":
        raise bad_request(f"response_format type {request.response_format.type!r} is not "
                          "supported; only 'text' is.", param="response_format")
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true.", param="top_logprobs")
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed when stream is true.",
                          param="stream_options")


def template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Validated messages as the chat template expects them: role + string content."""
    if not messages:
        raise bad_request("messages must not be empty.", param="messages")
    result = []
    for i, message in enumerate(messages):
        if message.role not in ROLES:
            raise bad_request(f"messages[{i}].role {message.role!r} is not supported; use one "
                              f"of {', '.join(ROLES)}.", param="messages")
        if (message.model_extra or {}).get("tool_calls"):
            raise bad_request(f"messages[{i}].tool_calls is not supported.", param="messages")
        content = message.content
        if isinstance(content, list):
            texts = []
            for part in content:
                if part.type != "text" or part.text is None:
                    raise bad_request(f"messages[{i}] has a content part of type {part.type!r}; "
                                      "only text parts are supported.", param="messages")
                texts.append(part.text)
            content = "\n".join(texts)
        role = "system" if message.role == "developer" else message.role
        result.append({"role": role, "content": content or ""})
    return result


async def create_chat_completion(ctx: ServeContext, raw: Request, request: ChatCompletionRequest,
                                 tenant: Tenant) -> Response:
    ctx.check_model(request.model)
    reject_unsupported(request)
    tokenizer = ctx.llm.tokenizer
    messages = template_messages(request.messages)
    if not getattr(tokenizer, "has_chat_template", True):
        raise bad_request("This model has no chat template; use /v1/completions.",
                          param="messages")
    messages, input_decision = await guard_chat_messages(ctx, tenant, messages)  # guardrails hook
    try:
        token_ids = tokenizer.encode_chat(messages,
                                          add_generation_prompt=request.add_generation_prompt)
    except ValueError as exc:
        raise bad_request(f"messages could not be formatted: {exc}", param="messages") from None
    max_param = "max_completion_tokens" if request.max_completion_tokens is not None \
        else "max_tokens"
    requested = request.max_completion_tokens if request.max_completion_tokens is not None \
        else request.max_tokens
    max_tokens = tenant.resolve_max_tokens(requested, max_param)
    num_top = request.top_logprobs or 0
    params = build_sampling_params(request, ctx.llm.generation_defaults, max_tokens=max_tokens,
                                   logprobs=num_top if request.logprobs else None)
    prompt = EnginePrompt(token_ids, json.dumps(messages, ensure_ascii=False))
    generation = Generation(ctx, new_request_id("chatcmpl"), "chat", tenant, [prompt], params,
                            stream=request.stream, input_decision=input_decision)
    await generation.start(max_param)
    created = int(time.time())
    stream_body = _stream(ctx, generation, request, created) if request.stream else None
    return await respond(raw, generation, stream_body, lambda: _response(ctx, generation, request, created))


def _response(ctx: ServeContext, generation: Generation, request: ChatCompletionRequest,
              created: int) -> ChatCompletionResponse:
    final = generation.finals[0]
    assert final is not None
    choices = []
    for sample in final.outputs:
        logprobs = None
        if request.logprobs:
            logprobs = ChatChoiceLogprobs(content=chat_logprobs(
                sample.token_ids, list(sample.logprobs or []), request.top_logprobs or 0,
                ctx.llm.tokenizer))
        choices.append(ChatChoice(index=sample.index,
                                  message=AssistantMessage(content=sample.text),
                                  logprobs=logprobs, finish_reason=sample.finish_reason))
    return ChatCompletionResponse(id=generation.request_id, created=created,
                                  model=ctx.model_name, choices=choices,
                                  usage=generation.usage())


async def _stream(ctx: ServeContext, generation: Generation, request: ChatCompletionRequest,
                  created: int) -> AsyncIterator[str]:
    tokenizer = ctx.llm.tokenizer
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    base = {"id": generation.request_id, "object": "chat.completion.chunk", "created": created,
            "model": ctx.model_name}
    num_top = request.top_logprobs or 0

    chunks = ChoiceChunks(base, include_usage)

    def chunk(index: int, delta_json: str, logprobs: Any, finish_reason: str | None) -> str:
        logprobs_json = to_json(logprobs) if logprobs is not None else "null"
        finish_json = to_json(finish_reason) if finish_reason is not None else "null"
        return chunks.event(f'"index":{index},"delta":{delta_json},"logprobs":{logprobs_json},'
                            f'"finish_reason":{finish_json}')

    sent_chars = [0] * request.n
    sent_tokens = [0] * request.n
    finished = [False] * request.n
    try:
        for index in range(request.n):
            yield chunk(index, '{"role":"assistant","content":""}', None, None)
        async for _, output in generation.outputs():
            for sample in output.outputs:
                index = sample.index
                if finished[index]:
                    continue
                text = sample.text[sent_chars[index]:]
                logprobs = None
                if request.logprobs:
                    new_ids = sample.token_ids[sent_tokens[index]:]
                    positions = list((sample.logprobs or [])[sent_tokens[index]:])
                    entries = chat_logprobs(new_ids, positions, num_top, tokenizer)
                    if entries:
                        logprobs = {"content": [e.model_dump() for e in entries],
                                    "refusal": None}
                sent_chars[index] = max(sent_chars[index], len(sample.text))
                sent_tokens[index] = len(sample.token_ids)
                finish_reason = sample.finish_reason
                if finish_reason is not None:
                    finished[index] = True
                if not text and finish_reason is None and logprobs is None:
                    continue
                delta_json = '{"content":' + to_json(text) + "}" if text else "{}"
                yield chunk(index, delta_json, logprobs, finish_reason)
        if include_usage:
            yield sse_event({**base, "choices": [], "usage": generation.usage().model_dump()})
    except APIError as exc:
        yield sse_error(exc)
    yield SSE_DONE
