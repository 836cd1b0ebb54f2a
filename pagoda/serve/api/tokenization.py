"""POST /tokenize and POST /detokenize, in vLLM's shapes.

Both run on worker threads (the default executor, as generation requests prepare), at most
`max_concurrent` at once so that a flood of them leaves threads to generation requests, and at
most `max_waiting` more waiting for a turn (then 503). They accept what a prompt may be: a text
provably longer than the context is refused before tokenizing (as completions refuse it), and
so is a text or a token list over the context, which bounds every answer.
"""

from __future__ import annotations

import asyncio
import os
from collections.abc import Callable
from typing import TypeVar

import pydantic
from fastapi.responses import JSONResponse, Response

from pagoda.errors import InvalidRequest
from pagoda.serve.admission.tenants import Tenant
from pagoda.serve.api.chat_template import choose_chat_template
from pagoda.serve.api.json_body import model_json
from pagoda.serve.api.lora import resolve_model
from pagoda.serve.api.messages import message_texts, template_messages
from pagoda.serve.api.protocol import DetokenizeRequest, DetokenizeResponse, TokenizeRequest, TokenizeResponse
from pagoda.serve.errors import bad_request, invalid_request, overloaded
from pagoda.serve.serving import ServeContext

T = TypeVar("T")

RETRY_AFTER_SECONDS = 1
MAX_WAITING = 64


def default_max_concurrent() -> int:
    """Half the worker threads asyncio's default executor has (min(32, cores + 4))."""
    return max(1, min(32, (os.cpu_count() or 1) + 4) // 2)


class TokenizationEndpoints:
    """The two endpoints of one app, sharing their bound on worker threads."""

    def __init__(self, ctx: ServeContext, max_concurrent: int | None = None, max_waiting: int = MAX_WAITING) -> None:
        self.ctx = ctx
        self.max_concurrent = max_concurrent or default_max_concurrent()
        self.max_waiting = max_waiting
        self._turns = asyncio.Semaphore(self.max_concurrent)
        self._waiting = 0

    async def tokenize(self, request: TokenizeRequest, tenant: Tenant) -> Response:
        resolve_model(self.ctx, request.model, tenant)  # the base model or an adapter: one tokenizer
        if (request.prompt is None) == (request.messages is None):
            raise bad_request("Give exactly one of prompt or messages.", param="prompt")
        return await self.on_worker(self._tokenize, request)

    async def detokenize(self, request: DetokenizeRequest, tenant: Tenant) -> Response:
        resolve_model(self.ctx, request.model, tenant)
        max_model_len = self.ctx.llm.max_model_len
        if len(request.tokens) > max_model_len:
            raise bad_request(
                f"tokens holds {len(request.tokens)} token ids, more than this model's "
                f"maximum context length of {max_model_len} tokens.",
                param="tokens",
                code="context_length_exceeded",
            )
        return await self.on_worker(self._detokenize, request)

    async def on_worker(self, work: Callable[[T], Response], request: T) -> Response:
        if self._turns.locked() and self._waiting >= self.max_waiting:
            raise overloaded(
                f"{self.max_concurrent} tokenization requests are running and {self._waiting} waiting; retry shortly.",
                RETRY_AFTER_SECONDS,
            )
        self._waiting += 1
        try:
            await self._turns.acquire()
        finally:
            self._waiting -= 1
        try:
            return await asyncio.to_thread(work, request)
        finally:
            self._turns.release()

    def _tokenize(self, request: TokenizeRequest) -> Response:
        ctx = self.ctx
        tokenizer = ctx.llm.tokenizer
        if request.messages is not None:
            param = "messages"
            ctx.check_text_fits("".join(message_texts(request.messages)), param)
            try:
                template = choose_chat_template(
                    request, ctx.settings.chat_template, ctx.settings.trust_request_chat_template, tokenizer
                )
                tokens = tokenizer.encode_chat(template_messages(request.messages, tokenizer), **template.kwargs)
            except InvalidRequest as exc:
                raise invalid_request(exc) from None
        else:
            assert request.prompt is not None
            param = "prompt"
            ctx.check_text_fits(request.prompt, param)
            tokens = tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
        max_model_len = ctx.llm.max_model_len
        if len(tokens) > max_model_len:
            raise bad_request(
                f"This model's maximum context length is {max_model_len} tokens; the {param} is {len(tokens)} tokens.",
                param=param,
                code="context_length_exceeded",
            )
        token_strs = [tokenizer.decode_token(t) for t in tokens] if request.return_token_strs else None
        return _json(
            TokenizeResponse(count=len(tokens), max_model_len=max_model_len, tokens=list(tokens), token_strs=token_strs)
        )

    def _detokenize(self, request: DetokenizeRequest) -> Response:
        tokenizer = self.ctx.llm.tokenizer
        vocab_size = tokenizer.vocab_size
        for token_id in request.tokens:
            if not 0 <= token_id < vocab_size:
                raise bad_request(
                    f"tokens contains {token_id}, outside the vocabulary [0, {vocab_size}).", param="tokens"
                )
        return _json(DetokenizeResponse(prompt=tokenizer.decode(request.tokens)))


def _json(model: pydantic.BaseModel) -> Response:
    return Response(model_json(model).encode("utf-8"), media_type=JSONResponse.media_type)
