"""POST /v1/completions: legacy text completions, streamed or not.

Only what is this endpoint's own: prompts from `prompt`, echo, the legacy logprobs lists and
the chunk / body shapes. The rest is handler.py's skeleton.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from pagoda.outputs import CompletionDelta, PositionLogprobs, RequestOutputDelta
from pagoda.serve.admission.tenants import Tenant
from pagoda.serve.api.handler import ChunkFormatter, GenerationEndpoint, PreparedRequest
from pagoda.serve.api.logprobs import join_legacy, legacy_logprobs, prompt_logprobs
from pagoda.serve.api.protocol import CompletionChoice, CompletionLogprobs, CompletionRequest, CompletionResponse
from pagoda.serve.api.request_fields import COMPLETIONS
from pagoda.serve.api.sampling import build_sampling_params
from pagoda.serve.api.sse import ChoiceChunks, to_json
from pagoda.serve.api.structured_request import with_structured_outputs
from pagoda.serve.api.truncation import truncate_prompt, truncation_length
from pagoda.serve.errors import bad_request
from pagoda.serve.serving import EnginePrompt, Generation, ServeContext


def _scores_prompt_only(request: CompletionRequest) -> bool:
    return request.echo and request.max_tokens == 0


def _prompt_only_choice(
    index: int, prompt: EnginePrompt, final: Any, request: CompletionRequest, tokenizer: Any
) -> CompletionChoice:
    """The echoed prompt and its logprobs alone, for `max_tokens: 0, echo: true`."""
    logprobs = None
    if request.logprobs is not None:
        logprobs, _ = legacy_logprobs(prompt.token_ids, _prompt_positions(final.prompt_logprobs, prompt), tokenizer, 0)
    return CompletionChoice(
        index=index, text=_echo_prefix(prompt, tokenizer), logprobs=logprobs, finish_reason="length"
    )


def reject_unsupported(request: CompletionRequest) -> None:
    if request.prompt_logprobs is not None and request.stream:
        raise bad_request("prompt_logprobs are not available when stream is true.", param="prompt_logprobs")
    if _scores_prompt_only(request) and request.stream:
        raise bad_request(
            "max_tokens 0 with echo returns the scored prompt only; send it with stream false.", param="stream"
        )
    if request.best_of is not None and request.best_of != request.n and not request.use_beam_search:
        raise bad_request(
            f"best_of ({request.best_of}) different from n ({request.n}) is supported "
            "only with use_beam_search (best_of beams, the n best returned).",
            param="best_of",
        )


def _prompt_items(prompt: Any) -> list[Any]:
    """A string, list of strings, token ids or list of token-id lists -> one item per prompt."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(p, int) for p in prompt):
        return [prompt]
    return list(prompt)


def completion_prompts(prompt: Any, tokenizer: Any) -> list[EnginePrompt]:
    """A string, list of strings, token ids or list of token-id lists -> one prompt each."""
    items = _prompt_items(prompt)
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


class CompletionsEndpoint(GenerationEndpoint[CompletionRequest]):
    name = "completions"
    fields = COMPLETIONS
    id_prefix = "cmpl"
    chunk_object = "text_completion"

    def num_prompts(self, request: CompletionRequest) -> int:
        return max(len(_prompt_items(request.prompt)), 1)

    def prepare(self, ctx: ServeContext, request: CompletionRequest, tenant: Tenant) -> PreparedRequest:
        reject_unsupported(request)
        keep = truncation_length(request.truncate_prompt_tokens, ctx.llm.max_model_len)
        texts = (
            [request.prompt] if isinstance(request.prompt, str) else [p for p in request.prompt if isinstance(p, str)]
        )
        for text in texts if keep is None else ():  # a truncated prompt fits whatever its length
            ctx.check_text_fits(text, "prompt")
        prompts = [
            truncate_prompt(prompt, keep, request.truncation_side)
            for prompt in completion_prompts(request.prompt, ctx.llm.tokenizer)
        ]
        # Scoring a prompt (lm-eval's loglikelihood): the engine computes one token, which the
        # answer leaves out, as vLLM does.
        max_tokens = tenant.resolve_max_tokens(1 if _scores_prompt_only(request) else request.max_tokens)
        num_prompt_logprobs = request.prompt_logprobs
        if num_prompt_logprobs is None and request.echo and request.logprobs is not None:
            num_prompt_logprobs = request.logprobs  # the echoed prompt's logprobs
        params = build_sampling_params(
            request,
            ctx.llm.generation_defaults,
            max_tokens=max_tokens,
            logprobs=request.logprobs,
            prompt_logprobs=num_prompt_logprobs,
        )
        params = with_structured_outputs(params, request)  # structured output
        return PreparedRequest(prompts, params)

    def formatter(
        self, ctx: ServeContext, generation: Generation, request: CompletionRequest, chunks: ChoiceChunks
    ) -> ChunkFormatter:
        return _CompletionChunks(generation, request, ctx.llm.tokenizer, chunks)

    def choices(
        self, ctx: ServeContext, generation: Generation, request: CompletionRequest
    ) -> Iterator[CompletionChoice]:
        tokenizer = ctx.llm.tokenizer
        prompt_only = _scores_prompt_only(request)
        for i, final in enumerate(generation.finals):
            assert final is not None
            prompt = generation.prompts[i]
            scored_prompt = None
            if request.prompt_logprobs is not None:
                scored_prompt = prompt_logprobs(prompt.token_ids, final.prompt_logprobs, tokenizer)
            for sample in final.outputs:
                if prompt_only:
                    choice = _prompt_only_choice(i * request.n + sample.index, prompt, final, request, tokenizer)
                    choice.prompt_logprobs = scored_prompt
                    if request.return_token_ids:
                        choice.prompt_token_ids, choice.token_ids = prompt.token_ids, []
                    yield choice
                    continue
                text, logprobs, offset = sample.text, None, 0
                if request.echo:
                    prefix = _echo_prefix(prompt, tokenizer)
                    text = prefix + text
                    if request.logprobs is not None:
                        logprobs, _ = legacy_logprobs(
                            prompt.token_ids, _prompt_positions(final.prompt_logprobs, prompt), tokenizer, 0
                        )
                    offset = len(prefix)
                if request.logprobs is not None:
                    sampled, _ = legacy_logprobs(sample.token_ids, list(sample.logprobs or []), tokenizer, offset)
                    logprobs = join_legacy(logprobs, sampled)
                yield CompletionChoice(
                    index=i * request.n + sample.index,
                    text=text,
                    logprobs=logprobs,
                    finish_reason=sample.finish_reason,
                    prompt_logprobs=scored_prompt,
                    prompt_token_ids=prompt.token_ids if request.return_token_ids else None,
                    token_ids=sample.token_ids if request.return_token_ids else None,
                )

    def response(
        self,
        ctx: ServeContext,
        generation: Generation,
        request: CompletionRequest,
        created: int,
        choices: list[CompletionChoice],
    ) -> CompletionResponse:
        usage = generation.usage()
        if _scores_prompt_only(request):
            usage = usage.model_copy(update={"completion_tokens": 0, "total_tokens": usage.prompt_tokens})
        return CompletionResponse(
            id=generation.request_id, created=created, model=generation.model_name, choices=choices, usage=usage
        )


class _CompletionChunks(ChunkFormatter):
    """A choice's first chunk carries the echoed prompt; legacy logprobs need each token's
    offset in the choice's text, so that offset is kept per choice."""

    def __init__(
        self, generation: Generation, request: CompletionRequest, tokenizer: Any, chunks: ChoiceChunks
    ) -> None:
        self.generation = generation
        self.request = request
        self.tokenizer = tokenizer
        self.chunks = chunks
        self.text_offsets: dict[int, int] = {}  # choice index -> offset of its next token

    def chunk(self, prompt_index: int, sample: CompletionDelta, delta: RequestOutputDelta) -> str | None:
        request, tokenizer = self.request, self.tokenizer
        index = prompt_index * request.n + sample.index
        text = sample.text
        logprobs: CompletionLogprobs | None = None
        offset = self.text_offsets.get(index)
        token_ids_json = ""  # with return_token_ids: the prompt's on the first chunk, then the new tokens
        if request.return_token_ids:
            token_ids_json = f',"token_ids":{to_json(sample.token_ids)}'
        if offset is None:  # the choice's first chunk
            offset = 0
            if request.return_token_ids:
                prompt_ids = self.generation.prompts[prompt_index].token_ids
                token_ids_json += f',"prompt_token_ids":{to_json(prompt_ids)}'
            if request.echo:
                prompt = self.generation.prompts[prompt_index]
                prefix = _echo_prefix(prompt, tokenizer)
                if request.logprobs is not None:
                    output = self.generation.latest[prompt_index]
                    prompt_logprobs = output.prompt_logprobs if output is not None else None
                    logprobs, _ = legacy_logprobs(
                        prompt.token_ids, _prompt_positions(prompt_logprobs, prompt), tokenizer, 0
                    )
                offset = len(prefix)
                text = prefix + text
        if request.logprobs is not None:
            sampled, offset = legacy_logprobs(sample.token_ids, list(sample.logprobs or []), tokenizer, offset)
            logprobs = join_legacy(logprobs, sampled)
        self.text_offsets[index] = offset
        finish_reason = sample.finish_reason
        if (
            not text
            and finish_reason is None
            and (logprobs is None or not logprobs.tokens)
            and not (request.return_token_ids and sample.token_ids)
        ):
            return None
        logprobs_json = to_json(logprobs.model_dump()) if logprobs is not None else "null"
        finish_json = to_json(finish_reason) if finish_reason is not None else "null"
        return self.chunks.event(
            f'"index":{index},"text":{to_json(text)},'
            f'"logprobs":{logprobs_json},"finish_reason":{finish_json}{token_ids_json}'
        )


def _echo_prefix(prompt: EnginePrompt, tokenizer: Any) -> str:
    return prompt.text if prompt.text is not None else tokenizer.decode(prompt.token_ids)


def _prompt_positions(
    prompt_logprobs: list[PositionLogprobs | None] | None, prompt: EnginePrompt
) -> list[PositionLogprobs | None]:
    return list(prompt_logprobs) if prompt_logprobs else [None] * len(prompt.token_ids)
