"""The Batch API's bodies, in OpenAI's shapes: file objects, batch objects, their lists, and
the body that creates a batch."""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict

# The endpoints a batch may run (OpenAI's, less those pagoda does not serve).
BATCH_ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/embeddings")
FILE_PURPOSES = ("batch", "batch_output")  # uploads are "batch"; outputs are written as "batch_output"

BatchStatus = Literal[
    "validating", "failed", "in_progress", "finalizing", "completed", "expired", "cancelling", "cancelled"
]
# Statuses the runner still has work in; the others are final.
ACTIVE_STATUSES = ("validating", "in_progress", "finalizing", "cancelling")


class FileObject(BaseModel):
    id: str
    object: Literal["file"] = "file"
    bytes: int
    created_at: int
    filename: str
    purpose: str
    status: Literal["uploaded", "processed", "error"] = "processed"
    status_details: str | None = None
    expires_at: int | None = None


class FileList(BaseModel):
    object: Literal["list"] = "list"
    data: list[FileObject]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None


class FileDeleted(BaseModel):
    id: str
    object: Literal["file"] = "file"
    deleted: bool = True


class BatchRequestCounts(BaseModel):
    total: int = 0
    completed: int = 0
    failed: int = 0


class BatchError(BaseModel):
    code: str
    message: str
    param: str | None = None
    line: int | None = None


class BatchErrors(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchError]


class BatchObject(BaseModel):
    id: str
    object: Literal["batch"] = "batch"
    endpoint: str
    errors: BatchErrors | None = None
    input_file_id: str
    completion_window: str
    status: BatchStatus
    output_file_id: str | None = None
    error_file_id: str | None = None
    created_at: int
    in_progress_at: int | None = None
    expires_at: int | None = None
    finalizing_at: int | None = None
    completed_at: int | None = None
    failed_at: int | None = None
    expired_at: int | None = None
    cancelling_at: int | None = None
    cancelled_at: int | None = None
    request_counts: BatchRequestCounts
    metadata: dict[str, str] | None = None


class BatchList(BaseModel):
    object: Literal["list"] = "list"
    data: list[BatchObject]
    has_more: bool = False
    first_id: str | None = None
    last_id: str | None = None


class BatchCreateRequest(BaseModel):
    model_config = ConfigDict(extra="forbid")

    input_file_id: str
    endpoint: str
    completion_window: str = "24h"
    metadata: dict[str, str] | None = None
    output_expires_after: dict[str, Any] | None = None  # OpenAI's; outputs are kept until deleted
