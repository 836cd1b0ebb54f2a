"""The admin routes, for admin keys: LoRA adapters (POST /v1/load_lora_adapter and
/v1/unload_lora_adapter), what served a recent request (GET /admin/provenance/{id}), the live
canary (GET /admin/canary, POST /admin/canary/promote and /admin/canary/rollback), and the
prompt log (GET /admin/prompt-log?tenant=NAME&limit=N: its newest records).

Every read of the prompt log is written to its audit file first, whatever its outcome: who (the
key's tenant; null without a valid key), when, the filter asked for, the status and how many
records were returned.
"""

from __future__ import annotations

import asyncio
import functools
from typing import Callable

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagoda.serve.admission.tenants import Tenant
from pagoda.serve.api.lora import (LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest, load_lora_adapter,
                                   unload_lora_adapter)
from pagoda.serve.endpoints import AppParts, Endpoint
from pagoda.serve.errors import APIError, bad_request
from pagoda.serve.observability.prompt_log import DEFAULT_READ_LIMIT, MAX_READ_LIMIT, PromptLog, PromptLogQuery
from pagoda.serve.routing.canary import CanaryController
from pagoda.serve.serving import ServeContext

# The admin routes that carry a body, installed and documented as the API's endpoints are.
ADMIN_ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint("/v1/load_lora_adapter", None, LoadLoRAAdapterRequest, None,
             lambda parts, _: functools.partial(load_lora_adapter, parts.ctx)),
    Endpoint("/v1/unload_lora_adapter", None, UnloadLoRAAdapterRequest, None,
             lambda parts, _: functools.partial(unload_lora_adapter, parts.ctx)),
)


def install_admin_routes(app: FastAPI, parts: AppParts) -> None:
    """The admin reads and actions without a body (`ADMIN_ENDPOINTS` are installed with the API's)."""
    ctx = parts.ctx

    @app.get("/admin/provenance/{provenance_id}")
    async def provenance(provenance_id: str, request: Request) -> Response:
        # What served a recent request (the id is its x-pagoda-provenance header).
        _require_admin(parts, request, "Only admin keys may read provenance records.")
        record = next((found for model in parts.registry  # each model keeps its own requests' records
                       if (found := model.context.provenance.find(provenance_id)) is not None), None)
        if record is None:
            raise APIError(404, f"No recent request has the provenance id {provenance_id!r} (the request "
                                "log holds every record).", type="not_found_error")
        return JSONResponse(record.as_dict())

    @app.get("/admin/canary")
    async def canary_status(request: Request) -> Response:
        return JSONResponse(_canary(parts, request).status())

    @app.post("/admin/canary/promote")
    async def canary_promote(request: Request) -> Response:
        controller = _canary(parts, request)
        controller.promote("manual", "an admin promoted the candidate")
        return JSONResponse(controller.status())

    @app.post("/admin/canary/rollback")
    async def canary_rollback(request: Request) -> Response:
        controller = _canary(parts, request)
        controller.rollback("manual", "an admin rolled the candidate back")
        return JSONResponse(controller.status())

    @app.get("/admin/prompt-log")
    async def prompt_log(request: Request) -> Response:
        return await read_prompt_log(ctx, request, lambda: parts.authenticate(request))


def _require_admin(parts: AppParts, request: Request, refusal: str) -> Tenant:
    """The request's tenant when it holds an admin key (or the server is open), else a 403."""
    tenant = parts.authenticate(request)
    if not (tenant.admin or parts.settings.tenants.open_access):
        raise APIError(403, refusal, type="permission_error", code="admin_required")
    return tenant


def _canary(parts: AppParts, request: Request) -> CanaryController:
    _require_admin(parts, request, "Only admin keys may read or steer the canary.")
    if parts.canary is None:
        raise APIError(404, "This server runs no canary (a `canary` block in the models file).",
                       type="not_found_error")
    parts.canary.ensure_running()
    return parts.canary


QUERY_PARAMS = ("tenant", "limit")


def _query(params: dict[str, str]) -> PromptLogQuery:
    unknown = sorted(set(params) - set(QUERY_PARAMS))
    if unknown:
        raise bad_request(f"Unknown query parameter {unknown[0]!r}; use tenant and limit.", param=unknown[0])
    limit_text = params.get("limit", str(DEFAULT_READ_LIMIT))
    try:
        limit = int(limit_text)
    except ValueError:
        limit = 0
    if not 1 <= limit <= MAX_READ_LIMIT:
        raise bad_request(f"limit must be an integer from 1 to {MAX_READ_LIMIT}, got {limit_text!r}.",
                          param="limit")
    return PromptLogQuery(tenant=params.get("tenant") or None, limit=limit)


async def read_prompt_log(ctx: ServeContext, request: Request,
                          authenticate: Callable[[], Tenant]) -> Response:
    log: PromptLog | None = ctx.prompt_log
    if log is None:
        authenticate()  # whether the log is on is no one's business without a key
        raise APIError(404, "The prompt log is off (the server runs without --log-prompts).",
                       type="not_found_error")
    params = dict(request.query_params)
    who = None
    try:
        tenant = authenticate()
        who = tenant.name
        if not tenant.admin:
            raise APIError(403, "Only admin keys may read the prompt log.", type="permission_error",
                           code="permission_denied")
        query = _query(params)
    except APIError as exc:
        log.audit(who, None, exc.status, filters=params)
        raise
    records = await asyncio.to_thread(log.read, query)
    log.audit(who, query, 200, returned=len(records))
    return JSONResponse({"object": "list", "filter": {"tenant": query.tenant, "limit": query.limit},
                         "data": records})
