"""POST /v1/chat/completions: messages through the model's chat template, streamed or not.

Only what is this endpoint's own: the prompt from messages, the chat logprobs shape and the
chunk / body shapes, and tool calling (tools into the template and the grammar, tool calls
parsed out of the text: pagoda/serve/api/tool_calls.py), the template choice
(pagoda/serve/api/chat_template.py), and reasoning models (the thinking
split from the answer, `chat_template_kwargs`: pagoda/serve/api/reasoning.py). The rest is
handler.py's skeleton.
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

from pagoda.errors import InvalidRequest
from pagoda.media_item import MediaItem
from pagoda.outputs import CompletionDelta, RequestOutputDelta
from pagoda.serve.admission.tenants import Tenant
from pagoda.serve.api.chat_template import ChatTemplateChoice, choose_chat_template
from pagoda.serve.api.handler import ChunkFormatter, GenerationEndpoint, PreparedRequest
from pagoda.serve.api.images import take_images
from pagoda.serve.api.logprobs import chat_logprobs, prompt_logprobs
from pagoda.serve.api.messages import message_texts, template_messages
from pagoda.serve.api.protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChoiceLogprobs,
    ChatCompletionRequest,
    ChatCompletionResponse,
)
from pagoda.serve.api.reasoning import (
    ReasoningParser,
    ReasoningStream,
    after_reasoning,
    check_template_kwargs,
    get_reasoning_parser,
)
from pagoda.serve.api.request_fields import CHAT
from pagoda.serve.api.sampling import build_sampling_params
from pagoda.serve.api.sse import ChoiceChunks, to_json
from pagoda.serve.api.structured_request import with_structured_outputs
from pagoda.serve.api.tool_calls import ToolCallStream, ToolPlan, plan_tools, with_tool_constraint
from pagoda.serve.api.truncation import truncate_prompt, truncation_length
from pagoda.serve.errors import bad_request, invalid_request
from pagoda.serve.serving import EnginePrompt, Generation, ServeContext


def reject_unsupported(request: ChatCompletionRequest) -> None:
    if request.top_logprobs is not None and not request.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true.", param="top_logprobs")
    if request.prompt_logprobs is not None and request.stream:
        raise bad_request("prompt_logprobs are not available when stream is true.", param="prompt_logprobs")


class ChatEndpoint(GenerationEndpoint[ChatCompletionRequest]):
    name = "chat"
    fields = CHAT
    id_prefix = "chatcmpl"
    chunk_object = "chat.completion.chunk"

    def prepare(self, ctx: ServeContext, request: ChatCompletionRequest, tenant: Tenant) -> PreparedRequest:
        reject_unsupported(request)
        keep = truncation_length(request.truncate_prompt_tokens, ctx.llm.max_model_len)
        if keep is None:  # a truncated prompt fits whatever its length
            ctx.check_text_fits("".join(message_texts(request.messages)), "messages")
        tokenizer = ctx.llm.tokenizer
        template = template_choice(ctx, request)
        # Tool calling: the tools are validated here and shown to the chat template.
        tools = plan_tools(request, ctx.settings.tool_call_parser, template.template)
        template_tools: dict[str, Any] = {"tools": tools.tools} if tools else {}
        template_kwargs = check_template_kwargs(request.chat_template_kwargs)

        try:  # image parts: decoded here, the placeholder left in their place
            chat_messages, images = take_images(request.messages, ctx.media)
        except InvalidRequest as exc:
            raise invalid_request(exc) from None
        if images and keep is not None:
            raise bad_request("truncate_prompt_tokens cannot cut a prompt with images.", param="truncate_prompt_tokens")

        def render(messages: list[dict[str, Any]]) -> EnginePrompt:
            try:
                media: tuple[MediaItem, ...] = ()
                if images:  # each placeholder expanded to the image's feature rows
                    rendered = tokenizer.apply_chat_template(
                        messages, **template.kwargs, **template_kwargs, **template_tools
                    )
                    # The template writes BOS itself (as encode_chat does, no special tokens added).
                    token_ids = tokenizer.encode(ctx.media.prepare_text(rendered), add_special_tokens=False)
                    token_ids, media = ctx.media.expand(token_ids, images)
                else:
                    token_ids = tokenizer.encode_chat(messages, **template.kwargs, **template_kwargs, **template_tools)
            except InvalidRequest as exc:
                raise invalid_request(exc) from None
            if keep is not None and len(token_ids) > keep:
                return truncate_prompt(EnginePrompt(token_ids), keep, request.truncation_side)
            return EnginePrompt(token_ids, json.dumps(messages, ensure_ascii=False), media)

        try:
            messages = template_messages(chat_messages, tokenizer)
        except InvalidRequest as exc:
            raise invalid_request(exc) from None
        prompt = render(messages)
        max_param = "max_completion_tokens" if request.max_completion_tokens is not None else "max_tokens"
        requested = request.max_completion_tokens if request.max_completion_tokens is not None else request.max_tokens
        max_tokens = tenant.resolve_max_tokens(requested, max_param)
        params = build_sampling_params(
            request,
            ctx.llm.generation_defaults,
            max_tokens=max_tokens,
            logprobs=(request.top_logprobs or 0) if request.logprobs else None,
            prompt_logprobs=request.prompt_logprobs,
        )
        # Structured output and tool calling (at most one grammar, checked here: prepare runs
        # off the event loop).
        params = with_tool_constraint(with_structured_outputs(params, request), tools)
        reasoning = ChatReasoning.of(ctx, prompt.token_ids)
        if reasoning is not None:  # the constraint applies to the answer after the thinking
            params = after_reasoning(params, reasoning.parser, reasoning.prompt_tail)
        return PreparedRequest(
            [prompt],
            params,
            param_names={"prompt": "messages", "max_tokens": max_param},
            messages=messages,
            render_messages=render,
        )

    def formatter(
        self, ctx: ServeContext, generation: Generation, request: ChatCompletionRequest, chunks: ChoiceChunks
    ) -> ChunkFormatter:
        return _ChatChunks(
            request,
            ctx.llm.tokenizer,
            chunks,
            tool_plan(ctx, request),
            ChatReasoning.of(ctx, generation.prompts[0].token_ids),
            prompt_token_ids=generation.prompts[0].token_ids,
        )

    def choices(
        self, ctx: ServeContext, generation: Generation, request: ChatCompletionRequest
    ) -> Iterator[ChatChoice]:
        final = generation.finals[0]
        assert final is not None
        tools = tool_plan(ctx, request)
        reasoning = ChatReasoning.of(ctx, generation.prompts[0].token_ids)
        for sample in final.outputs:
            logprobs = None
            if request.logprobs:
                logprobs = ChatChoiceLogprobs(
                    content=chat_logprobs(
                        sample.token_ids, list(sample.logprobs or []), request.top_logprobs or 0, ctx.llm.tokenizer
                    )
                )
            thinking, answer = reasoning.split(sample.text) if reasoning else (None, sample.text)
            message, finish_reason = AssistantMessage(content=answer), sample.finish_reason
            if tools is not None:  # tool calling: the calls parsed out of the final answer
                message, finish_reason = tools.message(answer, finish_reason)
            message.reasoning_content = thinking
            yield ChatChoice(
                index=sample.index,
                message=message,
                logprobs=logprobs,
                finish_reason=finish_reason,
                token_ids=sample.token_ids if request.return_token_ids else None,
            )

    def response(
        self,
        ctx: ServeContext,
        generation: Generation,
        request: ChatCompletionRequest,
        created: int,
        choices: list[ChatChoice],
    ) -> ChatCompletionResponse:
        scored_prompt = None
        if request.prompt_logprobs is not None:
            final = generation.finals[0]
            assert final is not None
            scored_prompt = prompt_logprobs(generation.prompts[0].token_ids, final.prompt_logprobs, ctx.llm.tokenizer)
        return ChatCompletionResponse(
            id=generation.request_id,
            created=created,
            model=generation.model_name,
            choices=choices,
            usage=generation.usage(),
            prompt_logprobs=scored_prompt,
            prompt_token_ids=generation.prompts[0].token_ids if request.return_token_ids else None,
        )


def template_choice(ctx: ServeContext, request: Any) -> ChatTemplateChoice:
    return choose_chat_template(
        request, ctx.settings.chat_template, ctx.settings.trust_request_chat_template, ctx.llm.tokenizer
    )


def tool_plan(ctx: ServeContext, request: ChatCompletionRequest) -> ToolPlan | None:
    """The request's tool plan (already validated by `prepare`, so this cannot fail)."""
    if not request.tools and not request.functions:
        return None
    return plan_tools(request, ctx.settings.tool_call_parser, template_choice(ctx, request).template)


class ChatReasoning:
    """A request's reasoning parser and whether its prompt left the thinking open."""

    # Prompt tokens enough to hold the template's last thinking marker.
    TAIL_TOKENS = 32

    def __init__(self, parser: ReasoningParser, prompt_tail: str) -> None:
        self.parser = parser
        self.prompt_tail = prompt_tail
        self.opened = parser.opened_by_prompt(prompt_tail)

    @classmethod
    def of(cls, ctx: ServeContext, prompt_token_ids: list[int]) -> ChatReasoning | None:
        parser = get_reasoning_parser(ctx.settings.reasoning_parser)
        if parser is None:
            return None
        tail = ctx.llm.tokenizer.decode(prompt_token_ids[-cls.TAIL_TOKENS :], skip_special_tokens=False)
        return cls(parser, tail)

    def split(self, text: str) -> tuple[str | None, str]:
        return self.parser.split(text, self.opened)

    def stream(self) -> ReasoningStream:
        return ReasoningStream(self.parser, self.opened)


class _ChatChunks(ChunkFormatter):
    """With tools, each choice keeps a ToolCallStream: content is sent until a tool call may be
    starting, then the calls as OpenAI's tool_calls deltas (finish_reason "tool_calls"). With
    a reasoning parser, each choice keeps a ReasoningStream: the thinking goes out as
    `reasoning_content` deltas, and only the answer reaches the content and the tool parser."""

    def __init__(
        self,
        request: ChatCompletionRequest,
        tokenizer: Any,
        chunks: ChoiceChunks,
        tools: ToolPlan | None = None,
        reasoning: ChatReasoning | None = None,
        prompt_token_ids: list[int] | None = None,
    ) -> None:
        self.request = request
        self.prompt_token_ids = prompt_token_ids
        self.tokenizer = tokenizer
        self.chunks = chunks
        self.tools = tools
        self.tool_streams = (
            {index: ToolCallStream(tools.parser, tools.forced) for index in range(request.n)}
            if tools and tools.parse
            else {}
        )
        self.reasoning_streams = {index: reasoning.stream() for index in range(request.n)} if reasoning else {}
        self.texts: dict[int, str] = {}  # choice index -> its text so far (the parsers read it whole)
        self.answers: dict[int, str] = {}  # choice index -> the answer after its thinking, so far

    def opening(self) -> list[str]:
        events = [
            self._event(index, '{"role":"assistant","content":""}', None, None) for index in range(self.request.n)
        ]
        if self.request.return_token_ids and self.prompt_token_ids is not None:
            # vLLM sends the prompt's token ids as a member of the first chunk itself.
            events[0] = events[0].replace(
                ',"choices":[', f',"prompt_token_ids":{to_json(self.prompt_token_ids)},"choices":[', 1
            )
        return events

    def chunk(self, prompt_index: int, sample: CompletionDelta, delta: RequestOutputDelta) -> str | None:
        logprobs = None
        if self.request.logprobs:
            entries = chat_logprobs(
                sample.token_ids, list(sample.logprobs or []), self.request.top_logprobs or 0, self.tokenizer
            )
            if entries:
                logprobs = {"content": [e.model_dump() for e in entries], "refusal": None}
        text, finish_reason = sample.text, sample.finish_reason
        events = ""
        reasoning_stream = self.reasoning_streams.get(sample.index)
        tool_stream = self.tool_streams.get(sample.index)
        if reasoning_stream is not None:  # the thinking as reasoning_content, then the answer
            so_far = self.texts[sample.index] = self.texts.get(sample.index, "") + sample.text
            thinking, text = reasoning_stream.step(so_far, finish_reason is not None)
            self.answers[sample.index] = self.answers.get(sample.index, "") + text
            if thinking:
                events += self._event(sample.index, '{"reasoning_content":' + to_json(thinking) + "}", None, None)
        if tool_stream is not None:  # content up to a tool call, then the calls
            if reasoning_stream is not None:
                so_far = self.answers[sample.index]
            else:
                so_far = self.texts[sample.index] = self.texts.get(sample.index, "") + sample.text
            text, call_deltas = tool_stream.step(so_far, finish_reason is not None)
            assert self.tools is not None
            for position, call_delta in enumerate(call_deltas):
                content = {"content": text} if text and position == 0 else {}
                shaped = self.tools.stream_delta(call_delta)
                if shaped is not None or content:
                    events += self._event(sample.index, to_json({**content, **(shaped or {})}), None, None)
            text = "" if call_deltas else text
            if tool_stream.has_calls and finish_reason == "stop":
                finish_reason = self.tools.call_finish_reason
        token_ids = sample.token_ids if self.request.return_token_ids else None
        if not text and finish_reason is None and logprobs is None and not token_ids:
            return events or None
        delta_json = '{"content":' + to_json(text) + "}" if text else "{}"
        return events + self._event(sample.index, delta_json, logprobs, finish_reason, token_ids)

    def _event(
        self, index: int, delta_json: str, logprobs: Any, finish_reason: str | None, token_ids: list[int] | None = None
    ) -> str:
        logprobs_json = to_json(logprobs) if logprobs is not None else "null"
        finish_json = to_json(finish_reason) if finish_reason is not None else "null"
        token_ids_json = f',"token_ids":{to_json(token_ids)}' if token_ids is not None else ""
        return self.chunks.event(
            f'"index":{index},"delta":{delta_json},"logprobs":{logprobs_json},'
            f'"finish_reason":{finish_json}{token_ids_json}'
        )
