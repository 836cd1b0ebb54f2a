"""POST /v1/score, /v1/rerank (also /rerank and /v2/rerank: Cohere's v1 and v2, Jina's) and
/classify: vLLM's scoring endpoints, on a model with a classifier head (a
`*ForSequenceClassification` checkpoint, or a causal LM read by --score-tokens).

Each pair or input is one "classify" pooling request in the engine's ordinary batches: its
last token's final-norm hidden state through the head (worker/pooling.py). A pair is one prompt
as engine/scoring.py makes it (the tokenizer's text pair for a cross-encoder, the texts joined
for an LM reranker); a score is the head's one logit through sigmoid, a classification the
softmax over its labels. Rerank scores the query against each document and sorts them, best
first, cut to `top_n`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from pagoda.engine.scoring import class_probs, classify_params, pair_prompt, pair_score, score_pairs
from pagoda.model.classifier_config import ClassifierConfig
from pagoda.serve.admission.queue import end_arrival
from pagoda.serve.admission.tenants import Tenant
from pagoda.serve.admission.work import RequestWork
from pagoda.serve.api.completions import completion_prompts
from pagoda.serve.api.handler import WholeAnswer, respond
from pagoda.serve.api.lora import resolve_model
from pagoda.serve.api.request_fields import CLASSIFY, RERANK, SCORE, check_fields
from pagoda.serve.api.scoring_protocol import (
    ClassificationData,
    ClassificationRequest,
    ClassificationResponse,
    RerankDocument,
    RerankRequest,
    RerankResponse,
    RerankResult,
    RerankUsage,
    ScoreData,
    ScoreRequest,
    ScoreResponse,
    ScoringUsage,
)
from pagoda.serve.api.truncation import truncate_prompt, truncation_length
from pagoda.serve.errors import APIError, bad_request
from pagoda.serve.serving import EnginePrompt, Generation, ServeContext, new_request_id


class ScoringEndpoints:
    """The three endpoints' answers; each is (model's context, request, body, tenant) -> answer."""

    score_name, rerank_name, classify_name = "score", "rerank", "classify"
    score_fields, rerank_fields, classify_fields = SCORE, RERANK, CLASSIFY

    async def score(self, ctx: ServeContext, raw: Request, request: ScoreRequest, tenant: Tenant) -> Response:
        classifier = _scoring_classifier(ctx)
        lora_request = resolve_model(ctx, request.model, tenant)
        check_fields(request, SCORE)
        keep = truncation_length(request.truncate_prompt_tokens, ctx.llm.max_model_len)
        try:
            pairs = score_pairs(request.text_1, request.text_2)
        except ValueError as exc:
            raise bad_request(f"{exc}.", param="text_2") from None
        generation = await _start(
            ctx,
            raw,
            tenant,
            self.score_name,
            "score",
            lora_request,
            len(pairs),
            lambda: [EnginePrompt(pair_prompt(ctx.llm.tokenizer, classifier, a, b, keep)) for a, b in pairs],
            "text_1",
        )

        def body(_: list[Any]) -> ScoreResponse:
            data = [
                ScoreData(index=i, score=pair_score(_logits(final), classifier, request.use_activation))
                for i, final in enumerate(generation.finals)
            ]
            return ScoreResponse(
                id=generation.request_id, model=generation.model_name, data=data, usage=_usage(generation)
            )

        return await respond(raw, generation, None, WholeAnswer(body=body))

    async def rerank(self, ctx: ServeContext, raw: Request, request: RerankRequest, tenant: Tenant) -> Response:
        classifier = _scoring_classifier(ctx)
        lora_request = resolve_model(ctx, request.model, tenant)
        check_fields(request, RERANK)
        keep = truncation_length(request.truncate_prompt_tokens, ctx.llm.max_model_len)
        documents = request.document_texts()
        if not documents:
            raise bad_request("documents must not be empty.", param="documents")
        if request.top_n is not None and request.top_n < 0:
            raise bad_request(f"top_n must be >= 0 (0: every document), got {request.top_n}.", param="top_n")
        generation = await _start(
            ctx,
            raw,
            tenant,
            self.rerank_name,
            "rerank",
            lora_request,
            len(documents),
            lambda: [
                EnginePrompt(pair_prompt(ctx.llm.tokenizer, classifier, request.query, document, keep))
                for document in documents
            ],
            "documents",
        )

        def body(_: list[Any]) -> RerankResponse:
            scores = [pair_score(_logits(final), classifier, request.use_activation) for final in generation.finals]
            order = sorted(range(len(scores)), key=lambda i: -scores[i])[: request.top_n or None]
            results = [
                RerankResult(
                    index=i,
                    relevance_score=scores[i],
                    document=RerankDocument(text=documents[i]) if request.return_documents else None,
                )
                for i in order
            ]
            tokens = generation.num_prompt_tokens
            return RerankResponse(
                id=generation.request_id,
                model=generation.model_name,
                results=results,
                usage=RerankUsage(prompt_tokens=tokens, total_tokens=tokens),
            )

        return await respond(raw, generation, None, WholeAnswer(body=body))

    async def classify(
        self, ctx: ServeContext, raw: Request, request: ClassificationRequest, tenant: Tenant
    ) -> Response:
        classifier = _classifier(ctx)
        lora_request = resolve_model(ctx, request.model, tenant)
        check_fields(request, CLASSIFY)
        keep = truncation_length(request.truncate_prompt_tokens, ctx.llm.max_model_len)

        def prompts() -> list[EnginePrompt]:
            try:
                return [
                    truncate_prompt(prompt, keep, "left")
                    for prompt in completion_prompts(request.input, ctx.llm.tokenizer)
                ]
            except APIError as exc:  # completions' checks, named for this endpoint
                raise bad_request(exc.message.replace("prompt", "input"), param="input") from None

        num_inputs = (
            1
            if isinstance(request.input, str) or (request.input and isinstance(request.input[0], int))
            else max(len(request.input), 1)
        )
        generation = await _start(
            ctx, raw, tenant, self.classify_name, "classify", lora_request, num_inputs, prompts, "input"
        )

        def body(_: list[Any]) -> ClassificationResponse:
            data = []
            for index, final in enumerate(generation.finals):
                probs = class_probs(_logits(final), request.use_activation is not False)
                best = max(range(len(probs)), key=probs.__getitem__)
                data.append(
                    ClassificationData(index=index, label=classifier.labels[best], probs=probs, num_classes=len(probs))
                )
            return ClassificationResponse(
                id=generation.request_id, model=generation.model_name, data=data, usage=_usage(generation)
            )

        return await respond(raw, generation, None, WholeAnswer(body=body))


async def _start(
    ctx: ServeContext,
    raw: Request,
    tenant: Tenant,
    endpoint: str,
    id_prefix: str,
    lora_request: Any,
    num_prompts: int,
    prompts: Callable[[], list[EnginePrompt]],
    param: str,
) -> Generation:
    """Admit the request's `num_prompts` prompts, tokenize them (`prompts`) off the event loop,
    and submit them; engine errors about "prompt" name `param`."""
    end_arrival(raw.scope)  # no await before admit: never counted both arriving and queued
    admission = ctx.admit(tenant, RequestWork(num_prompts, 1))
    try:
        engine_prompts = await asyncio.to_thread(prompts)
    except BaseException:
        admission.release()
        raise
    generation = Generation(
        ctx,
        new_request_id(id_prefix),
        endpoint,
        tenant,
        engine_prompts,
        classify_params(),
        stream=False,
        admission=admission,
        lora_request=lora_request,
    )
    await generation.start({"prompt": param})
    return generation


def _classifier(ctx: ServeContext) -> ClassifierConfig:
    classifier = ctx.llm.classifier
    if classifier is None:
        raise bad_request(
            "this model has no classifier head: scoring and classification need a "
            "*ForSequenceClassification checkpoint or --score-tokens (e.g. no,yes).",
            param="model",
        )
    return classifier


def _scoring_classifier(ctx: ServeContext) -> ClassifierConfig:
    classifier = _classifier(ctx)
    if classifier.num_labels != 1:
        raise bad_request(
            f"scoring needs a one-label classifier; this model has {classifier.num_labels} labels (use /classify).",
            param="model",
        )
    return classifier


def _logits(final: Any) -> list[float]:
    assert final is not None and final.embedding is not None  # a finished "classify" request carries them
    return final.embedding


def _usage(generation: Generation) -> ScoringUsage:
    tokens = generation.num_prompt_tokens
    return ScoringUsage(prompt_tokens=tokens, total_tokens=tokens)
