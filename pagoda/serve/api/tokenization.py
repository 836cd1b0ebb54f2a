"""POST /tokenize and POST /detokenize, in vLLM's shapes."""

from __future__ import annotations

from pagoda.errors import InvalidRequest
from pagoda.serve.errors import bad_request, invalid_request
from pagoda.serve.api.lora import resolve_model
from pagoda.serve.api.messages import template_messages
from pagoda.serve.api.protocol import (DetokenizeRequest, DetokenizeResponse, TokenizeRequest,
                                   TokenizeResponse)
from pagoda.serve.serving import ServeContext
from pagoda.serve.admission.tenants import Tenant


def tokenize(ctx: ServeContext, request: TokenizeRequest, tenant: Tenant) -> TokenizeResponse:
    resolve_model(ctx, request.model, tenant)  # the base model or an adapter: one tokenizer
    tokenizer = ctx.llm.tokenizer
    if (request.prompt is None) == (request.messages is None):
        raise bad_request("Give exactly one of prompt or messages.", param="prompt")
    if request.messages is not None:
        try:
            tokens = tokenizer.encode_chat(template_messages(request.messages),
                                           add_generation_prompt=request.add_generation_prompt)
        except InvalidRequest as exc:
            raise invalid_request(exc) from None
    else:
        assert request.prompt is not None
        tokens = tokenizer.encode(request.prompt, add_special_tokens=request.add_special_tokens)
    token_strs = [tokenizer.decode_token(t) for t in tokens] if request.return_token_strs else None
    return TokenizeResponse(count=len(tokens), max_model_len=ctx.llm.max_model_len,
                            tokens=list(tokens), token_strs=token_strs)


def detokenize(ctx: ServeContext, request: DetokenizeRequest, tenant: Tenant) -> DetokenizeResponse:
    resolve_model(ctx, request.model, tenant)
    tokenizer = ctx.llm.tokenizer
    vocab_size = tokenizer.vocab_size
    for token_id in request.tokens:
        if not 0 <= token_id < vocab_size:
            raise bad_request(f"tokens contains {token_id}, outside the vocabulary "
                              f"[0, {vocab_size}).", param="tokens")
    return DetokenizeResponse(prompt=tokenizer.decode(request.tokens))

