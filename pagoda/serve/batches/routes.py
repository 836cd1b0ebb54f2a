"""The Batch API's routes: /v1/batches (create is an entry of the endpoint table, with a JSON
body; retrieve, list and cancel here) and /v1/files (files.py), and `RunnerStart`, the middleware
that starts the batch runner on the server's event loop."""

from __future__ import annotations

import time
from collections.abc import Awaitable, Callable
from typing import Any

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response

from pagoda.serve.admission.tenants import Tenant
from pagoda.serve.batches.files import FilesAPI, file_not_found, list_limit, page
from pagoda.serve.batches.protocol import (
    BATCH_ENDPOINTS,
    BatchCreateRequest,
    BatchList,
    BatchObject,
    BatchRequestCounts,
)
from pagoda.serve.batches.runner import BatchRunner, completion_window_seconds
from pagoda.serve.batches.store import new_id
from pagoda.serve.errors import APIError, bad_request

MAX_BATCH_LIST_LIMIT = 100


def batch_not_found(batch_id: str) -> APIError:
    return APIError(404, f"No such batch: {batch_id!r}.", type="invalid_request_error", code="batch_not_found")


class Batches:
    """The batches of every tenant: created here, run by `runner`, read from its store."""

    def __init__(self, runner: BatchRunner, files: FilesAPI) -> None:
        self.runner = runner
        self.files = files
        self.store = runner.store

    async def create(self, _: Request, body: BatchCreateRequest, tenant: Tenant) -> Response:
        """A batch in `validating`: the runner checks its file and runs it (nothing runs here)."""
        if body.endpoint not in BATCH_ENDPOINTS:
            raise bad_request(
                f"endpoint must be one of {', '.join(BATCH_ENDPOINTS)}, got {body.endpoint!r}.", param="endpoint"
            )
        window = completion_window_seconds(body.completion_window)
        if window is None:
            raise bad_request(
                f"completion_window must be a duration such as 24h, got {body.completion_window!r}.",
                param="completion_window",
            )
        file = self.store.file(tenant.name, body.input_file_id)
        if file is None:
            raise file_not_found(body.input_file_id, param="input_file_id")
        if file.purpose != "batch":
            raise bad_request(
                f"File {file.id} has purpose {file.purpose!r}; a batch's input has purpose 'batch'.",
                param="input_file_id",
            )
        now = int(time.time())
        batch = BatchObject(
            id=new_id("batch"),
            endpoint=body.endpoint,
            input_file_id=file.id,
            completion_window=body.completion_window,
            status="validating",
            created_at=now,
            expires_at=now + window,
            request_counts=BatchRequestCounts(),
            metadata=body.metadata,
        )
        self.store.put_batch(tenant.name, batch)
        self.runner.wake()
        return JSONResponse(batch.model_dump())

    def get(self, tenant: Tenant, batch_id: str) -> BatchObject:
        batch = self.store.batch(tenant.name, batch_id)
        if batch is None:
            raise batch_not_found(batch_id)
        return batch

    def list(self, request: Request, tenant: Tenant) -> Response:
        params = request.query_params
        data, more = page(
            self.store.batches(tenant.name),
            params.get("after"),
            list_limit(params.get("limit"), 20, MAX_BATCH_LIST_LIMIT),
        )
        return JSONResponse(
            BatchList(
                data=data, has_more=more, first_id=data[0].id if data else None, last_id=data[-1].id if data else None
            ).model_dump()
        )

    def cancel(self, tenant: Tenant, batch_id: str) -> Response:
        """`cancelling` until the lines in flight are stopped, then `cancelled` with what finished."""
        batch = self.get(tenant, batch_id)
        if batch.status in ("validating", "in_progress"):
            batch.status, batch.cancelling_at = "cancelling", int(time.time())
            self.store.put_batch(tenant.name, batch)
            self.runner.wake()
        elif batch.status != "cancelling":
            raise APIError(
                409,
                f"Batch {batch_id} is {batch.status}: only a validating or in-progress batch can be cancelled.",
                code="batch_not_cancellable",
            )
        return JSONResponse(batch.model_dump())


def install_batch_routes(app: FastAPI, authenticate: Callable[[Request], Tenant], batches: Batches) -> None:
    """The routes without a JSON body: /v1/files (upload is multipart) and the batches' reads and cancel."""
    files = batches.files

    @app.post("/v1/files")
    async def upload_file(request: Request) -> Response:
        return await files.upload(request, authenticate(request))

    @app.get("/v1/files")
    async def list_files(request: Request) -> Response:
        return files.list(request, authenticate(request))

    @app.get("/v1/files/{file_id}")
    async def retrieve_file(file_id: str, request: Request) -> Response:
        return files.retrieve(authenticate(request), file_id)

    @app.get("/v1/files/{file_id}/content")
    async def file_content(file_id: str, request: Request) -> Response:
        return await files.content(authenticate(request), file_id)

    @app.delete("/v1/files/{file_id}")
    async def delete_file(file_id: str, request: Request) -> Response:
        return files.delete(authenticate(request), file_id)

    @app.get("/v1/batches")
    async def list_batches(request: Request) -> Response:
        return batches.list(request, authenticate(request))

    @app.get("/v1/batches/{batch_id}")
    async def retrieve_batch(batch_id: str, request: Request) -> Response:
        return JSONResponse(batches.get(authenticate(request), batch_id).model_dump())

    @app.post("/v1/batches/{batch_id}/cancel")
    async def cancel_batch(batch_id: str, request: Request) -> Response:
        return batches.cancel(authenticate(request), batch_id)


ASGIApp = Callable[[dict, Callable[[], Awaitable[dict]], Callable[[dict], Awaitable[None]]], Awaitable[None]]


class RunnerStart:
    """ASGI middleware: the app has no lifespan, so the batch runner starts (and resumes the
    stored batches) with the first request the server answers, /health polls included."""

    def __init__(self, app: ASGIApp, runner: BatchRunner) -> None:
        self.app = app
        self.runner = runner

    async def __call__(
        self, scope: dict, receive: Callable[[], Awaitable[dict]], send: Callable[[dict], Awaitable[Any]]
    ) -> None:
        if scope["type"] == "http":
            self.runner.ensure_running()
        await self.app(scope, receive, send)
