"""The batch runner: one task on the server's event loop that validates new batches, runs their
lines through the endpoints' own path at low priority, records each result as it comes back, and
writes the output and error files when a batch ends (completed, expired or cancelled).

Each line is answered by the same handler its URL has online (`BatchTarget.run`, from the
endpoint table), as the batch's tenant: model names, tenants' limits and quotas, guardrails, the
request log and metrics apply to it as to any request. What keeps a batch from taking the online
traffic's share:
- at most `concurrency` lines in flight, over every batch (--batch-concurrency);
- no new line while online requests wait for admission (more sequences queued than the batch's
  own lines in flight);
- each line at the lowest priority its tenant may ask for (under --scheduling-policy priority the
  engine schedules online requests first and preempts batch lines for them);
- a line refused for load (a 503 or a tenant's 429) is retried after the refusal's Retry-After,
  never failed for it.

The app has no lifespan: the task starts with the first request the server answers (its /health
polls included: `ensure_running`), and resumes every batch the store holds unfinished.
"""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import time
from collections.abc import Awaitable, Callable, Mapping
from dataclasses import dataclass
from typing import Any

import pydantic
from fastapi import Request
from fastapi.responses import Response

from pagoda.serve.admission.queue import AdmissionController
from pagoda.serve.admission.tenants import Tenant, TenantRegistry
from pagoda.serve.batches.protocol import BatchError, BatchErrors, BatchObject, FileObject
from pagoda.serve.batches.store import BatchStore, LineResult, new_id
from pagoda.serve.errors import APIError, validation_error

logger = logging.getLogger(__name__)

# Under --scheduling-policy priority, lower runs first: a batch line asks for this or the highest
# value its tenant's priority_range allows.
BATCH_PRIORITY = 1_000_000
MAX_LINES = 50_000  # OpenAI's limit of requests per batch
POLL_S = 0.5  # how often the runner looks for expired batches without being woken
RETRY_AFTER_S = 1.0  # a load refusal without a Retry-After header
_WINDOW = re.compile(r"(\d+)([smhd])")
_WINDOW_SECONDS = {"s": 1, "m": 60, "h": 3600, "d": 86400}


@dataclass(frozen=True)
class BatchTarget:
    """What answers one URL of a batch line: its request model and the endpoint's handler."""

    request_model: type[pydantic.BaseModel]
    run: Callable[[Request, Any, Tenant], Awaitable[Response]]


@dataclass(frozen=True)
class BatchLine:
    index: int  # 0-based position among the file's requests
    custom_id: str
    body: dict[str, Any]


def completion_window_seconds(window: str) -> int | None:
    """Seconds in a completion window such as 24h (OpenAI's one value), 30m or 2d; None if malformed."""
    match = _WINDOW.fullmatch(window)
    if match is None or int(match.group(1)) < 1:
        return None
    return int(match.group(1)) * _WINDOW_SECONDS[match.group(2)]


def batch_priority(tenant: Tenant) -> int:
    """The lowest scheduling rank `tenant` may ask for."""
    low, high = tenant.limits.priority_range or (tenant.limits.priority, None)
    return high if high is not None else max(low, BATCH_PRIORITY)


def parse_lines(content: bytes, endpoint: str) -> tuple[list[BatchLine], list[BatchError]]:
    """The input file's requests, or the errors that fail the batch (line numbers 1-based)."""
    lines: list[BatchLine] = []
    errors: list[BatchError] = []
    seen: set[str] = set()
    try:
        text = content.decode("utf-8")
    except UnicodeDecodeError:
        return [], [BatchError(code="invalid_file", message="The input file is not UTF-8 text.")]
    for number, raw in enumerate(text.splitlines(), start=1):
        if not raw.strip():
            continue
        try:
            entry = json.loads(raw)
        except ValueError:
            errors.append(BatchError(code="invalid_json_line", message="This line is not JSON.", line=number))
            continue
        if not isinstance(entry, dict):
            errors.append(BatchError(code="invalid_json_line", message="This line is not a JSON object.", line=number))
            continue
        custom_id, body = entry.get("custom_id"), entry.get("body")
        problem = None
        if not isinstance(custom_id, str) or not custom_id:
            problem = ("missing_required_parameter", "custom_id", "custom_id must be a non-empty string.")
        elif custom_id in seen:
            problem = ("duplicate_custom_id", "custom_id", f"custom_id {custom_id!r} is on an earlier line.")
        elif entry.get("method") != "POST":
            problem = ("invalid_method", "method", "method must be POST.")
        elif entry.get("url") != endpoint:
            problem = (
                "mismatched_endpoint",
                "url",
                f"url {entry.get('url')!r} is not the batch's endpoint {endpoint!r}.",
            )
        elif not isinstance(body, dict):
            problem = ("missing_required_parameter", "body", "body must be a JSON object.")
        if problem is not None:
            errors.append(BatchError(code=problem[0], param=problem[1], message=problem[2], line=number))
            continue
        assert isinstance(custom_id, str) and isinstance(body, dict)
        seen.add(custom_id)
        lines.append(BatchLine(len(lines), custom_id, body))
    if not lines and not errors:
        errors.append(BatchError(code="empty_file", message="The input file holds no requests."))
    if len(lines) > MAX_LINES:
        errors.append(
            BatchError(
                code="too_many_requests", message=f"The input file holds {len(lines)} requests; at most {MAX_LINES}."
            )
        )
    return lines, errors[:100]


async def _never_disconnects() -> dict[str, Any]:
    await asyncio.Event().wait()  # the line's "client" stays until the line ends
    raise AssertionError("unreachable")


def _line_request(url: str) -> Request:
    """The request object a line is answered under: no client that could leave, no headers."""
    return Request(
        {
            "type": "http",
            "method": "POST",
            "path": url,
            "raw_path": url.encode(),
            "headers": [],
            "query_string": b"",
            "scheme": "http",
            "server": None,
            "client": None,
            "root_path": "",
            "http_version": "1.1",
        },
        _never_disconnects,
    )


class BatchRunner:
    def __init__(
        self,
        store: BatchStore,
        targets: Mapping[str, BatchTarget],
        tenants: TenantRegistry,
        admissions: Callable[[], list[AdmissionController]],
        concurrency: int,
        clock: Callable[[], float] = time.time,
    ) -> None:
        if concurrency < 1:
            raise ValueError(f"batch concurrency must be >= 1, got {concurrency}")
        self.store = store
        self.targets = targets
        self.tenants = tenants
        self.admissions = admissions  # every served model's admission queue
        self.concurrency = concurrency
        self.clock = clock
        # Batch id -> its parsed input while active (once running: the lines without a result at start).
        self._lines: dict[str, list[BatchLine]] = {}
        self._in_flight: dict[str, dict[int, asyncio.Task[None]]] = {}  # batch id -> line -> task
        # Batch id -> the first line not started yet: every line before it has a result or is in
        # flight (a line refused for load is retried inside its task), so each step starts from here.
        self._next: dict[str, int] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake: asyncio.Event | None = None

    # ---- driving ----

    def ensure_running(self) -> None:
        """Start the runner's task on the running event loop, once (and again if it died)."""
        if self._task is None or self._task.done():
            self._wake = asyncio.Event()
            self._task = asyncio.get_running_loop().create_task(self._run(), name="batch-runner")

    def wake(self) -> None:
        if self._wake is not None:
            self._wake.set()

    @property
    def lines_in_flight(self) -> int:
        return sum(len(lines) for lines in self._in_flight.values())

    async def _run(self) -> None:
        assert self._wake is not None
        while True:
            self._wake.clear()
            try:
                await self._step()
            except Exception:  # a store or file fault: logged, and the next step tries again
                logger.exception("batch runner step failed")
            try:
                await asyncio.wait_for(self._wake.wait(), POLL_S)
            except asyncio.TimeoutError:
                pass

    async def _step(self) -> None:
        for tenant_name, batch in self.store.active_batches():
            if batch.status == "validating":
                await self._validate(tenant_name, batch)
            elif batch.status == "cancelling":
                await self._cancel(tenant_name, batch)
            elif batch.status == "finalizing":
                await self._finalize(tenant_name, batch, "completed")
            elif batch.expires_at is not None and self.clock() >= batch.expires_at:
                await self._expire(tenant_name, batch)
            else:
                await self._advance(tenant_name, batch)

    def _now(self) -> int:
        return int(self.clock())

    # ---- the stages ----

    async def _validate(self, tenant_name: str, batch: BatchObject) -> None:
        path = self.store.file_path(batch.input_file_id)
        lines: list[BatchLine]
        errors: list[BatchError]
        try:
            content = await asyncio.to_thread(path.read_bytes)
        except OSError:
            lines, errors = (
                [],
                [
                    BatchError(
                        code="file_not_found",
                        param="input_file_id",
                        message=f"The input file {batch.input_file_id} was deleted.",
                    )
                ],
            )
        else:
            lines, errors = await asyncio.to_thread(parse_lines, content, batch.endpoint)
        current = self.store.batch(tenant_name, batch.id)
        if current is None or current.status != "validating":  # cancelled meanwhile
            return
        if errors:
            batch.status, batch.failed_at = "failed", self._now()
            batch.errors = BatchErrors(data=errors)
        else:
            self._lines[batch.id] = lines
            batch.status, batch.in_progress_at = "in_progress", self._now()
            batch.request_counts.total = len(lines)
        self.store.put_batch(tenant_name, batch)
        self.wake()

    async def _batch_lines(self, batch: BatchObject) -> list[BatchLine]:
        """The batch's parsed input: read again after a restart (it was valid when accepted)."""
        known = self._lines.get(batch.id)
        if known is not None:
            return known
        content = await asyncio.to_thread(self.store.file_path(batch.input_file_id).read_bytes)
        lines, _ = await asyncio.to_thread(parse_lines, content, batch.endpoint)
        self._lines[batch.id] = lines
        return lines

    async def _advance(self, tenant_name: str, batch: BatchObject) -> None:
        try:
            lines = await self._batch_lines(batch)
        except OSError:
            batch.errors = BatchErrors(
                data=[
                    BatchError(
                        code="file_not_found",
                        param="input_file_id",
                        message=f"The input file {batch.input_file_id} was deleted.",
                    )
                ]
            )
            await self._finalize(tenant_name, batch, "failed")
            return
        tenant = self.tenants.by_name(tenant_name)
        if tenant is None:  # its keys were removed from the keys file: nobody runs it
            return
        in_flight = self._in_flight.setdefault(batch.id, {})
        if batch.id not in self._next:  # first seen (or resumed): skip the lines with a result
            self._next[batch.id] = 0
            done = self.store.done_lines(batch.id)
            lines = [line for line in lines if line.index not in done]
            self._lines[batch.id] = lines
        position = self._next[batch.id]
        if position >= len(lines) and not in_flight:
            await self._finalize(tenant_name, batch, "completed")
            return
        while position < len(lines) and self.lines_in_flight < self.concurrency and not self._online_waiting():
            line = lines[position]
            task = asyncio.get_running_loop().create_task(
                self._run_line(tenant, batch, line), name=f"{batch.id}-{line.index}"
            )
            in_flight[line.index] = task
            task.add_done_callback(functools.partial(self._line_ended, batch.id, line.index))
            position += 1
        self._next[batch.id] = position

    def _online_waiting(self) -> bool:
        """Whether requests other than the batch lines wait for admission or their first token."""
        waiting = sum(admission.queued_sequences + admission.arriving for admission in self.admissions())
        return waiting > self.lines_in_flight

    def _line_ended(self, batch_id: str, index: int, _: asyncio.Task[None]) -> None:
        self._in_flight.get(batch_id, {}).pop(index, None)
        self.wake()

    async def _cancel(self, tenant_name: str, batch: BatchObject) -> None:
        tasks = list(self._in_flight.get(batch.id, {}).values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        await self._finalize(tenant_name, batch, "cancelled")

    async def _expire(self, tenant_name: str, batch: BatchObject) -> None:
        """Past the completion window: the lines not run are failed as OpenAI fails them."""
        tasks = list(self._in_flight.get(batch.id, {}).values())
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        try:
            lines = await self._batch_lines(batch)
        except OSError:
            lines = []
        done = self.store.done_lines(batch.id)
        for line in lines:
            if line.index not in done:
                self.store.add_result(
                    batch.id,
                    LineResult(
                        line.index,
                        True,
                        {
                            "id": new_id("batch_req"),
                            "custom_id": line.custom_id,
                            "response": None,
                            "error": {
                                "code": "batch_expired",
                                "message": "This request could not be executed before the completion window expired.",
                            },
                        },
                    ),
                )
        await self._finalize(tenant_name, batch, "expired")

    async def _finalize(self, tenant_name: str, batch: BatchObject, status: str) -> None:
        """Write the output and error files, then set the final status."""
        now = self._now()
        if batch.status != "finalizing" and status == "completed":
            batch.status, batch.finalizing_at = "finalizing", now
            self.store.put_batch(tenant_name, batch)
        outputs: list[str] = []
        errors: list[str] = []
        for result in self.store.results(batch.id):
            (errors if result.failed else outputs).append(json.dumps(result.record, ensure_ascii=False))
        for records, kind in ((outputs, "output"), (errors, "error")):
            if not records:
                continue
            content = ("\n".join(records) + "\n").encode("utf-8")
            file = FileObject(
                id=new_id("file"),
                bytes=len(content),
                created_at=now,
                filename=f"{batch.id}_{kind}.jsonl",
                purpose="batch_output",
            )
            await asyncio.to_thread(self.store.add_file, tenant_name, file, content)
            if kind == "output":
                batch.output_file_id = file.id
            else:
                batch.error_file_id = file.id
        batch.status = status  # type: ignore[assignment]
        setattr(batch, f"{status}_at", now)
        self.store.put_batch(tenant_name, batch)
        self._lines.pop(batch.id, None)
        self._in_flight.pop(batch.id, None)
        self._next.pop(batch.id, None)
        logger.info("batch %s %s: %d succeeded, %d failed", batch.id, status, len(outputs), len(errors))

    # ---- one line ----

    async def _run_line(self, tenant: Tenant, batch: BatchObject, line: BatchLine) -> None:
        target = self.targets[batch.endpoint]
        body = dict(line.body)
        if "stream" in target.request_model.model_fields:  # a batch's answers are whole bodies
            body["stream"] = False
            body.pop("stream_options", None)
        if "priority" in target.request_model.model_fields:
            body["priority"] = batch_priority(tenant)
        while True:
            status, answer, retry_after = await self._answer(target, batch.endpoint, body, tenant)
            if status == 503 or (status == 429 and retry_after is not None):
                await asyncio.sleep(retry_after or RETRY_AFTER_S)  # refused for load: later
                continue
            break
        request_id = answer.get("id") if isinstance(answer.get("id"), str) else new_id("req")
        self.store.add_result(
            batch.id,
            LineResult(
                line.index,
                status >= 400,
                {
                    "id": new_id("batch_req"),
                    "custom_id": line.custom_id,
                    "response": {"status_code": status, "request_id": request_id, "body": answer},
                    "error": None,
                },
            ),
        )

    async def _answer(
        self, target: BatchTarget, url: str, body: dict[str, Any], tenant: Tenant
    ) -> tuple[int, dict[str, Any], float | None]:
        """(status, JSON body, Retry-After seconds) of the endpoint's answer to `body`."""
        try:
            try:
                request = target.request_model.model_validate(body)
            except pydantic.ValidationError as exc:
                raise validation_error(list(exc.errors())) from None
            response = await target.run(_line_request(url), request, tenant)
        except APIError as exc:
            retry = exc.headers.get("Retry-After")
            return exc.status, exc.body(), float(retry) if retry else None
        except Exception:
            logger.exception("batch line failed")
            return 500, APIError(500, "Internal server error.", type="server_error").body(), None
        try:
            answer = json.loads(bytes(response.body))
        except (AttributeError, ValueError):
            answer = {}
        return response.status_code, answer if isinstance(answer, dict) else {"data": answer}, None
