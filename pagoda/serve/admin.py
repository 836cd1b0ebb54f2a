"""The admin routes, for admin keys: LoRA adapters (POST /v1/load_lora_adapter and
/v1/unload_lora_adapter), weight updates, pause and sleep (api/engine_control.py: POST
/update_weights_from_disk, the weight-update group's phases, /pause, /resume, /sleep, /wake_up,
GET /is_sleeping), what served a recent request (GET /admin/provenance/{id}), the live
canary (GET /admin/canary, POST /admin/canary/promote and /admin/canary/rollback), and the
prompt log (GET /admin/prompt-log?tenant=NAME&limit=N: its newest records).

Every read of the prompt log is written to its audit file first, whatever its outcome: who (the
key's tenant; null without a valid key), when, the filter asked for, the status and how many
records were returned.
"""

from __future__ import annotations

import asyncio
import functools
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagoda.engine.client import EngineClient
from pagoda.serve.admission.tenants import Tenant
from pagoda.serve.api import engine_control as control
from pagoda.serve.api.lora import (
    LoadLoRAAdapterRequest,
    UnloadLoRAAdapterRequest,
    load_lora_adapter,
    unload_lora_adapter,
)
from pagoda.serve.endpoints import AppParts, Endpoint
from pagoda.serve.errors import APIError, bad_request
from pagoda.serve.observability.prompt_log import DEFAULT_READ_LIMIT, MAX_READ_LIMIT, PromptLog, PromptLogQuery
from pagoda.serve.routing.canary import CanaryController
from pagoda.serve.serving import ServeContext

ENGINE_CONTROL_REFUSAL = "Only admin keys may update weights, pause or put the model to sleep."


def _engine_control(handle: Callable[[EngineClient, Any], Awaitable[Response]]) -> Callable[[AppParts, str], Any]:
    """An admin route of api/engine_control.py on the primary model's engine client."""

    def build(parts: AppParts, _: str) -> Any:
        async def run(request: Request, body: Any, tenant: Tenant) -> Response:
            _check_admin(parts, tenant, ENGINE_CONTROL_REFUSAL)
            return await handle(parts.ctx.llm, body)

        return run

    return build


def _command(command: str, done: str = "") -> Callable[[AppParts, str], Any]:
    return _engine_control(
        lambda llm, body: control.run_command(llm, command, body.model_dump(exclude={"group_name"}), done)
    )


# The admin routes that carry a body, installed and documented as the API's endpoints are.
ADMIN_ENDPOINTS: tuple[Endpoint, ...] = (
    Endpoint(
        "/v1/load_lora_adapter",
        None,
        LoadLoRAAdapterRequest,
        None,
        lambda parts, _: functools.partial(load_lora_adapter, parts.ctx),
    ),
    Endpoint(
        "/v1/unload_lora_adapter",
        None,
        UnloadLoRAAdapterRequest,
        None,
        lambda parts, _: functools.partial(unload_lora_adapter, parts.ctx),
    ),
    # ---- weight updates (api/engine_control.py) ----
    Endpoint(
        "/update_weights_from_disk",
        None,
        control.UpdateWeightsFromDiskRequest,
        None,
        _engine_control(control.update_weights_from_disk),
    ),
    Endpoint(
        "/init_weight_update_group",
        None,
        control.InitWeightUpdateGroupRequest,
        None,
        _command("init_weight_update_group", "joined the weight update group"),
    ),
    Endpoint("/start_weight_update", None, control.EmptyRequest, None, _command("start_weight_update")),
    Endpoint(
        "/update_weights",
        None,
        control.UpdateWeightsRequest,
        None,
        _command("update_weights", "tensors received and staged"),
    ),
    Endpoint("/finish_weight_update", None, control.FinishWeightUpdateRequest, None, _command("finish_weight_update")),
    Endpoint(
        "/update_weights_from_distributed",
        None,
        control.UpdateWeightsRequest,
        None,
        _engine_control(control.update_weights_from_distributed),
    ),
    Endpoint("/destroy_weight_update_group", None, control.EmptyRequest, None, _command("destroy_weight_update_group")),
)


def install_admin_routes(app: FastAPI, parts: AppParts) -> None:
    """The admin reads and actions without a body (`ADMIN_ENDPOINTS` are installed with the API's)."""
    ctx = parts.ctx

    @app.get("/admin/provenance/{provenance_id}")
    async def provenance(provenance_id: str, request: Request) -> Response:
        # What served a recent request (the id is its x-pagoda-provenance header).
        _require_admin(parts, request, "Only admin keys may read provenance records.")
        record = next(
            (
                found
                for model in parts.registry  # each model keeps its own requests' records
                if (found := model.context.provenance.find(provenance_id)) is not None
            ),
            None,
        )
        if record is None:
            raise APIError(
                404,
                f"No recent request has the provenance id {provenance_id!r} (the request log holds every record).",
                type="not_found_error",
            )
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

    # ---- pause and sleep (api/engine_control.py): arguments in the query, as vLLM's ----

    @app.post("/pause")
    async def pause(request: Request) -> Response:
        _require_admin(parts, request, ENGINE_CONTROL_REFUSAL)
        mode = request.query_params.get("mode", "wait")
        if mode not in control.PAUSE_MODES:
            raise bad_request(f"mode must be one of {', '.join(control.PAUSE_MODES)}, got {mode!r}", param="mode")
        return await control.run_command(ctx.llm, "pause", {"mode": mode}, f"paused ({mode})")

    @app.post("/resume")
    async def resume(request: Request) -> Response:
        _require_admin(parts, request, ENGINE_CONTROL_REFUSAL)
        return await control.run_command(ctx.llm, "resume", {}, "resumed")

    @app.post("/sleep")
    async def sleep(request: Request) -> Response:
        _require_admin(parts, request, ENGINE_CONTROL_REFUSAL)
        level = request.query_params.get("level", "1")
        if level not in ("1", "2"):
            raise bad_request(f"level must be 1 or 2, got {level!r}", param="level")
        return await control.run_command(ctx.llm, "sleep", {"level": int(level)}, f"asleep (level {level})")

    @app.post("/wake_up")
    async def wake_up(request: Request) -> Response:
        _require_admin(parts, request, ENGINE_CONTROL_REFUSAL)
        return await control.run_command(ctx.llm, "wake_up", {}, "awake")

    @app.get("/is_sleeping")
    async def is_sleeping(request: Request) -> Response:
        _require_admin(parts, request, ENGINE_CONTROL_REFUSAL)
        return JSONResponse({"is_sleeping": bool(ctx.llm.sleep_level), "level": ctx.llm.sleep_level})

    @app.get("/admin/prompt-log")
    async def prompt_log(request: Request) -> Response:
        return await read_prompt_log(ctx, request, lambda: parts.authenticate(request))


def _require_admin(parts: AppParts, request: Request, refusal: str) -> Tenant:
    """The request's tenant when it holds an admin key (or the server is open), else a 403."""
    return _check_admin(parts, parts.authenticate(request), refusal)


def _check_admin(parts: AppParts, tenant: Tenant, refusal: str) -> Tenant:
    if not (tenant.admin or parts.settings.tenants.open_access):
        raise APIError(403, refusal, type="permission_error", code="admin_required")
    return tenant


def _canary(parts: AppParts, request: Request) -> CanaryController:
    _require_admin(parts, request, "Only admin keys may read or steer the canary.")
    if parts.canary is None:
        raise APIError(404, "This server runs no canary (a `canary` block in the models file).", type="not_found_error")
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
        raise bad_request(f"limit must be an integer from 1 to {MAX_READ_LIMIT}, got {limit_text!r}.", param="limit")
    return PromptLogQuery(tenant=params.get("tenant") or None, limit=limit)


async def read_prompt_log(ctx: ServeContext, request: Request, authenticate: Callable[[], Tenant]) -> Response:
    log: PromptLog | None = ctx.prompt_log
    if log is None:
        authenticate()  # whether the log is on is no one's business without a key
        raise APIError(404, "The prompt log is off (the server runs without --log-prompts).", type="not_found_error")
    params = dict(request.query_params)
    who = None
    try:
        tenant = authenticate()
        who = tenant.name
        if not tenant.admin:
            raise APIError(
                403, "Only admin keys may read the prompt log.", type="permission_error", code="permission_denied"
            )
        query = _query(params)
    except APIError as exc:
        log.audit(who, None, exc.status, filters=params)
        raise
    records = await asyncio.to_thread(log.read, query)
    log.audit(who, query, 200, returned=len(records))
    return JSONResponse({"object": "list", "filter": {"tenant": query.tenant, "limit": query.limit}, "data": records})
