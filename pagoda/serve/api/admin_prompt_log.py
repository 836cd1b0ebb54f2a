"""GET /admin/prompt-log?tenant=NAME&limit=N: the prompt log's newest records (admin keys only).

Every access is written to the prompt log's audit file first, whatever its outcome: who (the
key's tenant; null without a valid key), when, the filter asked for, the status and how many
records were returned.
"""

from __future__ import annotations

import asyncio
from typing import Callable

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagoda.serve.admission.tenants import Tenant
from pagoda.serve.errors import APIError, bad_request
from pagoda.serve.prompt_log import DEFAULT_READ_LIMIT, MAX_READ_LIMIT, PromptLog, PromptLogQuery
from pagoda.serve.serving import ServeContext

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
