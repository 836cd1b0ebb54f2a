"""build_app: the FastAPI application around one EngineClient. No module-level app; one per call.

The routes come from their own modules: the API's endpoints from the endpoint table
(endpoints.py), the admin routes from admin.py, the dashboard's from dashboard/; this module
joins them with the middleware in front (body size, full-queue refusal), the error handlers,
/health and /metrics."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from pagoda.engine.client import EngineClient
from pagoda.serve.admin import ADMIN_ENDPOINTS, install_admin_routes
from pagoda.serve.admission.authentication import check_metrics_token
from pagoda.serve.admission.body_limit import BodySizeLimit
from pagoda.serve.admission.docs_access import KeyedDocs
from pagoda.serve.admission.fast_refusal import FastRefusal
from pagoda.serve.batches.routes import RunnerStart, install_batch_routes
from pagoda.serve.dashboard import DashboardWindow, install_dashboard
from pagoda.serve.endpoints import ENDPOINTS, AppParts, document_bodies, install_endpoints, install_reads
from pagoda.serve.errors import APIError, validation_error
from pagoda.serve.model_registry import SERVING_STATUSES, ModelRegistry
from pagoda.serve.observability.access_log import redact_access_log
from pagoda.serve.routing.canary import CanaryController
from pagoda.serve.routing.dispatch import ModelDispatcher
from pagoda.serve.routing.metrics import RoutingMetrics, merged_registry
from pagoda.serve.settings import ServerSettings

logger = logging.getLogger(__name__)


def build_app(llm: EngineClient | ModelRegistry, settings: ServerSettings) -> FastAPI:
    """The HTTP API over `llm`: one engine client (the served model) or a registry of several
    models. The caller owns the engines (starts them before, shuts them down after)."""
    app = FastAPI(
        title="pagoda", description="OpenAI-compatible LLM inference server", docs_url="/docs", redoc_url=None
    )
    registry = (
        llm
        if isinstance(llm, ModelRegistry)
        else ModelRegistry.single(llm, settings.served_model_name or "", settings.model_path)
    )
    registry.bind(settings)
    canary = CanaryController(registry.canary, registry) if registry.canary is not None else None
    parts = AppParts.of(registry, settings, ModelDispatcher(registry, RoutingMetrics(), canary=canary), canary)
    ctx = parts.ctx
    app.state.ctx = ctx
    app.state.models = registry
    if canary is not None:
        ctx.request_log.add_listener(canary.observe)  # the log is every model's
    redact_access_log()  # /dashboard?key=KEY: no key in the access log
    _install_error_handlers(app)
    app.add_middleware(
        BodySizeLimit,
        max_bytes=settings.max_request_bytes,
        on_reject=lambda: ctx.metrics.record_rejected("too_large"),
        timeout=settings.body_timeout,
        on_timeout=lambda: ctx.metrics.record_rejected("body_timeout"),
    )
    # A full queue: the endpoints that queue work are refused before their body is read.
    app.add_middleware(KeyedDocs, tenants=settings.tenants)  # /docs, /openapi.json: a key when keys are set
    app.add_middleware(FastRefusal, ctx=ctx, endpoints=ENDPOINTS)
    app.add_middleware(RunnerStart, runner=parts.batches.runner)  # the Batch API's runner: no lifespan
    _install_health_and_metrics(app, parts)
    # --- dashboard: GET /dashboard, /dashboard/events ---
    install_dashboard(
        app,
        parts.authenticate,
        settings.tenants,
        DashboardWindow(
            ctx.metrics.registry,
            server_info=lambda: {
                "health": registry.health(),
                "max_num_seqs": ctx.llm.config.max_num_seqs,
                "max_model_len": ctx.llm.max_model_len,
            },
        ),
        ctx.request_log,
    )
    install_endpoints(app, parts, ENDPOINTS + ADMIN_ENDPOINTS)
    install_reads(app, parts)
    install_batch_routes(app, parts.authenticate, parts.batches)
    install_admin_routes(app, parts)
    document_bodies(app, ENDPOINTS + ADMIN_ENDPOINTS)
    return app


def _install_health_and_metrics(app: FastAPI, parts: AppParts) -> None:
    registry, settings, canary = parts.registry, parts.settings, parts.canary
    rendered = merged_registry(
        [
            *(r for model in registry for r in model.context.metrics.rendered_registries()),
            parts.dispatcher.metrics.registry,
            *([canary.metrics.registry] if canary is not None else []),
        ]
    )

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
            check_metrics_token(request, settings.metrics_token)
        return Response(generate_latest(rendered), media_type=CONTENT_TYPE_LATEST)


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
        return _error_response(APIError(status, detail, type=kind, headers=dict(exc.headers or {})))

    @app.exception_handler(Exception)
    async def _internal_error(_: Request, exc: Exception) -> JSONResponse:
        logger.exception("unhandled error", exc_info=exc)
        # Starlette re-raises after this answer and the server then drops the connection: say so,
        # so a keep-alive client does not find its next request's socket reset.
        return _error_response(
            APIError(500, "Internal server error.", type="server_error", headers={"Connection": "close"})
        )
