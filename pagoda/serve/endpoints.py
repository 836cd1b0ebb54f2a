"""The API's endpoints in one table: each body-carrying route's path and method, the name its
requests are logged and counted under, its request and answer models, the handler that answers
it, its request-field table (api/request_fields.py), and whether it queues work for the engine.

Whatever needs "the endpoints" iterates the table: the app installs their routes
(`install_endpoints`) and documents their bodies in /openapi.json (`document_bodies`), the
full-queue refusal (admission/fast_refusal.py) answers those that queue work before reading their
bodies, and the request-field tests walk each endpoint's field table. A new endpoint is one entry
in `ENDPOINTS` (the admin routes' are in admin.py).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import pydantic
import pydantic.json_schema
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagoda.serve.admission.authentication import authenticate
from pagoda.serve.admission.tenants import Tenant
from pagoda.serve.api.anthropic_messages import MessagesEndpoint
from pagoda.serve.api.anthropic_protocol import (
    CountTokensRequest,
    CountTokensResponse,
    MessagesRequest,
    MessagesResponse,
)
from pagoda.serve.api.chat import ChatEndpoint
from pagoda.serve.api.completions import CompletionsEndpoint
from pagoda.serve.api.embeddings import EmbeddingRequest, EmbeddingResponse, EmbeddingsEndpoint
from pagoda.serve.api.handler import GenerationEndpoint
from pagoda.serve.api.invocations import InvocationRequest, InvocationTarget, invocations
from pagoda.serve.api.lora import adapter_cards
from pagoda.serve.api.protocol import (
    ChatCompletionRequest,
    ChatCompletionResponse,
    CompletionRequest,
    CompletionResponse,
    DetokenizeRequest,
    DetokenizeResponse,
    ModelCard,
    ModelList,
    TokenizeRequest,
    TokenizeResponse,
)
from pagoda.serve.api.request_fields import Field
from pagoda.serve.api.responses import ResponsesEndpoint
from pagoda.serve.api.responses_protocol import ResponseObject, ResponsesRequest
from pagoda.serve.api.responses_store import ResponsesStore
from pagoda.serve.api.scoring import ScoringEndpoints
from pagoda.serve.api.scoring_protocol import (
    ClassificationRequest,
    ClassificationResponse,
    RerankRequest,
    RerankResponse,
    ScoreRequest,
    ScoreResponse,
)
from pagoda.serve.api.tokenization import TokenizationEndpoints
from pagoda.serve.batches.files import FilesAPI
from pagoda.serve.batches.protocol import BatchCreateRequest, BatchObject
from pagoda.serve.batches.routes import Batches
from pagoda.serve.batches.runner import BatchRunner, BatchTarget
from pagoda.serve.batches.store import BatchStore
from pagoda.serve.errors import APIError, anthropic_error_body, validation_error
from pagoda.serve.model_registry import ModelRegistry
from pagoda.serve.observability.request_log import RequestLogRecord
from pagoda.serve.routing.canary import CanaryController
from pagoda.serve.routing.dispatch import ModelDispatcher
from pagoda.serve.serving import ServeContext, new_request_id, rejection_reason
from pagoda.serve.settings import ServerSettings

logger = logging.getLogger(__name__)

# A route's answer to a parsed body from an authenticated tenant.
Run = Callable[[Request, Any, Tenant], Awaitable[Response]]


@dataclass
class AppParts:
    """What one app's handlers are built over: its models, the dispatcher that picks one per
    request, and the endpoints that keep state across requests and routes (the responses
    store, each model's tokenizing threads)."""

    settings: ServerSettings
    registry: ModelRegistry
    dispatcher: ModelDispatcher
    canary: CanaryController | None
    completions: CompletionsEndpoint
    chat: ChatEndpoint
    messages: MessagesEndpoint
    responses: ResponsesEndpoint
    embeddings: dict[str, EmbeddingsEndpoint]  # by model name
    scoring: ScoringEndpoints
    tokenization: dict[str, TokenizationEndpoints]  # by model name
    batches: Batches = field(init=False)  # the Batch API: its store and runner
    started: int = field(default_factory=lambda: int(time.time()))  # the model cards' `created`

    @classmethod
    def of(
        cls,
        registry: ModelRegistry,
        settings: ServerSettings,
        dispatcher: ModelDispatcher,
        canary: CanaryController | None,
    ) -> AppParts:
        store = (
            ResponsesStore(settings.responses_store_size, settings.responses_store_ttl)
            if settings.responses_store
            else None
        )
        parts = cls(
            settings,
            registry,
            dispatcher,
            canary,
            CompletionsEndpoint(),
            ChatEndpoint(),
            MessagesEndpoint(),
            ResponsesEndpoint(store),
            {model.name: EmbeddingsEndpoint(model.context) for model in registry},
            ScoringEndpoints(),
            {model.name: TokenizationEndpoints(model.context) for model in registry},
        )
        parts.batches = _batches(parts)
        return parts

    @property
    def ctx(self) -> ServeContext:
        """The primary model's context: what acts on "the" model (LoRA loading, the dashboard)."""
        return self.registry.primary.context

    def authenticate(self, request: Request) -> Tenant:
        return authenticate(self.ctx.settings.tenants, request)

    def generate(
        self, endpoint: GenerationEndpoint, path: str, handle: Callable[..., Awaitable[Response]] | None = None
    ) -> Run:
        """A generation endpoint's answer, by the model the body names or its fallbacks."""
        return functools.partial(self.dispatcher.generate, endpoint, path, handle=handle)

    def by_model(self, handle: Callable[..., Awaitable[Response]]) -> Run:
        """`handle` with the context of the model the body names (a route: by its rules)."""

        async def run(request: Request, body: Any, tenant: Tenant) -> Response:
            model_ctx, name = self.dispatcher.context_for(body.model, tenant)
            if name != body.model:
                body = body.model_copy(update={"model": name})
            return await handle(model_ctx, request, body, tenant)

        return run

    async def embed(self, request: Request, body: EmbeddingRequest, tenant: Tenant) -> Response:
        model_ctx, name = self.dispatcher.context_for(body.model, tenant)
        return await self.embeddings[model_ctx.model_name or ""].handle(
            request, body.model_copy(update={"model": name}), tenant
        )

    async def tokenize(self, _: Request, body: TokenizeRequest, tenant: Tenant) -> Response:
        model_ctx, name = self.dispatcher.context_for(body.model, tenant)
        return await self.tokenization[model_ctx.model_name or ""].tokenize(
            body.model_copy(update={"model": name}), tenant
        )

    async def detokenize(self, _: Request, body: DetokenizeRequest, tenant: Tenant) -> Response:
        model_ctx, name = self.dispatcher.context_for(body.model, tenant)
        return await self.tokenization[model_ctx.model_name or ""].detokenize(
            body.model_copy(update={"model": name}), tenant
        )


@dataclass(frozen=True)
class Endpoint:
    """One route that carries a JSON body: authenticated first, then parsed as `request_model`
    (by hand, so that a missing key is a 401 whatever the body), then answered by `handler`."""

    path: str
    # In metrics and log lines; with a name, every refusal of the route is counted and logged.
    name: str | None
    request_model: type[pydantic.BaseModel]
    response_model: type[pydantic.BaseModel] | None
    handler: Callable[[AppParts, str], Run]  # (the app's parts, the path) -> the route's answer
    fields: Mapping[str, Field] | None = None  # its request-field table; None: it has none
    # Generation work for the engine: while the admission queue is full the route is answered
    # 503 before its body is read (admission/fast_refusal.py).
    queues_work: bool = False
    anthropic: bool = False  # errors in Anthropic's shape instead of OpenAI's
    method: str = "POST"

    def __post_init__(self) -> None:
        if self.queues_work and self.name is None:
            raise ValueError(f"{self.path} queues work: its refusals must be counted under a name")

    def run(self, parts: AppParts) -> Run:
        return self.handler(parts, self.path)


COMPLETIONS = Endpoint(
    "/v1/completions",
    CompletionsEndpoint.name,
    CompletionRequest,
    CompletionResponse,
    lambda parts, path: parts.generate(parts.completions, path),
    CompletionsEndpoint.fields,
    queues_work=True,
)
CHAT = Endpoint(
    "/v1/chat/completions",
    ChatEndpoint.name,
    ChatCompletionRequest,
    ChatCompletionResponse,
    lambda parts, path: parts.generate(parts.chat, path),
    ChatEndpoint.fields,
    queues_work=True,
)
EMBEDDINGS = Endpoint(
    "/v1/embeddings",
    EmbeddingsEndpoint.name,
    EmbeddingRequest,
    EmbeddingResponse,
    lambda parts, _: parts.embed,
    EmbeddingsEndpoint.fields,
    queues_work=True,
)


# vLLM's scoring routes (serve/api/scoring.py): /score and /v1/score; rerank under its three
# paths (Jina's and Cohere's v1, Cohere's v2); /classify.
SCORE_ROUTES = tuple(
    Endpoint(
        path,
        ScoringEndpoints.score_name,
        ScoreRequest,
        ScoreResponse,
        lambda parts, _: parts.by_model(parts.scoring.score),
        ScoringEndpoints.score_fields,
        queues_work=True,
    )
    for path in ("/score", "/v1/score")
)
RERANK_ROUTES = tuple(
    Endpoint(
        path,
        ScoringEndpoints.rerank_name,
        RerankRequest,
        RerankResponse,
        lambda parts, _: parts.by_model(parts.scoring.rerank),
        ScoringEndpoints.rerank_fields,
        queues_work=True,
    )
    for path in ("/rerank", "/v1/rerank", "/v2/rerank")
)
CLASSIFY = Endpoint(
    "/classify",
    ScoringEndpoints.classify_name,
    ClassificationRequest,
    ClassificationResponse,
    lambda parts, _: parts.by_model(parts.scoring.classify),
    ScoringEndpoints.classify_fields,
    queues_work=True,
)


def _invocations(parts: AppParts, _: str) -> Run:
    """SageMaker's one route: the first of chat, completions, embeddings, score, rerank (vLLM's
    order) whose request model the body validates as."""
    return invocations(
        [
            InvocationTarget(endpoint.path, endpoint.request_model, endpoint.run(parts))
            for endpoint in (CHAT, COMPLETIONS, EMBEDDINGS, SCORE_ROUTES[-1], RERANK_ROUTES[1])
        ]
    )


def _batches(parts: AppParts) -> Batches:
    """The Batch API over --batch-store (None or "memory": kept in memory): each line is answered
    by its URL's endpoint of this table, as online."""
    settings = parts.settings
    store = BatchStore.memory() if settings.batch_store in (None, "memory") else BatchStore.open(settings.batch_store)
    targets = {
        endpoint.path: BatchTarget(endpoint.request_model, endpoint.run(parts))
        for endpoint in (CHAT, COMPLETIONS, EMBEDDINGS)
    }
    runner = BatchRunner(
        store,
        targets,
        settings.tenants,
        lambda: [model.context.admission for model in parts.registry],
        settings.batch_concurrency,
    )
    return Batches(runner, FilesAPI(store, settings.batch_max_file_bytes, settings.batch_max_tenant_bytes))


ENDPOINTS: tuple[Endpoint, ...] = (
    COMPLETIONS,
    CHAT,
    Endpoint(
        "/v1/messages",
        MessagesEndpoint.name,
        MessagesRequest,
        MessagesResponse,
        lambda parts, path: parts.generate(parts.messages, path, parts.messages.handle_messages),
        MessagesEndpoint.fields,
        queues_work=True,
        anthropic=True,
    ),
    # count_tokens' body is a subset of Messages', checked against the same table.
    Endpoint(
        "/v1/messages/count_tokens",
        None,
        CountTokensRequest,
        CountTokensResponse,
        lambda parts, _: parts.by_model(parts.messages.count_tokens),
        MessagesEndpoint.fields,
        anthropic=True,
    ),
    Endpoint(
        "/v1/responses",
        ResponsesEndpoint.name,
        ResponsesRequest,
        ResponseObject,
        lambda parts, path: parts.generate(parts.responses, path, parts.responses.handle_responses),
        ResponsesEndpoint.fields,
        queues_work=True,
    ),
    # Their refusals are counted and logged too: every error a client causes is in /metrics.
    Endpoint("/tokenize", "tokenize", TokenizeRequest, TokenizeResponse, lambda parts, _: parts.tokenize),
    Endpoint("/detokenize", "detokenize", DetokenizeRequest, DetokenizeResponse, lambda parts, _: parts.detokenize),
    EMBEDDINGS,
    *SCORE_ROUTES,
    *RERANK_ROUTES,
    CLASSIFY,
    Endpoint("/invocations", "invocations", InvocationRequest, None, _invocations, queues_work=True),
    # The Batch API: creating a batch queues nothing (the runner runs its lines later); the
    # files' routes and the batches' reads and cancel carry no JSON body (batches/routes.py).
    Endpoint("/v1/batches", "batches", BatchCreateRequest, BatchObject, lambda parts, _: parts.batches.create),
)


def install_endpoints(app: FastAPI, parts: AppParts, endpoints: tuple[Endpoint, ...]) -> None:
    """One route per endpoint of `endpoints`."""
    for endpoint in endpoints:
        app.add_api_route(endpoint.path, _route_handler(parts, endpoint), methods=[endpoint.method])


def install_reads(app: FastAPI, parts: AppParts) -> None:
    """The API's reads: GET /v1/models and the stored responses (GET and DELETE)."""
    registry = parts.registry

    @app.get("/v1/models")
    async def models(request: Request) -> ModelList:
        tenant = parts.authenticate(request)
        cards: list[ModelCard] = []
        for model in registry:
            names = [name for name in model.names if registry.may_use(tenant, name)]
            cards += [
                ModelCard(
                    id=name,
                    created=parts.started,
                    root=model.model_path,
                    max_model_len=model.llm.max_model_len,
                    max_num_seqs=model.llm.config.max_num_seqs,
                )
                for name in names
            ]
            if names:
                cards += adapter_cards(model.context, tenant, parts.started)
        cards += [
            ModelCard(id=route.name, created=parts.started, owned_by="pagoda-route")
            for route in registry.routes
            if registry.may_list_route(tenant, route)
        ]
        return ModelList(data=cards)

    async def stored_response(request: Request, response_id: str) -> Response:
        return parts.responses.retrieve(parts.authenticate(request), response_id)

    async def delete_stored_response(request: Request, response_id: str) -> Response:
        return parts.responses.delete(parts.authenticate(request), response_id)

    app.add_api_route("/v1/responses/{response_id}", stored_response, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", delete_stored_response, methods=["DELETE"])


def _route_handler(parts: AppParts, endpoint: Endpoint) -> Callable[[Request], Awaitable[Response]]:
    """Authenticate, parse the body, then run it. Refusals of a named endpoint are counted in
    metrics and logged; an Anthropic endpoint's errors leave in Anthropic's shape."""
    ctx = parts.ctx
    run = endpoint.run(parts)

    async def handler(request: Request) -> Response:
        tenant = None
        try:
            tenant = parts.authenticate(request)
            body = await _parse(request, endpoint.request_model)
            return await run(request, body, tenant)
        except APIError as exc:
            if endpoint.name is not None:
                _record_refusal(ctx, endpoint.name, tenant, exc)
            if endpoint.anthropic:
                return JSONResponse(anthropic_error_body(exc), status_code=exc.status, headers=exc.headers)
            raise
        except Exception as exc:
            if not endpoint.anthropic:
                raise
            logger.exception("unhandled error", exc_info=exc)
            return JSONResponse(anthropic_error_body(APIError(500, "Internal server error.")), status_code=500)

    return handler


async def _parse(request: Request, model: type[pydantic.BaseModel]) -> Any:
    # Parsed by hand (not as a FastAPI body parameter) so authentication comes first.
    raw = await request.body()
    try:
        return model.model_validate_json(raw)
    except pydantic.ValidationError as exc:
        raise validation_error(list(exc.errors())) from None


def _record_refusal(ctx: ServeContext, endpoint: str, tenant: Tenant | None, error: APIError) -> None:
    """Metrics and the log line of a request refused before it reached the engine."""
    if error.recorded:
        return
    error.recorded = True
    ctx.metrics.record_rejected(rejection_reason(error))
    ctx.request_log.log(
        RequestLogRecord(
            request_id=new_request_id("rejected"),
            endpoint=endpoint,
            tenant=tenant.name if tenant else None,
            model=ctx.model_name,
            status=error.status,
            error=error.message,
            error_param=error.param,
        )
    )


def document_bodies(app: FastAPI, endpoints: tuple[Endpoint, ...]) -> None:
    """Put the request (and response) models of `endpoints` into /openapi.json: bodies are
    parsed by hand after authentication, so FastAPI cannot infer them, but clients, /docs and
    schema-driven fuzzers need them."""
    base_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = base_openapi()
        models = {
            model
            for endpoint in endpoints
            for model in (endpoint.request_model, endpoint.response_model)
            if model is not None
        }
        _, definitions = pydantic.json_schema.models_json_schema(
            [(model, "validation") for model in sorted(models, key=lambda m: m.__name__)],
            ref_template="#/components/schemas/{model}",
        )
        schema.setdefault("components", {}).setdefault("schemas", {}).update(definitions.get("$defs", {}))
        for endpoint in endpoints:
            operation = schema["paths"][endpoint.path][endpoint.method.lower()]
            operation["requestBody"] = {
                "required": True,
                "content": {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{endpoint.request_model.__name__}"}}
                },
            }
            if endpoint.response_model is not None:
                operation["responses"]["200"]["content"] = {
                    "application/json": {"schema": {"$ref": f"#/components/schemas/{endpoint.response_model.__name__}"}}
                }
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]
