"""POST /v1/chat/completions: messages through the model's chat template, streamed or not."""

from __future__ import annotations

import json
import time
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from pagoda.serve.errors import APIError, bad_request
from pagoda.serve.logprobs import chat_logprobs
from pagoda.serve.protocol import (AssistantMessage, ChatChoice, ChatChoiceLogprobs,
                                   ChatCompletionRequest, ChatCompletionResponse, ChatMessage)
from pagoda.serve.sampling import build_sampling_params
from pagoda.serve.structured_request import with_structured_outputs
from pagoda.serve.tool_calls import ToolCallStream, ToolPlan, plan_tools, template_message, with_tool_constraint
from pagoda.serve.serving import EnginePrompt, Generation, ServeContext, new_request_id, respond
from pagoda.serve.sse import SSE_DONE, ChoiceChunks, sse_error, sse_event, to_json
from pagoda.serve.tenants import Tenant

ROLES = ("system", "developer", "user", "assistant", "tool")


def reject_unsupported(request: ChatCompletionRequest) -> None:
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
        extra = {k: v for k, v in (message.model_extra or {}).items() if k in ("tool_calls", "tool_call_id")}
        result.append(template_message({"role": role, "content": content or "", **extra}))
    return result


async def create_chat_completion(ctx: ServeContext, raw: Request, request: ChatCompletionRequest,
                                 tenant: Tenant) -> Response:
    ctx.check_model(request.model)
    reject_unsupported(request)
    tokenizer = ctx.llm.tokenizer
    messages = template_messages(request.messages)
    tools = plan_tools(request, ctx.settings.tool_call_parser, getattr(tokenizer.hf, "chat_template", None))
    if not getattr(tokenizer, "has_chat_template", True):
        raise bad_request("This model has no chat template; use /v1/completions.",
                          param="messages")
    try:
        token_ids = tokenizer.encode_chat(messages, add_generation_prompt=request.add_generation_prompt,
                                          **({"tools": tools.tools} if tools else {}))
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
    params = await with_structured_outputs(params, request)
    params = await with_tool_constraint(params, tools)
    prompt = EnginePrompt(token_ids, json.dumps(messages, ensure_ascii=False))
    generation = Generation(ctx, new_request_id("chatcmpl"), "chat", tenant, [prompt], params,
                            stream=request.stream)
    await generation.start(max_param)
    created = int(time.time())
    stream_body = _stream(ctx, generation, request, created, tools) if request.stream else None
    return await respond(raw, generation, stream_body, lambda: _response(ctx, generation, request, created, tools))


def _response(ctx: ServeContext, generation: Generation, request: ChatCompletionRequest,
              created: int, tools: ToolPlan | None) -> ChatCompletionResponse:
    final = generation.finals[0]
    assert final is not None
    choices = []
    for sample in final.outputs:
        logprobs = None
        if request.logprobs:
            logprobs = ChatChoiceLogprobs(content=chat_logprobs(
                sample.token_ids, list(sample.logprobs or []), request.top_logprobs or 0,
                ctx.llm.tokenizer))
        message, finish_reason = AssistantMessage(content=sample.text), sample.finish_reason
        if tools is not None:
            message, finish_reason = tools.message(sample.text, finish_reason)
        choices.append(ChatChoice(index=sample.index, message=message,
                                  logprobs=logprobs, finish_reason=finish_reason))
    return ChatCompletionResponse(id=generation.request_id, created=created,
                                  model=ctx.model_name, choices=choices,
                                  usage=generation.usage())


async def _stream(ctx: ServeContext, generation: Generation, request: ChatCompletionRequest,
                  created: int, tools: ToolPlan | None = None) -> AsyncIterator[str]:
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
    tool_streams = [ToolCallStream(tools.parser, tools.forced) if tools and tools.parse else None
                    for _ in range(request.n)]
    try:
        for index in range(request.n):
            yield chunk(index, '{"role":"assistant","content":""}', None, None)
        async for _, output in generation.outputs():
            for sample in output.outputs:
                index = sample.index
                if finished[index]:
                    continue
                text = sample.text[sent_chars[index]:]
                tool_finish = None
                tool_stream = tool_streams[index]
                if tool_stream is not None:  # content up to a tool call, then the calls
                    text, call_deltas = tool_stream.step(sample.text, sample.finish_reason is not None)
                    for position, call_delta in enumerate(call_deltas):
                        delta = {"content": text} if text and position == 0 else {}
                        yield chunk(index, to_json({**delta, "tool_calls": [call_delta]}), None, None)
                    text = "" if call_deltas else text
                    if tool_stream.has_calls and sample.finish_reason == "stop":
                        tool_finish = "tool_calls"
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
                finish_reason = tool_finish or sample.finish_reason
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
