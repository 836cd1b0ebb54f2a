"""build_app: the FastAPI application around one EngineClient. No module-level app; one per call."""

from __future__ import annotations

import functools
import hmac
import logging
import time
from typing import Any, Awaitable, Callable, TypeVar

import pydantic
import pydantic.json_schema
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagoda.engine.client import EngineClient
from pagoda.serve.access_log import redact_access_log
from pagoda.serve.admission.body_limit import BodySizeLimit
from pagoda.serve.api.admin_prompt_log import read_prompt_log
from pagoda.serve.api.anthropic_messages import MessagesEndpoint
from pagoda.serve.api.anthropic_protocol import (CountTokensRequest, CountTokensResponse,
                                                 MessagesRequest, MessagesResponse)
from pagoda.serve.api.chat import ChatEndpoint
from pagoda.serve.api.completions import CompletionsEndpoint
from pagoda.serve.api.embeddings import EmbeddingRequest, EmbeddingResponse, EmbeddingsEndpoint
from pagoda.serve.api.invocations import InvocationRequest, InvocationTarget, invocations
from pagoda.serve.api.responses import ResponsesEndpoint
from pagoda.serve.api.responses_protocol import ResponseObject, ResponsesRequest
from pagoda.serve.api.responses_store import ResponsesStore
from pagoda.serve.dashboard import DashboardWindow, install_dashboard
from pagoda.serve.docs_access import KeyedDocs
from pagoda.serve.errors import APIError, anthropic_error_body, unauthorized, validation_error
from pagoda.serve.fast_refusal import FastRefusal, RefusalRoute
from pagoda.serve.api.lora import (LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, adapter_cards,
                               load_lora_adapter, unload_lora_adapter)
from pagoda.serve.api.protocol import (ChatCompletionRequest, ChatCompletionResponse, CompletionRequest,
                                   CompletionResponse, DetokenizeRequest, DetokenizeResponse,
                                   ModelCard, ModelList, TokenizeRequest, TokenizeResponse)
from pagoda.serve.model_registry import SERVING_STATUSES, ModelRegistry
from pagoda.serve.request_log import RequestLogRecord
from pagoda.serve.routing.canary import CanaryController
from pagoda.serve.routing.dispatch import ModelDispatcher
from pagoda.serve.routing.metrics import RoutingMetrics, merged_registry
from pagoda.serve.serving import ServeContext, new_request_id, rejection_reason
from pagoda.serve.settings import ServerSettings
from pagoda.serve.admission.tenants import Tenant
from pagoda.serve.api.tokenization import TokenizationEndpoints

Body = TypeVar("Body", bound=pydantic.BaseModel)

logger = logging.getLogger(__name__)


def _authenticate(ctx: ServeContext, request: Request) -> Tenant:
    header = request.headers.get("authorization", "")
    scheme, _, key = header.partition(" ")
    api_key = key.strip() if scheme.lower() == "bearer" else None
    if not header:  # Anthropic's clients send the key as x-api-key
        api_key = request.headers.get("x-api-key", "").strip() or None
    tenant = ctx.settings.tenants.authenticate(api_key)
    if tenant is None:
        raise unauthorized("Missing API key." if not api_key else "Invalid API key.")
    return tenant


def _check_metrics_token(request: Request, token: str) -> None:
    """--metrics-token: scrapers send Authorization: Bearer TOKEN (compared in constant time)."""
    scheme, _, given = request.headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not given.strip():
        raise unauthorized("Missing metrics token (Authorization: Bearer TOKEN, see --metrics-token).")
    if not hmac.compare_digest(given.strip().encode(), token.encode()):
        raise unauthorized("Invalid metrics token.")


def _record_refusal(ctx: ServeContext, endpoint: str, tenant: Tenant | None,
                    error: APIError) -> None:
    """Metrics and the log line of a request refused before it reached the engine."""
    if error.recorded:
        return
    error.recorded = True
    ctx.metrics.record_rejected(rejection_reason(error))
    ctx.request_log.log(RequestLogRecord(
        request_id=new_request_id("rejected"), endpoint=endpoint,
        tenant=tenant.name if tenant else None, model=ctx.model_name, status=error.status,
        error=error.message, error_param=error.param))


async def _parse(request: Request, model: type[Body]) -> Body:
    # Parsed by hand (not as a FastAPI body parameter) so authentication comes first.
    raw = await request.body()
    try:
        return model.model_validate_json(raw)
    except pydantic.ValidationError as exc:
        raise validation_error(list(exc.errors())) from None


def _error_response(error: APIError) -> JSONResponse:
    return JSONResponse(error.body(), status_code=error.status, headers=error.headers)


def _install_error_handlers(app: FastAPI) -> None:
    """Every error leaves in OpenAI's shape; FastAPI's 422 becomes a 400."""
    @app.exception_handler(APIError)
    async def _api_error(_: Request, exc: APIError) -> JSONResponse:
        return _error_response(exc)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(_: Request, exc: RequestValidationError) -> JSONResponse:
        return _error_response(validation_error(list(exc.errors())))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(_: Request, exc: StarletteHTTPException) -> JSONResponse:
        status = exc.status_code
        kind = "invalid_request_error" if status < 500 else "server_error"
        if status == 404:
            kind = "not_found_error"
        detail = exc.detail if isinstance(exc.detail, str) else "Request failed."
        return _error_response(APIError(status, detail, type=kind,
                                        headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        # Starlette re-raises after this answer and the server then drops the connection: say so,
        # so a keep-alive client does not find its next request's socket reset.
        return _error_response(APIError(500, "Internal server error.", type="server_error",
                                        headers={"Connection": "close"}))


def build_app(llm: EngineClient | ModelRegistry, settings: ServerSettings) -> FastAPI:
    """The HTTP API over `llm`: one engine client (the served model) or a registry of several
    models. The caller owns the engines (starts them before, shuts them down after)."""
    app = FastAPI(title="pagoda", description="OpenAI-compatible LLM inference server",
                  docs_url="/docs", redoc_url=None)
    registry = llm if isinstance(llm, ModelRegistry) else ModelRegistry.single(
        llm, settings.served_model_name or "", settings.model_path)
    registry.bind(settings)
    canary = CanaryController(registry.canary, registry) if registry.canary is not None else None
    dispatcher = ModelDispatcher(registry, RoutingMetrics(), canary=canary)
    ctx = registry.primary.context  # what acts on "the" model: LoRA loading, the dashboard
    llm = ctx.llm
    app.state.ctx = ctx
    app.state.models = registry
    rendered = merged_registry([*(r for model in registry for r in model.context.metrics.rendered_registries()),
                                dispatcher.metrics.registry,
                                *([canary.metrics.registry] if canary is not None else [])])
    if canary is not None:
        ctx.request_log.add_listener(canary.observe)  # the log is every model's
    redact_access_log()  # /dashboard?key=KEY: no key in the access log
    _install_error_handlers(app)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_request_bytes,
                       on_reject=lambda: ctx.metrics.record_rejected("too_large"),
                       timeout=settings.body_timeout,
                       on_timeout=lambda: ctx.metrics.record_rejected("body_timeout"))
    app.add_middleware(KeyedDocs, tenants=settings.tenants)  # /docs, /openapi.json: a key when keys are set
    app.add_middleware(FastRefusal, ctx=ctx, routes={  # full queue: refused before the body is read
        "/v1/completions": RefusalRoute(CompletionsEndpoint.name),
        "/v1/chat/completions": RefusalRoute(ChatEndpoint.name),
        "/v1/messages": RefusalRoute(MessagesEndpoint.name, anthropic=True)})
    started = int(time.time())

    @app.get("/health")
    async def health() -> Response:
        # Replicas: "degraded" (still 200) while some of them live, and each one's state;
        # 503 while nothing serves: "restarting", "failed" (out of restarts) or "dead".
        body = registry.health()
        if body["status"] not in SERVING_STATUSES:
            return JSONResponse(body, status_code=503, headers={"Retry-After": "5"})
        return JSONResponse(body)

    @app.get("/metrics")
    async def metrics(request: Request) -> Response:
        if settings.metrics_token is not None:
            _check_metrics_token(request, settings.metrics_token)
        return Response(generate_latest(rendered), media_type=CONTENT_TYPE_LATEST)

    # --- dashboard: GET /dashboard, /dashboard/events ---
    install_dashboard(app, lambda request: _authenticate(ctx, request), settings.tenants,
                      DashboardWindow(ctx.metrics.registry, server_info=lambda: {
                          "health": registry.health(), "max_num_seqs": llm.config.max_num_seqs,
                          "max_model_len": llm.max_model_len}), ctx.request_log)

    @app.get("/admin/provenance/{provenance_id}")
    async def provenance(provenance_id: str, request: Request) -> Response:
        # What served a recent request (the id is its x-pagoda-provenance header): admin keys only.
        tenant = _authenticate(ctx, request)
        if not (tenant.admin or settings.tenants.open_access):
            raise APIError(403, "Only admin keys may read provenance records.", type="permission_error",
                           code="admin_required")
        record = next((found for model in registry  # each model keeps its own requests' records
                       if (found := model.context.provenance.find(provenance_id)) is not None), None)
        if record is None:
            raise APIError(404, f"No recent request has the provenance id {provenance_id!r} (the request "
                                "log holds every record).", type="not_found_error")
        return JSONResponse(record.as_dict())

    @app.get("/v1/models")
    async def models(request: Request) -> ModelList:
        tenant = _authenticate(ctx, request)
        cards: list[ModelCard] = []
        for model in registry:
            names = [name for name in model.names if registry.may_use(tenant, name)]
            cards += [ModelCard(id=name, created=started, root=model.model_path,
                                max_model_len=model.llm.max_model_len,
                                max_num_seqs=model.llm.config.max_num_seqs) for name in names]
            if names:
                cards += adapter_cards(model.context, tenant, started)
        cards += [ModelCard(id=route.name, created=started, owned_by="pagoda-route")
                  for route in registry.routes if registry.may_list_route(tenant, route)]
        return ModelList(data=cards)

    documented: dict[str, tuple[type[pydantic.BaseModel], type[pydantic.BaseModel] | None]] = {}

    def route(path: str, body_model: type[Body],
              run: Callable[[Request, Any, Tenant], Awaitable[Response]],
              endpoint: str | None = None,
              response_model: type[pydantic.BaseModel] | None = None,
              anthropic: bool = False) -> None:
        """POST `path`: authenticate, parse the body as `body_model`, then `run` it. Refusals
        of a generation `endpoint` are counted in metrics and logged. `anthropic`: errors
        leave in Anthropic's shape instead of OpenAI's."""
        async def handler(request: Request) -> Response:
            tenant = None
            try:
                tenant = _authenticate(ctx, request)
                body = await _parse(request, body_model)
                return await run(request, body, tenant)
            except APIError as exc:
                if endpoint is not None:
                    _record_refusal(ctx, endpoint, tenant, exc)
                if anthropic:
                    return JSONResponse(anthropic_error_body(exc), status_code=exc.status,
                                        headers=exc.headers)
                raise
            except Exception as exc:
                if not anthropic:
                    raise
                logger.exception("unhandled error", exc_info=exc)
                return JSONResponse(anthropic_error_body(APIError(500, "Internal server error.")),
                                    status_code=500)

        app.add_api_route(path, handler, methods=["POST"])
        documented[path] = (body_model, response_model)

    invocation_targets: list[InvocationTarget] = []
    for path, generation_endpoint, body_model, response_model in (
            ("/v1/completions", CompletionsEndpoint(), CompletionRequest, CompletionResponse),
            ("/v1/chat/completions", ChatEndpoint(), ChatCompletionRequest, ChatCompletionResponse)):
        run = functools.partial(dispatcher.generate, generation_endpoint, path)
        route(path, body_model, run, generation_endpoint.name, response_model)
        invocation_targets.insert(0, InvocationTarget(path, body_model, run))  # chat first, as vLLM

    messages_endpoint = MessagesEndpoint()

    def by_model(handle: Callable[..., Awaitable[Response]]) -> Callable[[Request, Any, Tenant], Awaitable[Response]]:
        """`handle` with the context of the model the body names (a route: by its rules)."""
        async def run(request: Request, body: Any, tenant: Tenant) -> Response:
            model_ctx, name = dispatcher.context_for(body.model, tenant)
            if name != body.model:
                body = body.model_copy(update={"model": name})
            return await handle(model_ctx, request, body, tenant)
        return run

    route("/v1/messages", MessagesRequest,
          functools.partial(dispatcher.generate, messages_endpoint, "/v1/messages",
                            handle=messages_endpoint.handle_messages),
          messages_endpoint.name, MessagesResponse, anthropic=True)
    route("/v1/messages/count_tokens", CountTokensRequest, by_model(messages_endpoint.count_tokens),
          response_model=CountTokensResponse, anthropic=True)
    responses_endpoint = ResponsesEndpoint(ResponsesStore(settings.responses_store_size, settings.responses_store_ttl)
                                           if settings.responses_store else None)
    route("/v1/responses", ResponsesRequest,
          functools.partial(dispatcher.generate, responses_endpoint, "/v1/responses",
                            handle=responses_endpoint.handle_responses),
          responses_endpoint.name, ResponseObject)

    async def stored_response(request: Request, response_id: str) -> Response:
        return responses_endpoint.retrieve(_authenticate(ctx, request), response_id)

    async def delete_stored_response(request: Request, response_id: str) -> Response:
        return responses_endpoint.delete(_authenticate(ctx, request), response_id)

    app.add_api_route("/v1/responses/{response_id}", stored_response, methods=["GET"])
    app.add_api_route("/v1/responses/{response_id}", delete_stored_response, methods=["DELETE"])
    tokenization = {model.name: TokenizationEndpoints(model.context) for model in registry}

    async def tokenize_body(_: Request, body: TokenizeRequest, tenant: Tenant) -> Response:
        model_ctx, name = dispatcher.context_for(body.model, tenant)
        return await tokenization[model_ctx.model_name or ""].tokenize(
            body.model_copy(update={"model": name}), tenant)

    async def detokenize_body(_: Request, body: DetokenizeRequest, tenant: Tenant) -> Response:
        model_ctx, name = dispatcher.context_for(body.model, tenant)
        return await tokenization[model_ctx.model_name or ""].detokenize(
            body.model_copy(update={"model": name}), tenant)

    route("/v1/load_lora_adapter", LoadLoRAAdapterRequest, functools.partial(load_lora_adapter, ctx))
    route("/v1/unload_lora_adapter", UnloadLoRAAdapterRequest, functools.partial(unload_lora_adapter, ctx))
    # Their refusals are counted and logged too: every error a client causes is in /metrics.
    route("/tokenize", TokenizeRequest, tokenize_body, "tokenize", TokenizeResponse)
    route("/detokenize", DetokenizeRequest, detokenize_body, "detokenize", DetokenizeResponse)
    embeddings = {model.name: EmbeddingsEndpoint(model.context) for model in registry}

    async def embed_body(request: Request, body: EmbeddingRequest, tenant: Tenant) -> Response:
        model_ctx, name = dispatcher.context_for(body.model, tenant)
        return await embeddings[model_ctx.model_name or ""].handle(
            request, body.model_copy(update={"model": name}), tenant)

    route("/v1/embeddings", EmbeddingRequest, embed_body, EmbeddingsEndpoint.name, EmbeddingResponse)
    invocation_targets.append(InvocationTarget("/v1/embeddings", EmbeddingRequest, embed_body))
    route("/invocations", InvocationRequest, invocations(invocation_targets), "invocations")

    def canary_admin(request: Request) -> CanaryController:
        tenant = _authenticate(ctx, request)
        if not (tenant.admin or settings.tenants.open_access):
            raise APIError(403, "Only admin keys may read or steer the canary.", type="permission_error",
                           code="admin_required")
        if canary is None:
            raise APIError(404, "This server runs no canary (a `canary` block in the models file).",
                           type="not_found_error")
        canary.ensure_running()
        return canary

    @app.get("/admin/canary")
    async def canary_status(request: Request) -> Response:
        return JSONResponse(canary_admin(request).status())

    @app.post("/admin/canary/promote")
    async def canary_promote(request: Request) -> Response:
        controller = canary_admin(request)
        controller.promote("manual", "an admin promoted the candidate")
        return JSONResponse(controller.status())

    @app.post("/admin/canary/rollback")
    async def canary_rollback(request: Request) -> Response:
        controller = canary_admin(request)
        controller.rollback("manual", "an admin rolled the candidate back")
        return JSONResponse(controller.status())

    @app.get("/admin/prompt-log")
    async def prompt_log(request: Request) -> Response:
        return await read_prompt_log(ctx, request, lambda: _authenticate(ctx, request))

    _document_bodies(app, documented)
    return app


def _document_bodies(app: FastAPI, routes: dict[str, tuple[type[pydantic.BaseModel],
                                                         type[pydantic.BaseModel] | None]]) -> None:
    """Put the request (and response) models of the POST routes into /openapi.json: bodies are
    parsed by hand after authentication, so FastAPI cannot infer them, but clients, /docs and
    schema-driven fuzzers need them."""
    base_openapi = app.openapi

    def openapi() -> dict[str, Any]:
        if app.openapi_schema is not None:
            return app.openapi_schema
        schema = base_openapi()
        models = {model for pair in routes.values() for model in pair if model is not None}
        _, definitions = pydantic.json_schema.models_json_schema(
            [(model, "validation") for model in sorted(models, key=lambda m: m.__name__)],
            ref_template="#/components/schemas/{model}")
        schema.setdefault("components", {}).setdefault("schemas", {}).update(definitions.get("$defs", {}))
        for path, (body_model, response_model) in routes.items():
            operation = schema["paths"][path]["post"]
            operation["requestBody"] = {"required": True, "content": {"application/json": {
                "schema": {"$ref": f"#/components/schemas/{body_model.__name__}"}}}}
            if response_model is not None:
                operation["responses"]["200"]["content"] = {"application/json": {
                    "schema": {"$ref": f"#/components/schemas/{response_model.__name__}"}}}
        app.openapi_schema = schema
        return schema

    app.openapi = openapi  # type: ignore[method-assign]

