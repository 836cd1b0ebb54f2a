"""POST /v1/chat/completions: messages through the model's chat template, streamed or not.

Only what is this endpoint's own: the prompt from messages, the chat logprobs shape and the
chunk / body shapes. The rest is handler.py's skeleton.
"""

from __future__ import annotations

import json
from typing import Any

from pagoda.errors import InvalidRequest
from pagoda.outputs import CompletionDelta, RequestOutputDelta
from pagoda.serve.errors import bad_request, invalid_request
from pagoda.serve.handler import ChunkFormatter, GenerationEndpoint, PreparedRequest
from pagoda.serve.logprobs import chat_logprobs
from pagoda.serve.messages import template_messages
from pagoda.serve.protocol import (AssistantMessage, ChatChoice, ChatChoiceLogprobs,
                                   ChatCompletionRequest, ChatCompletionResponse)
from pagoda.serve.sampling import build_sampling_params
from pagoda.serve.serving import EnginePrompt, Generation, ServeContext
from pagoda.serve.sse import ChoiceChunks, to_json
from pagoda.serve.tenants import Tenant


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


def _message_texts(messages: list[Any]) -> list[str]:
    texts = []
    for message in messages:
        content = message.content
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(part.text for part in content if part.text)
    return texts


class ChatEndpoint(GenerationEndpoint[ChatCompletionRequest]):
    name = "chat"
    id_prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"

    def prepare(self, ctx: ServeContext, request: ChatCompletionRequest,
                tenant: Tenant) -> PreparedRequest:
        reject_unsupported(request)
        ctx.check_text_fits("".join(_message_texts(request.messages)), "messages")
        tokenizer = ctx.llm.tokenizer

        def render(messages: list[dict[str, Any]]) -> EnginePrompt:
            try:
                token_ids = tokenizer.encode_chat(
                    messages, add_generation_prompt=request.add_generation_prompt)
            except InvalidRequest as exc:
                raise invalid_request(exc) from None
            return EnginePrompt(token_ids, json.dumps(messages, ensure_ascii=False))

        try:
            messages = template_messages(request.messages)
        except InvalidRequest as exc:
            raise invalid_request(exc) from None
        prompt = render(messages)
        max_param = "max_completion_tokens" if request.max_completion_tokens is not None \
            else "max_tokens"
        requested = request.max_completion_tokens if request.max_completion_tokens is not None \
            else request.max_tokens
        max_tokens = tenant.resolve_max_tokens(requested, max_param)
        params = build_sampling_params(request, ctx.llm.generation_defaults, max_tokens=max_tokens,
                                       logprobs=(request.top_logprobs or 0) if request.logprobs
                                       else None)
        return PreparedRequest([prompt], params,
                               param_names={"prompt": "messages", "max_tokens": max_param},
                               messages=messages, render_messages=render)

    def formatter(self, ctx: ServeContext, generation: Generation,
                  request: ChatCompletionRequest, chunks: ChoiceChunks) -> ChunkFormatter:
        return _ChatChunks(request, ctx.llm.tokenizer, chunks)

    def response(self, ctx: ServeContext, generation: Generation, request: ChatCompletionRequest,
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


class _ChatChunks(ChunkFormatter):
    def __init__(self, request: ChatCompletionRequest, tokenizer: Any,
                 chunks: ChoiceChunks) -> None:
        self.request = request
        self.tokenizer = tokenizer
        self.chunks = chunks

    def opening(self) -> list[str]:
        return [self._event(index, '{"role":"assistant","content":""}', None, None)
                for index in range(self.request.n)]

    def chunk(self, prompt_index: int, sample: CompletionDelta,
              delta: RequestOutputDelta) -> str | None:
        logprobs = None
        if self.request.logprobs:
            entries = chat_logprobs(sample.token_ids, list(sample.logprobs or []),
                                    self.request.top_logprobs or 0, self.tokenizer)
            if entries:
                logprobs = {"content": [e.model_dump() for e in entries], "refusal": None}
        text = sample.text
        if not text and sample.finish_reason is None and logprobs is None:
            return None
        delta_json = '{"content":' + to_json(text) + "}" if text else "{}"
        return self._event(sample.index, delta_json, logprobs, sample.finish_reason)

    def _event(self, index: int, delta_json: str, logprobs: Any, finish_reason: str | None) -> str:
        logprobs_json = to_json(logprobs) if logprobs is not None else "null"
        finish_json = to_json(finish_reason) if finish_reason is not None else "null"
        return self.chunks.event(f'"index":{index},"delta":{delta_json},"logprobs":{logprobs_json},'
                                 f'"finish_reason":{finish_json}')
