"""POST /v1/responses, GET and DELETE /v1/responses/{id}: OpenAI's Responses API over the chat path.

A Responses body is translated into a chat completion request (`instructions` into a system
message, input items into chat messages: `function_call` items into an assistant message's
tool calls, `function_call_output` into tool messages; flat function tools and `tool_choice`
into chat's; `text.format` into `response_format`), so templating, tool grammars, structured
output, reasoning and admission are chat's. What is this module's own: the answer as output
items (reasoning, message, function_call), the status (`incomplete` when cut by
max_output_tokens), usage with cached and reasoning tokens, the streamed events the `openai`
SDK parses (each numbered by `sequence_number`), and conversation state: a stored response
(responses_store.py) is the history a later request continues with `previous_response_id`.
Errors leave in OpenAI's shape, their params renamed into this API's fields.
"""

from __future__ import annotations

import json
import math
import re
import time
import uuid
from collections.abc import AsyncIterator
from typing import Any

import pydantic
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagoda.serve.admission.tenants import Tenant
from pagoda.serve.api.chat import ChatEndpoint, ChatReasoning, tool_plan
from pagoda.serve.api.handler import PreparedRequest, WholeAnswer, respond
from pagoda.serve.api.protocol import ChatCompletionRequest
from pagoda.serve.api.request_fields import RESPONSES, check_fields
from pagoda.serve.api.responses_protocol import (
    DeletedResponse,
    InputItem,
    InputTokensDetails,
    OutputTokensDetails,
    ResponseObject,
    ResponsesRequest,
    ResponseStatus,
    ResponseUsage,
    TextConfig,
)
from pagoda.serve.api.responses_store import ResponsesStore, response_not_found
from pagoda.serve.api.sse import to_json
from pagoda.serve.api.tool_calls import ToolCallStream, ToolPlan
from pagoda.serve.errors import APIError, bad_request, validation_error
from pagoda.serve.serving import Generation, ServeContext

# finish_reason -> incomplete_details.reason; any other finish completes the response.
_INCOMPLETE = {"length": "max_output_tokens", "content_filter": "content_filter"}
# The chat request's names in errors -> this API's (the first match of a param wins).
_RENAMED_PARAMS = (
    ("response_format.json_schema.schema", "text.format.schema"),
    ("response_format", "text.format"),
    ("max_tokens", "max_output_tokens"),
    ("messages", "input"),
)
_TEXT_PARTS = ("input_text", "output_text", "text")
_MESSAGE_ROLES = ("user", "assistant", "system", "developer")


def _item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


# ---- the request as chat -----------------------------------------------------------------------


def _text_of(content: str | list[dict[str, Any]] | None, where: str) -> str:
    """Text content parts joined; an image, file or audio part is a 400 naming it."""
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        kind = part.get("type")
        text = part.get("refusal") if kind == "refusal" else part.get("text")
        if kind not in (*_TEXT_PARTS, "refusal"):
            raise bad_request(
                f"{where}[{j}] has type {kind!r}; only text is supported (input_text, "
                "output_text; no images, files or audio).",
                param=f"{where}[{j}]",
            )
        if not isinstance(text, str):
            raise bad_request(
                f"{where}[{j}] ({kind}) needs a string {'refusal' if kind == 'refusal' else 'text'}.",
                param=f"{where}[{j}]",
            )
        texts.append(text)
    return "\n".join(texts)


def _message_content(content: str | list[dict[str, Any]] | None, where: str) -> str | list[dict[str, Any]]:
    """A message's content as chat's: its text, or, with `input_image` parts, chat's text and
    `image_url` parts in their order (a data URL or an http(s) URL, which chat decodes or
    fetches under the server's policy); an image by `file_id` is a 400."""
    if not isinstance(content, list) or not any(part.get("type") == "input_image" for part in content):
        return _text_of(content, where)
    parts: list[dict[str, Any]] = []
    for j, part in enumerate(content):
        if part.get("type") != "input_image":
            parts.append({"type": "text", "text": _text_of([part], where)})
            continue
        url = part.get("image_url")
        if not isinstance(url, str) or not url:
            raise bad_request(
                f"{where}[{j}] (input_image) needs an image_url (a data URL or an allowed http(s) URL); "
                "file_id images are not supported.",
                param=f"{where}[{j}]",
            )
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return parts


def input_messages(items: str | list[InputItem]) -> list[dict[str, Any]]:
    """A request's `input` as chat messages; raises a 400 APIError naming the item."""
    if isinstance(items, str):
        return [{"role": "user", "content": items}]
    messages: list[dict[str, Any]] = []
    for i, item in enumerate(items):
        at = f"input[{i}]"
        kind = item.type or ("message" if item.role is not None else None)
        if kind == "message":
            if item.role not in _MESSAGE_ROLES:
                raise bad_request(
                    f"{at}.role must be one of {', '.join(_MESSAGE_ROLES)}, got {item.role!r}.", param=f"{at}.role"
                )
            messages.append({"role": item.role, "content": _message_content(item.content, f"{at}.content")})
        elif kind == "function_call":
            if not item.call_id or not item.name or item.arguments is None:
                raise bad_request(f"{at}: a function_call item needs call_id, name and arguments.", param=at)
            try:
                json.loads(item.arguments or "{}")
            except (json.JSONDecodeError, RecursionError):
                raise bad_request(
                    f"{at}.arguments is not valid JSON (or is nested too deeply).", param=f"{at}.arguments"
                ) from None
            call = {
                "id": item.call_id,
                "type": "function",
                "function": {"name": item.name, "arguments": item.arguments},
            }
            if messages and messages[-1]["role"] == "assistant":  # the calls of one turn, together
                messages[-1].setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": "", "tool_calls": [call]})
        elif kind == "function_call_output":
            if not item.call_id or item.output is None:
                raise bad_request(f"{at}: a function_call_output item needs call_id and output.", param=at)
            messages.append(
                {"role": "tool", "tool_call_id": item.call_id, "content": _text_of(item.output, f"{at}.output")}
            )
        elif kind == "reasoning":
            continue  # earlier turns' thinking is not shown to the model again (as Qwen3/R1 templates do)
        else:
            raise bad_request(
                f"{at} has type {kind!r}; supported input items are message, function_call, "
                "function_call_output and reasoning.",
                param=f"{at}.type",
            )
    if not messages:
        raise bad_request("input must hold at least one message.", param="input")
    return messages


def _chat_tools(request: ResponsesRequest) -> dict[str, Any]:
    fields: dict[str, Any] = {}
    if request.tools:
        tools = []
        for i, tool in enumerate(request.tools):
            if tool.get("type") != "function":
                raise bad_request(
                    f"tools[{i}] has type {tool.get('type')!r}; only function tools are "
                    "supported (no built-in tools such as web_search or file_search).",
                    param=f"tools[{i}].type",
                )
            name, parameters = tool.get("name"), tool.get("parameters")
            if not isinstance(name, str) or not name:
                raise bad_request(f"tools[{i}].name must be a non-empty string.", param=f"tools[{i}].name")
            if parameters is not None and not isinstance(parameters, dict):
                raise bad_request(
                    f"tools[{i}].parameters must be a JSON schema object.", param=f"tools[{i}].parameters"
                )
            function: dict[str, Any] = {"name": name, "parameters": parameters or {"type": "object", "properties": {}}}
            if isinstance(tool.get("description"), str):
                function["description"] = tool["description"]
            tools.append({"type": "function", "function": function})
        fields["tools"] = tools
    choice = request.tool_choice
    if isinstance(choice, str) and choice in ("auto", "none", "required"):
        fields["tool_choice"] = choice
    elif isinstance(choice, dict) and choice.get("type") == "function" and isinstance(choice.get("name"), str):
        fields["tool_choice"] = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None:
        raise bad_request(
            "tool_choice must be 'auto', 'none', 'required' or {\"type\": \"function\", \"name\": ...}.",
            param="tool_choice",
        )
    if request.parallel_tool_calls is False:
        fields["parallel_tool_calls"] = False
    return fields


def _response_format(text: TextConfig | None) -> dict[str, Any] | None:
    """`text.format` as chat's response_format (None: free text)."""
    if text is None or text.format is None or text.format.type == "text":
        return None
    form = text.format
    if form.type == "json_object":
        return {"type": "json_object"}
    if form.type == "json_schema":
        if form.schema_ is None:
            raise bad_request("text.format.schema is required with type 'json_schema'.", param="text.format.schema")
        return {
            "type": "json_schema",
            "json_schema": {"name": form.name or "response", "schema": form.schema_, "strict": form.strict},
        }
    raise bad_request(
        f"text.format type {form.type!r} is not supported; use 'text', 'json_object' or 'json_schema'.",
        param="text.format.type",
    )


def to_chat_request(request: ResponsesRequest, conversation: list[dict[str, Any]]) -> ChatCompletionRequest:
    """The chat completion request a Responses body means, over `conversation` (the stored
    history and this input); raises a 400 APIError."""
    if request.max_output_tokens is not None and request.max_output_tokens < 1:
        raise bad_request("max_output_tokens must be at least 1.", param="max_output_tokens")
    messages = ([{"role": "system", "content": request.instructions}] if request.instructions else []) + conversation
    fields: dict[str, Any] = {
        "model": request.model,
        "messages": messages,
        "stream": request.stream,
        "max_tokens": request.max_output_tokens,
        "temperature": request.temperature,
        "top_p": request.top_p,
        **_chat_tools(request),
    }
    response_format = _response_format(request.text)
    if response_format is not None:
        fields["response_format"] = response_format
    try:
        return ChatCompletionRequest.model_validate(fields)
    except pydantic.ValidationError as exc:
        raise _in_responses_terms(validation_error(list(exc.errors()))) from None


def _in_responses_terms(error: APIError) -> APIError:
    """`error` (raised by the chat path) naming this API's fields; changed in place, so its
    metrics and log bookkeeping stay with it."""
    for old, new in _RENAMED_PARAMS:
        if error.param is not None and (error.param == old or error.param.startswith((old + ".", old + "["))):
            error.param = new + error.param[len(old) :]
            break
    for old, new in _RENAMED_PARAMS:
        error.message = re.sub(rf"\b{re.escape(old)}\b", new, error.message)
    error.args = (error.message,)
    return error


# ---- output items --------------------------------------------------------------------------------


def _message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [] if status == "in_progress" else [_output_text(text)]
    return {"id": item_id, "type": "message", "role": "assistant", "status": status, "content": content}


def _output_text(text: str) -> dict[str, Any]:
    return {"type": "output_text", "text": text, "annotations": [], "logprobs": []}


def _reasoning_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    content = [] if status == "in_progress" else [{"type": "reasoning_text", "text": text}]
    return {"id": item_id, "type": "reasoning", "summary": [], "content": content, "status": status}


def _call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {
        "id": item_id,
        "type": "function_call",
        "call_id": call_id,
        "name": name,
        "arguments": arguments,
        "status": status,
    }


def _echoed(value: Any) -> Any:
    """A request value as the response repeats it: JSON has no NaN or infinity (which lenient
    parsers accept in a request), so those are echoed as null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: _echoed(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_echoed(item) for item in value]
    return value


def _status(finish_reason: str | None) -> tuple[ResponseStatus, dict[str, Any] | None]:
    reason = _INCOMPLETE.get(finish_reason or "")
    return ("incomplete", {"reason": reason}) if reason else ("completed", None)


def _assistant_message(items: list[dict[str, Any]]) -> dict[str, Any]:
    """The answer as the chat message the next turn's template renders (thinking left out)."""
    text = "".join(part["text"] for item in items if item["type"] == "message" for part in item["content"])
    message: dict[str, Any] = {"role": "assistant", "content": text}
    calls = [
        {"id": item["call_id"], "type": "function", "function": {"name": item["name"], "arguments": item["arguments"]}}
        for item in items
        if item["type"] == "function_call"
    ]
    if calls:
        message["tool_calls"] = calls
    return message


class _Answer:
    """One response's body around its output items, and its storing once finished."""

    def __init__(
        self,
        ctx: ServeContext,
        generation: Generation,
        request: ResponsesRequest,
        tenant: Tenant,
        conversation: list[dict[str, Any]],
        store: ResponsesStore | None,
    ) -> None:
        self.ctx = ctx
        self.generation = generation
        self.request = request
        self.tenant = tenant
        self.conversation = conversation
        self.store = store if request.store is not False else None
        self.created_at = int(time.time())

    def body(
        self,
        status: ResponseStatus,
        output: list[dict[str, Any]],
        usage: ResponseUsage | None = None,
        incomplete_details: dict[str, Any] | None = None,
    ) -> ResponseObject:
        request = self.request
        text = request.text.model_dump(by_alias=True, exclude_none=True) if request.text else None
        return ResponseObject(
            id=self.generation.request_id,
            created_at=self.created_at,
            status=status,
            incomplete_details=incomplete_details,
            model=self.generation.model_name,
            instructions=request.instructions,
            output=output,
            parallel_tool_calls=request.parallel_tool_calls is not False,
            tool_choice=_echoed(request.tool_choice or "auto"),
            tools=_echoed(request.tools or []),
            temperature=_echoed(request.temperature),
            top_p=_echoed(request.top_p),
            max_output_tokens=request.max_output_tokens,
            previous_response_id=request.previous_response_id,
            store=self.store is not None,
            **({"text": _echoed(text)} if text and "format" in text else {}),
            metadata=request.metadata or {},
            user=request.user,
            usage=usage,
        )

    def finished(self, output: list[dict[str, Any]], finish_reason: str | None) -> ResponseObject:
        """The final body (stored when the request asked for it)."""
        status, details = _status(finish_reason)
        if status == "incomplete" and output:
            output[-1]["status"] = "incomplete"
        body = self.body(status, output, self._usage(output), details)
        if self.store is not None:
            self.store.put(
                body.id, self.tenant.name, [*self.conversation, _assistant_message(output)], body.model_dump()
            )
        return body

    def _usage(self, output: list[dict[str, Any]]) -> ResponseUsage:
        usage = self.generation.usage()
        thinking = "".join(part["text"] for item in output if item["type"] == "reasoning" for part in item["content"])
        reasoning_tokens = len(self.ctx.llm.tokenizer.encode(thinking, add_special_tokens=False)) if thinking else 0
        return ResponseUsage(
            input_tokens=usage.prompt_tokens,
            input_tokens_details=InputTokensDetails(cached_tokens=usage.prompt_tokens_details.cached_tokens),
            output_tokens=usage.completion_tokens,
            output_tokens_details=OutputTokensDetails(reasoning_tokens=min(reasoning_tokens, usage.completion_tokens)),
            total_tokens=usage.total_tokens,
        )

    def whole(self, tools: ToolPlan | None, reasoning: ChatReasoning | None) -> ResponseObject:
        final = self.generation.finals[0]
        assert final is not None
        sample = final.outputs[0]
        thinking, answer = reasoning.split(sample.text) if reasoning else (None, sample.text)
        output: list[dict[str, Any]] = []
        if thinking is not None:
            output.append(_reasoning_item(_item_id("rs"), thinking, "completed"))
        text, calls = answer, []
        if tools is not None and tools.parse:
            parsed = tools.parser.parse(answer)
            if parsed.tool_calls:
                text, calls = parsed.content or "", parsed.tool_calls
        if text or not (calls or output):
            output.append(_message_item(_item_id("msg"), text, "completed"))
        output.extend(_call_item(_item_id("fc"), call.id, call.name, call.arguments, "completed") for call in calls)
        return self.finished(output, sample.finish_reason)


# ---- streaming -----------------------------------------------------------------------------------


class _StreamedOutput:
    """The output items of a streamed response: one open at a time, each announced
    (output_item.added), filled (deltas) and closed (.done events) in OpenAI's order; every
    event of the stream numbered by sequence_number."""

    def __init__(self) -> None:
        self.sequence = 0
        self.items: list[dict[str, Any]] = []  # closed items, in output order
        self.open: dict[str, Any] | None = None
        self.filled = ""  # the open item's text or arguments so far

    def event(self, kind: str, payload: dict[str, Any]) -> str:
        data = {"type": kind, "sequence_number": self.sequence, **payload}
        self.sequence += 1
        return f"event: {kind}\ndata: {to_json(data)}\n\n"

    def _where(self) -> dict[str, Any]:
        assert self.open is not None
        return {"item_id": self.open["id"], "output_index": len(self.items)}

    def _start(self, item: dict[str, Any]) -> str:
        events = self.close()
        self.open, self.filled = item, ""
        events += self.event("response.output_item.added", {"output_index": len(self.items), "item": item})
        part = {"message": _output_text(""), "reasoning": {"type": "reasoning_text", "text": ""}}.get(item["type"])
        if part is not None:
            events += self.event("response.content_part.added", {**self._where(), "content_index": 0, "part": part})
        return events

    def text(self, delta: str) -> str:
        events = (
            ""
            if self.open and self.open["type"] == "message"
            else self._start(_message_item(_item_id("msg"), "", "in_progress"))
        )
        self.filled += delta
        return events + self.event(
            "response.output_text.delta", {**self._where(), "content_index": 0, "delta": delta, "logprobs": []}
        )

    def empty_message(self) -> str:
        return self._start(_message_item(_item_id("msg"), "", "in_progress"))

    def reasoning(self, delta: str) -> str:
        events = (
            ""
            if self.open and self.open["type"] == "reasoning"
            else self._start(_reasoning_item(_item_id("rs"), "", "in_progress"))
        )
        self.filled += delta
        return events + self.event(
            "response.reasoning_text.delta", {**self._where(), "content_index": 0, "delta": delta}
        )

    def call(self, call_id: str, name: str) -> str:
        return self._start(_call_item(_item_id("fc"), call_id, name, "", "in_progress"))

    def arguments(self, fragment: str) -> str:
        self.filled += fragment
        return self.event("response.function_call_arguments.delta", {**self._where(), "delta": fragment})

    def close(self, status: str = "completed") -> str:
        """The .done events of the open item, if any."""
        item = self.open
        if item is None:
            return ""
        where, filled = self._where(), self.filled
        events = ""
        if item["type"] == "message":
            done = _message_item(item["id"], filled, status)
            events += self.event(
                "response.output_text.done", {**where, "content_index": 0, "text": filled, "logprobs": []}
            )
            events += self.event(
                "response.content_part.done", {**where, "content_index": 0, "part": done["content"][0]}
            )
        elif item["type"] == "reasoning":
            done = _reasoning_item(item["id"], filled, status)
            events += self.event("response.reasoning_text.done", {**where, "content_index": 0, "text": filled})
            events += self.event(
                "response.content_part.done", {**where, "content_index": 0, "part": done["content"][0]}
            )
        else:
            done = _call_item(item["id"], item["call_id"], item["name"], filled, status)
            events += self.event(
                "response.function_call_arguments.done", {**where, "name": item["name"], "arguments": filled}
            )
        events += self.event("response.output_item.done", {"output_index": len(self.items), "item": done})
        self.items.append(done)
        self.open = None
        return events


async def _stream(answer: _Answer, tools: ToolPlan | None, reasoning: ChatReasoning | None) -> AsyncIterator[str]:
    generation = answer.generation
    out = _StreamedOutput()
    opening = answer.body("in_progress", []).model_dump()
    yield out.event("response.created", {"response": opening})
    yield out.event("response.in_progress", {"response": opening})
    tool_stream = ToolCallStream(tools.parser, tools.forced) if tools is not None and tools.parse else None
    reasoning_stream = reasoning.stream() if reasoning is not None else None
    text_so_far = answer_so_far = ""
    finish_reason: str | None = None
    try:
        async for _, delta in generation.deltas():
            for sample in delta.outputs:
                finished = sample.finish_reason is not None
                text_so_far += sample.text
                text = sample.text
                if reasoning_stream is not None:
                    thinking, text = reasoning_stream.step(text_so_far, finished)
                    if thinking:
                        yield out.reasoning(thinking)
                answer_so_far += text
                calls: list[dict[str, Any]] = []
                if tool_stream is not None:
                    text, calls = tool_stream.step(answer_so_far, finished)
                if text:
                    yield out.text(text)
                for call in calls:
                    if "id" in call:
                        yield out.call(call["id"], call["function"]["name"])
                    fragment = call["function"].get("arguments")
                    if fragment:
                        yield out.arguments(fragment)
                if finished:
                    finish_reason = sample.finish_reason
        if not out.items and out.open is None:  # nothing was said: one empty message, as whole answers
            yield out.empty_message()
        yield out.close(_status(finish_reason)[0])
        body = answer.finished(out.items, finish_reason)
        yield out.event("response.completed", {"response": body.model_dump()})
    except APIError as exc:
        # Closed here with the error's status and reason: the stream itself still ends as a 200.
        generation.close(exc.status, exc)
        yield out.event("error", {"code": exc.code or exc.type, "message": exc.message, "param": exc.param})


# ---- the endpoint ----------------------------------------------------------------------------------


class ResponsesEndpoint(ChatEndpoint):
    """OpenAI's Responses API: chat's preparation and admission, the Responses answer, and the
    store of responses (None: --no-responses-store)."""

    name = "responses"
    fields = RESPONSES
    id_prefix = "resp"

    def __init__(self, store: ResponsesStore | None) -> None:
        self.store = store

    async def handle_responses(
        self,
        ctx: ServeContext,
        raw: Request,
        request: ResponsesRequest,
        tenant: Tenant,
        *,
        route: str | None = None,
        await_first_token: bool = False,
    ) -> Response:
        """As `GenerationEndpoint.handle`, in the Responses API's shapes."""
        try:
            check_fields(request, self.fields)
            conversation = [*self._history(request, tenant), *input_messages(request.input)]
            chat_request = to_chat_request(request, conversation)
            generation = await self.begin(
                ctx, raw, chat_request, tenant, route=route, await_first_token=await_first_token
            )
        except APIError as exc:
            raise _in_responses_terms(exc) from None
        if isinstance(generation, Response):
            return generation
        tools = tool_plan(ctx, chat_request)
        reasoning = ChatReasoning.of(ctx, generation.prompts[0].token_ids)
        answer = _Answer(ctx, generation, request, tenant, conversation, self.store)
        stream_body = _stream(answer, tools, reasoning) if request.stream else None
        return await respond(raw, generation, stream_body, WholeAnswer(body=lambda _: answer.whole(tools, reasoning)))

    def prepare(self, ctx: ServeContext, request: ChatCompletionRequest, tenant: Tenant) -> PreparedRequest:
        prepared = super().prepare(ctx, request, tenant)
        prepared.param_names = {"prompt": "input", "max_tokens": "max_output_tokens"}
        return prepared

    def _history(self, request: ResponsesRequest, tenant: Tenant) -> list[dict[str, Any]]:
        """The stored conversation `previous_response_id` continues (empty without one)."""
        if request.previous_response_id is None:
            return []
        if self.store is None:
            raise bad_request(
                "previous_response_id needs stored responses, and this server keeps none "
                "(--no-responses-store): send the whole conversation as input.",
                param="previous_response_id",
            )
        return list(self.store.get(tenant.name, request.previous_response_id, "previous_response_id").conversation)

    def retrieve(self, tenant: Tenant, response_id: str) -> Response:
        if self.store is None:
            raise response_not_found(response_id)
        return JSONResponse(self.store.get(tenant.name, response_id).body)

    def delete(self, tenant: Tenant, response_id: str) -> Response:
        if self.store is None:
            raise response_not_found(response_id)
        self.store.delete(tenant.name, response_id)
        return JSONResponse(DeletedResponse(id=response_id).model_dump())
