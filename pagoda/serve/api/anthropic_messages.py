"""POST /v1/messages and /v1/messages/count_tokens: Anthropic's Messages API over the chat path.

A Messages body is translated into a chat completion request (system and content blocks into
chat messages, tool_use / tool_result into tool calls and tool messages, tools and tool_choice
into OpenAI's), so templating, tool grammars, reasoning and admission are chat's; only the
answer's shape is this module's: content blocks (thinking, text, tool_use), Anthropic's
stop reasons and usage, and its streamed events (message_start, content_block_start /
_delta / _stop, message_delta, message_stop; an `error` event for a failure mid-stream).
"""

from __future__ import annotations

import asyncio
import json
import uuid
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pydantic
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagoda.serve.admission.tenants import Tenant
from pagoda.serve.api.anthropic_protocol import (
    AnthropicMessage,
    ContentBlock,
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
    MessagesResponse,
    MessagesUsage,
)
from pagoda.serve.api.chat import ChatEndpoint, ChatReasoning, tool_plan
from pagoda.serve.api.handler import WholeAnswer, respond
from pagoda.serve.api.lora import resolve_model
from pagoda.serve.api.protocol import ChatCompletionRequest
from pagoda.serve.api.request_fields import MESSAGES, check_fields
from pagoda.serve.api.sse import to_json
from pagoda.serve.api.tool_calls import ToolCallStream, ToolPlan
from pagoda.serve.errors import APIError, anthropic_error_body, bad_request, validation_error
from pagoda.serve.serving import Generation, ServeContext

_STOP_REASONS = {"length": "max_tokens", "content_filter": "refusal", "abort": "end_turn"}


def anthropic_event(kind: str, payload: dict[str, Any]) -> str:
    return f"event: {kind}\ndata: {to_json({'type': kind, **payload})}\n\n"


def _text_of(blocks: str | Sequence[ContentBlock | dict[str, Any]] | None, where: str) -> str:
    """Text blocks (a tool_result's content, the system prompt) joined; other blocks are a 400."""
    if blocks is None or isinstance(blocks, str):
        return blocks or ""
    texts = []
    for i, item in enumerate(blocks):
        block = item if isinstance(item, dict) else item.model_dump()
        if block.get("type") != "text" or not isinstance(block.get("text"), str):
            raise bad_request(
                f"{where}[{i}] has type {block.get('type')!r}; only text blocks are "
                "supported here (text only, no images or documents).",
                param=where,
            )
        texts.append(block["text"])
    return "\n".join(texts)


def _chat_messages(request: CountTokensRequest) -> list[dict[str, Any]]:
    """The conversation as OpenAI chat messages (what the chat template renders)."""
    messages: list[dict[str, Any]] = []
    if request.system:
        messages.append({"role": "system", "content": _text_of(request.system, "system")})
    for m, message in enumerate(request.messages):
        messages.extend(_chat_message(message, f"messages[{m}].content"))
    if not request.messages:
        raise bad_request("messages must not be empty.", param="messages")
    return messages


def _chat_message(message: AnthropicMessage, where: str) -> list[dict[str, Any]]:
    if isinstance(message.content, str):
        return [{"role": message.role, "content": message.content}]
    texts: list[str] = []
    parts: list[dict[str, Any]] = []  # text and images in order, when the message has an image
    tool_calls: list[dict[str, Any]] = []
    results: list[dict[str, Any]] = []
    for b, block in enumerate(message.content):
        at = f"{where}[{b}]"
        if block.type == "text" and block.text is not None:
            texts.append(block.text)
            parts.append({"type": "text", "text": block.text})
        elif block.type == "image" and message.role == "user":
            parts.append({"type": "image_url", "image_url": {"url": _image_url(block, at)}})
        elif block.type == "tool_use" and message.role == "assistant":
            if not block.id or not block.name:
                raise bad_request(f"{at}: a tool_use block needs id and name.", param="messages")
            tool_calls.append(
                {
                    "id": block.id,
                    "type": "function",
                    "function": {"name": block.name, "arguments": json.dumps(block.input or {}, ensure_ascii=False)},
                }
            )
        elif block.type == "tool_result" and message.role == "user":
            if not block.tool_use_id:
                raise bad_request(f"{at}: a tool_result block needs tool_use_id.", param="messages")
            content = _text_of(block.content, f"{at}.content")
            if block.is_error:
                content = f"Error: {content}"
            results.append({"role": "tool", "tool_call_id": block.tool_use_id, "content": content})
        elif block.type in ("thinking", "redacted_thinking") and message.role == "assistant":
            continue  # earlier turns' thinking is not shown to the model again (as Qwen3/R1 templates do)
        else:
            raise bad_request(
                f"{at} has type {block.type!r}, which a {message.role} message cannot "
                "hold here (text, tool_use and tool_result blocks only; no images or "
                "documents).",
                param="messages",
            )
    converted: list[dict[str, Any]] = list(results)
    if len(parts) > len(texts):  # images: chat's parts, decoded by the chat endpoint
        converted.append({"role": message.role, "content": parts})
    elif texts or tool_calls or not results:
        entry: dict[str, Any] = {"role": message.role, "content": "\n".join(texts)}
        if tool_calls:
            entry["tool_calls"] = tool_calls
        converted.append(entry)
    return converted


_IMAGE_TYPES = ("image/jpeg", "image/png", "image/gif", "image/webp")


def _image_url(block: ContentBlock, at: str) -> str:
    """An image block's source as chat's image URL: base64 data as a data URL, or its URL."""
    source = (block.model_extra or {}).get("source")
    if not isinstance(source, dict):
        raise bad_request(f"{at}: an image block needs a source.", param="messages")
    if source.get("type") == "base64":
        media_type, data = source.get("media_type"), source.get("data")
        if media_type not in _IMAGE_TYPES or not isinstance(data, str):
            raise bad_request(
                f"{at}.source: base64 data with media_type one of {', '.join(_IMAGE_TYPES)}.", param="messages"
            )
        return f"data:{media_type};base64,{data}"
    if source.get("type") == "url" and isinstance(source.get("url"), str):
        return source["url"]
    raise bad_request(f"{at}.source: type base64 or url.", param="messages")


def _chat_tools(request: CountTokensRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if request.tools:
        tools = []
        for i, tool in enumerate(request.tools):
            if tool.type not in (None, "custom") or tool.input_schema is None:
                raise bad_request(
                    f"tools[{i}] ({tool.type or tool.name!r}) is not supported: only "
                    "client tools with name and input_schema.",
                    param="tools",
                )
            function = {"name": tool.name, "parameters": tool.input_schema}
            if tool.description:
                function["description"] = tool.description
            tools.append({"type": "function", "function": function})
        fields["tools"] = tools
    choice = request.tool_choice
    if choice is not None:
        if choice.type == "tool":
            if not choice.name:
                raise bad_request("tool_choice of type 'tool' needs name.", param="tool_choice")
            fields["tool_choice"] = {"type": "function", "function": {"name": choice.name}}
        else:
            fields["tool_choice"] = {"auto": "auto", "any": "required", "none": "none"}[choice.type]
        if choice.disable_parallel_tool_use:
            fields["parallel_tool_calls"] = False
    return fields


def to_chat_request(request: CountTokensRequest, max_tokens: int = 1) -> ChatCompletionRequest:
    """The chat completion request a Messages body means; raises a 400 APIError."""
    fields: dict[str, Any] = {
        "model": request.model,
        "messages": _chat_messages(request),
        "max_tokens": max_tokens,
        **_chat_tools(request),
    }
    if request.thinking is not None:  # Qwen3-style templates switch thinking with this variable
        fields["chat_template_kwargs"] = {"enable_thinking": request.thinking.type != "disabled"}
    if isinstance(request, MessagesRequest):
        fields.update(
            max_tokens=request.max_tokens,
            stream=request.stream,
            stop=request.stop_sequences,
            temperature=request.temperature,
            top_p=request.top_p,
            top_k=request.top_k,
        )
    try:
        return ChatCompletionRequest.model_validate(fields)
    except pydantic.ValidationError as exc:
        raise validation_error(list(exc.errors())) from None


def _usage(generation: Generation) -> MessagesUsage:
    usage = generation.usage()
    cached = usage.prompt_tokens_details.cached_tokens
    return MessagesUsage(
        input_tokens=usage.prompt_tokens - cached, cache_read_input_tokens=cached, output_tokens=usage.completion_tokens
    )


def _stop(finish_reason: str | None, stop_reason: Any, called: bool) -> tuple[str, str | None]:
    """(stop_reason, stop_sequence) in Anthropic's terms."""
    if called:
        return "tool_use", None
    if finish_reason == "stop" and isinstance(stop_reason, str):
        return "stop_sequence", stop_reason
    return _STOP_REASONS.get(finish_reason or "", "end_turn"), None


def _tool_use(name: str, arguments: str, call_id: str | None = None) -> dict[str, Any]:
    try:
        arguments_object = json.loads(arguments) if arguments.strip() else {}
    except json.JSONDecodeError:
        arguments_object = {}
    return {"type": "tool_use", "id": call_id or _tool_use_id(), "name": name, "input": arguments_object}


def _tool_use_id() -> str:
    return "toolu_" + uuid.uuid4().hex[:24]


class MessagesEndpoint(ChatEndpoint):
    """Anthropic's Messages API: chat's preparation and admission, Anthropic's answer."""

    name = "messages"
    fields = MESSAGES
    id_prefix = "msg"

    async def handle_messages(
        self,
        ctx: ServeContext,
        raw: Request,
        request: MessagesRequest,
        tenant: Tenant,
        *,
        route: str | None = None,
        await_first_token: bool = False,
    ) -> Response:
        """As `GenerationEndpoint.handle`, in Anthropic's shapes."""
        check_fields(request, self.fields)
        if request.max_tokens < 1:
            raise bad_request("max_tokens: must be at least 1.", param="max_tokens")
        chat_request = to_chat_request(request)
        generation = await self.begin(ctx, raw, chat_request, tenant, route=route, await_first_token=await_first_token)
        if isinstance(generation, Response):
            return generation
        tools = tool_plan(ctx, chat_request)
        reasoning = ChatReasoning.of(ctx, generation.prompts[0].token_ids)
        stream_body = _stream(generation, tools, reasoning) if request.stream else None
        return await respond(
            raw, generation, stream_body, WholeAnswer(body=lambda _: _response(generation, tools, reasoning))
        )

    async def count_tokens(
        self, ctx: ServeContext, _: Request, request: CountTokensRequest, tenant: Tenant
    ) -> Response:
        # An adapter the tenant may not use is a 404 like an unknown model, as on /v1/messages:
        # counting must not tell another tenant's adapter names from names that do not exist.
        resolve_model(ctx, request.model, tenant)
        check_fields(request, self.fields)
        chat_request = to_chat_request(request)
        # Templating and the tools' grammar check block: off the event loop, as generation's.
        prepared = await asyncio.to_thread(self.prepare, ctx, chat_request, tenant)
        count = sum(len(p.token_ids) for p in prepared.prompts)
        return JSONResponse(CountTokensResponse(input_tokens=count).model_dump())


def _response(generation: Generation, tools: ToolPlan | None, reasoning: ChatReasoning | None) -> MessagesResponse:
    final = generation.finals[0]
    assert final is not None
    sample = final.outputs[0]
    thinking, answer = reasoning.split(sample.text) if reasoning else (None, sample.text)
    content: list[dict[str, Any]] = []
    if thinking is not None:
        content.append({"type": "thinking", "thinking": thinking, "signature": ""})
    text, calls = answer, []
    if tools is not None and tools.parse:
        parsed = tools.parser.parse(answer)
        if parsed.tool_calls:
            text, calls = parsed.content or "", parsed.tool_calls
    if text:
        content.append({"type": "text", "text": text})
    content.extend(_tool_use(call.name, call.arguments) for call in calls)
    stop_reason, stop_sequence = _stop(sample.finish_reason, sample.stop_reason, bool(calls))
    return MessagesResponse(
        id=generation.request_id,
        model=generation.model_name,
        content=content,
        stop_reason=stop_reason,
        stop_sequence=stop_sequence,
        usage=_usage(generation),
    )


class _Blocks:
    """The content blocks of a streamed message: one open at a time, numbered in order."""

    def __init__(self) -> None:
        self.index = -1
        self.open: str | None = None

    def start(self, block: dict[str, Any]) -> str:
        events = self.stop()
        self.index += 1
        self.open = block["type"]
        return events + anthropic_event("content_block_start", {"index": self.index, "content_block": block})

    def delta(self, kind: str, delta: dict[str, Any]) -> str:
        events = ""
        if self.open != kind:
            events = self.start(
                {
                    "text": {"type": "text", "text": ""},
                    "thinking": {"type": "thinking", "thinking": "", "signature": ""},
                }[kind]
            )
        return events + anthropic_event("content_block_delta", {"index": self.index, "delta": delta})

    def stop(self) -> str:
        if self.open is None:
            return ""
        self.open = None
        return anthropic_event("content_block_stop", {"index": self.index})


async def _stream(
    generation: Generation, tools: ToolPlan | None, reasoning: ChatReasoning | None
) -> AsyncIterator[str]:
    usage = _usage(generation)
    yield anthropic_event(
        "message_start",
        {
            "message": {
                "id": generation.request_id,
                "type": "message",
                "role": "assistant",
                "model": generation.model_name,
                "content": [],
                "stop_reason": None,
                "stop_sequence": None,
                "usage": {**usage.model_dump(), "output_tokens": 0},
            }
        },
    )
    blocks = _Blocks()
    tool_stream = ToolCallStream(tools.parser, tools.forced) if tools is not None and tools.parse else None
    reasoning_stream = reasoning.stream() if reasoning is not None else None
    text_so_far = answer_so_far = ""
    stop: tuple[str, str | None] = ("end_turn", None)
    try:
        async for _, delta in generation.deltas():
            for sample in delta.outputs:
                finished = sample.finish_reason is not None
                text_so_far += sample.text
                text = sample.text
                if reasoning_stream is not None:
                    thinking, text = reasoning_stream.step(text_so_far, finished)
                    if thinking:
                        yield blocks.delta("thinking", {"type": "thinking_delta", "thinking": thinking})
                answer_so_far += text
                calls: list[dict[str, Any]] = []
                if tool_stream is not None:
                    text, calls = tool_stream.step(answer_so_far, finished)
                if text:
                    yield blocks.delta("text", {"type": "text_delta", "text": text})
                for call in calls:
                    if "id" in call:
                        yield blocks.start(
                            {"type": "tool_use", "id": _tool_use_id(), "name": call["function"]["name"], "input": {}}
                        )
                    fragment = call["function"].get("arguments")
                    if fragment:
                        yield blocks.delta("tool_use", {"type": "input_json_delta", "partial_json": fragment})
                if finished:
                    stop = _stop(
                        sample.finish_reason, sample.stop_reason, tool_stream is not None and tool_stream.has_calls
                    )
        yield blocks.stop()
        yield anthropic_event(
            "message_delta",
            {
                "delta": {"stop_reason": stop[0], "stop_sequence": stop[1]},
                "usage": {"output_tokens": generation.usage().completion_tokens},
            },
        )
        yield anthropic_event("message_stop", {})
    except APIError as exc:
        yield f"event: error\ndata: {to_json(anthropic_error_body(exc))}\n\n"
