"""/v1/files: upload (multipart, `purpose: "batch"`), list, retrieve, content and delete, per
tenant. A tenant sees only its own files: another's is answered as an unknown one (a 404).

Uploads are capped per file (--batch-max-file-bytes, within --max-request-bytes: the body limit
comes first) and per tenant (--batch-max-tenant-bytes, every file it holds, outputs included).
The multipart body is parsed with the standard library's MIME parser (no extra dependency).
"""

from __future__ import annotations

import asyncio
import email.parser
import email.policy
import time

from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagoda.serve.admission.tenants import Tenant
from pagoda.serve.batches.protocol import FILE_PURPOSES, FileDeleted, FileList, FileObject
from pagoda.serve.batches.store import BatchStore, new_id
from pagoda.serve.errors import APIError, bad_request

MAX_LIST_LIMIT = 10_000


def file_not_found(file_id: str, param: str | None = None) -> APIError:
    return APIError(
        404, f"No such file: {file_id!r}.", type="invalid_request_error", param=param, code="file_not_found"
    )


def multipart_fields(content_type: str, body: bytes) -> dict[str, tuple[str | None, bytes]]:
    """A multipart/form-data body's fields: name -> (its filename, if a file; its bytes)."""
    if not content_type.lower().startswith("multipart/form-data"):
        raise bad_request("Upload a file as multipart/form-data (fields `file` and `purpose`).")
    head = b"Content-Type: " + content_type.encode("latin-1") + b"\r\nMIME-Version: 1.0\r\n\r\n"
    message = email.parser.BytesParser(policy=email.policy.HTTP).parsebytes(head + body)
    if not message.is_multipart() or message.defects:
        raise bad_request("The multipart body is malformed.")
    fields: dict[str, tuple[str | None, bytes]] = {}
    for part in message.iter_parts():
        name = part.get_param("name", header="content-disposition")
        if isinstance(name, str):
            payload = part.get_payload(decode=True)
            fields[name] = (part.get_filename(), payload if isinstance(payload, bytes) else b"")
    return fields


def page(items: list, after: str | None, limit: int) -> tuple[list, bool]:
    """The items after the one with id `after` (newest first), at most `limit`; whether more follow."""
    if after is not None:
        ids = [item.id for item in items]
        items = items[ids.index(after) + 1 :] if after in ids else []
    return items[:limit], len(items) > limit


def list_limit(text: str | None, default: int, maximum: int) -> int:
    try:
        limit = default if text is None else int(text)
    except ValueError:
        limit = 0
    if not 1 <= limit <= maximum:
        raise bad_request(f"limit must be an integer from 1 to {maximum}.", param="limit")
    return limit


class FilesAPI:
    def __init__(self, store: BatchStore, max_file_bytes: int, max_tenant_bytes: int) -> None:
        self.store = store
        self.max_file_bytes = max_file_bytes
        self.max_tenant_bytes = max_tenant_bytes

    async def upload(self, request: Request, tenant: Tenant) -> Response:
        body = await request.body()
        fields = await asyncio.to_thread(multipart_fields, request.headers.get("content-type", ""), body)
        purpose = fields.get("purpose", (None, b""))[1].decode("utf-8", "replace").strip()
        if purpose != "batch":
            raise bad_request(f"purpose must be 'batch', got {purpose!r}.", param="purpose")
        filename, content = fields.get("file", (None, None))
        if content is None or filename is None:
            raise bad_request("The upload has no `file` field.", param="file")
        if len(content) > self.max_file_bytes:
            raise APIError(
                413,
                f"The file holds {len(content)} bytes, over the limit of {self.max_file_bytes} "
                "bytes (--batch-max-file-bytes).",
                param="file",
                code="file_too_large",
            )
        held = self.store.tenant_bytes(tenant.name)
        if held + len(content) > self.max_tenant_bytes:
            raise APIError(
                413,
                f"This key's files hold {held} bytes; this one would pass its limit of "
                f"{self.max_tenant_bytes} bytes (--batch-max-tenant-bytes). Delete files "
                "first.",
                param="file",
                code="storage_limit_exceeded",
            )
        file = FileObject(
            id=new_id("file"),
            bytes=len(content),
            created_at=int(time.time()),
            filename=filename or "upload.jsonl",
            purpose=purpose,
        )
        await asyncio.to_thread(self.store.add_file, tenant.name, file, content)
        return JSONResponse(file.model_dump())

    def list(self, request: Request, tenant: Tenant) -> Response:
        params = request.query_params
        purpose = params.get("purpose")
        if purpose is not None and purpose not in FILE_PURPOSES:
            raise bad_request(f"purpose must be one of {', '.join(FILE_PURPOSES)}.", param="purpose")
        files = self.store.files(tenant.name, purpose)
        if params.get("order") == "asc":
            files.reverse()
        data, more = page(files, params.get("after"), list_limit(params.get("limit"), MAX_LIST_LIMIT, MAX_LIST_LIMIT))
        return JSONResponse(
            FileList(
                data=data, has_more=more, first_id=data[0].id if data else None, last_id=data[-1].id if data else None
            ).model_dump()
        )

    def get(self, tenant: Tenant, file_id: str) -> FileObject:
        file = self.store.file(tenant.name, file_id)
        if file is None:
            raise file_not_found(file_id)
        return file

    def retrieve(self, tenant: Tenant, file_id: str) -> Response:
        return JSONResponse(self.get(tenant, file_id).model_dump())

    async def content(self, tenant: Tenant, file_id: str) -> Response:
        self.get(tenant, file_id)
        try:
            content = await asyncio.to_thread(self.store.file_path(file_id).read_bytes)
        except OSError:
            raise file_not_found(file_id) from None
        return Response(content, media_type="application/jsonl")

    def delete(self, tenant: Tenant, file_id: str) -> Response:
        if not self.store.delete_file(tenant.name, file_id):
            raise file_not_found(file_id)
        return JSONResponse(FileDeleted(id=file_id).model_dump())
