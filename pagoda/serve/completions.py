"""POST /v1/completions: legacy text completions, streamed or not."""

from __future__ import annotations

import time
from typing import Any, AsyncIterator

from fastapi import Request
from fastapi.responses import Response

from pagoda.outputs import CompletionOutput, PositionLogprobs
from pagoda.serve.logprobs import join_legacy, legacy_logprobs
from pagoda.serve.errors import APIError, bad_request
from pagoda.serve.guardrails import guard_completion_prompts
from pagoda.serve.protocol import (CompletionChoice, CompletionLogprobs, CompletionRequest,
                                   CompletionResponse)
from pagoda.serve.sampling import build_sampling_params
from pagoda.serve.serving import EnginePrompt, Generation, ServeContext, new_request_id, respond
from pagoda.serve.sse import SSE_DONE, ChoiceChunks, sse_error, sse_event, to_json
from pagoda.serve.tenants import Tenant


def reject_unsupported(request: CompletionRequest) -> None:
    if request.suffix:
        raise bad_request("suffix is not supported.", param="suffix")
    if request.best_of is not None and request.best_of != request.n:
        raise bad_request(f"best_of ({request.best_of}) different from n ({request.n}) is not "
                          "supported.", param="best_of")
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed when stream is true.",
                          param="stream_options")


def completion_prompts(prompt: Any, tokenizer: Any) -> list[EnginePrompt]:
    """A string, list of strings, token ids or list of token-id lists -> one prompt each."""
    if isinstance(prompt, str):
        items: list[Any] = [prompt]
    elif isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        items = [prompt]
    else:
        items = list(prompt)
    if not items:
        raise bad_request("prompt must not be empty.", param="prompt")
    prompts = []
    for item in items:
        if isinstance(item, str):
            if not item:
                raise bad_request("prompt must not be an empty string.", param="prompt")
            prompts.append(EnginePrompt(tokenizer.encode(item, add_special_tokens=True), item))
        else:
            prompts.append(EnginePrompt(list(item)))
    return prompts


class _Choice:
    """What has been sent of one choice while streaming."""

    __slots__ = ("index", "num_chars", "num_tokens", "text_offset", "finished", "started")

    def __init__(self, index: int) -> None:
        self.index = index
        self.num_chars = 0
        self.num_tokens = 0
        self.text_offset = 0
        self.finished = False
        self.started = False


async def create_completion(ctx: ServeContext, raw: Request, request: CompletionRequest,
                            tenant: Tenant) -> Response:
    ctx.check_model(request.model)
    reject_unsupported(request)
    tokenizer = ctx.llm.tokenizer
    prompts = completion_prompts(request.prompt, tokenizer)
    prompts, input_decision = await guard_completion_prompts(ctx, tenant, prompts, tokenizer)  # guardrails hook
    max_tokens = tenant.resolve_max_tokens(request.max_tokens)
    want_prompt_logprobs = request.echo and request.logprobs is not None
    params = build_sampling_params(
        request, ctx.llm.generation_defaults, max_tokens=max_tokens, logprobs=request.logprobs,
        prompt_logprobs=request.logprobs if want_prompt_logprobs else None)
    generation = Generation(ctx, new_request_id("cmpl"), "completions", tenant, prompts,
                            params, stream=request.stream, input_decision=input_decision)
    await generation.start()
    created = int(time.time())
    stream_body = _stream(ctx, generation, request, created) if request.stream else None
    return await respond(raw, generation, stream_body, lambda: _response(ctx, generation, request, created))


def _echo_prefix(prompt: EnginePrompt, tokenizer: Any) -> str:
    return prompt.text if prompt.text is not None else tokenizer.decode(prompt.token_ids)


def _prompt_positions(prompt_logprobs: list[PositionLogprobs | None] | None,
                      prompt: EnginePrompt) -> list[PositionLogprobs | None]:
    return list(prompt_logprobs) if prompt_logprobs else [None] * len(prompt.token_ids)


def _response(ctx: ServeContext, generation: Generation, request: CompletionRequest,
              created: int) -> CompletionResponse:
    tokenizer = ctx.llm.tokenizer
    choices = []
    for i, final in enumerate(generation.finals):
        assert final is not None
        prompt = generation.prompts[i]
        for sample in final.outputs:
            text, logprobs, offset = sample.text, None, 0
            if request.echo:
                prefix = _echo_prefix(prompt, tokenizer)
                text = prefix + text
                if request.logprobs is not None:
                    logprobs, _ = legacy_logprobs(
                        prompt.token_ids, _prompt_positions(final.prompt_logprobs, prompt),
                        tokenizer, 0)
                offset = len(prefix)
            if request.logprobs is not None:
                sampled, _ = legacy_logprobs(sample.token_ids, list(sample.logprobs or []),
                                             tokenizer, offset)
                logprobs = join_legacy(logprobs, sampled)
            choices.append(CompletionChoice(index=i * request.n + sample.index, text=text,
                                            logprobs=logprobs,
                                            finish_reason=sample.finish_reason))
    return CompletionResponse(id=generation.request_id, created=created, model=ctx.model_name,
                              choices=choices, usage=generation.usage())


async def _stream(ctx: ServeContext, generation: Generation, request: CompletionRequest,
                  created: int) -> AsyncIterator[str]:
    tokenizer = ctx.llm.tokenizer
    include_usage = bool(request.stream_options and request.stream_options.include_usage)
    base = {"id": generation.request_id, "object": "text_completion", "created": created,
            "model": ctx.model_name}
    choices: dict[int, _Choice] = {}
    chunks = ChoiceChunks(base, include_usage)

    def chunk(choice: _Choice, text: str, logprobs: CompletionLogprobs | None,
              finish_reason: str | None) -> str:
        logprobs_json = to_json(logprobs.model_dump()) if logprobs is not None else "null"
        finish_json = to_json(finish_reason) if finish_reason is not None else "null"
        return chunks.event(f'"index":{choice.index},"text":{to_json(text)},'
                            f'"logprobs":{logprobs_json},"finish_reason":{finish_json}')

    try:
        async for i, output in generation.outputs():
            prompt = generation.prompts[i]
            for sample in output.outputs:
                index = i * request.n + sample.index
                choice = choices.get(index)
                if choice is None:
                    choice = choices[index] = _Choice(index)
                if choice.finished:
                    continue
                event = _sample_delta(choice, sample, prompt, output.prompt_logprobs, request,
                                      tokenizer)
                if event is not None:
                    yield chunk(choice, *event)
        if include_usage:
            yield sse_event({**base, "choices": [], "usage": generation.usage().model_dump()})
    except APIError as exc:
        yield sse_error(exc)
    yield SSE_DONE


def _sample_delta(choice: _Choice, sample: CompletionOutput, prompt: EnginePrompt,
                  prompt_logprobs: list[PositionLogprobs | None] | None,
                  request: CompletionRequest, tokenizer: Any
                  ) -> tuple[str, CompletionLogprobs | None, str | None] | None:
    text = sample.text[choice.num_chars:]
    logprobs = None
    if not choice.started:
        choice.started = True
        if request.echo:
            prefix = _echo_prefix(prompt, tokenizer)
            if request.logprobs is not None:
                logprobs, _ = legacy_logprobs(
                    prompt.token_ids, _prompt_positions(prompt_logprobs, prompt), tokenizer, 0)
            choice.text_offset = len(prefix)
            text = prefix + text
    if request.logprobs is not None:
        new_ids = sample.token_ids[choice.num_tokens:]
        positions = list((sample.logprobs or [])[choice.num_tokens:])
        sampled, choice.text_offset = legacy_logprobs(new_ids, positions, tokenizer,
                                                      choice.text_offset)
        logprobs = join_legacy(logprobs, sampled)
    choice.num_chars = max(choice.num_chars, len(sample.text))
    choice.num_tokens = len(sample.token_ids)
    finish_reason = sample.finish_reason
    if finish_reason is not None:
        choice.finished = True
    if not text and finish_reason is None and (logprobs is None or not logprobs.tokens):
        return None
    return text, logprobs, finish_reason
