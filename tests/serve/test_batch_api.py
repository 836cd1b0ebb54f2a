"""The Batch API through the openai SDK: files in, batches run beside online traffic, output and
error files in OpenAI's JSONL shape, per-tenant files, cancel, and the size caps."""

from __future__ import annotations

import io
import json
import time
from pathlib import Path

import httpx
import openai
import pytest

from pagoda.serve.admission.tenants import Tenant, TenantRegistry
from server_utils import MODEL_NAME, LiveServer, build_tiny_model, start_server

CHAT = {"model": MODEL_NAME, "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "temperature": 0}


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    tenants = TenantRegistry({"key-a": Tenant("a"), "key-b": Tenant("b")})
    live = start_server(
        build_tiny_model(tmp_path_factory.mktemp("model")),
        tenants=tenants,
        batch_concurrency=2,
        batch_max_file_bytes=64 * 1024,
        batch_max_tenant_bytes=256 * 1024,
    )
    yield live
    live.stop()


def client(server: LiveServer, key: str = "key-a") -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base_url, api_key=key, max_retries=0, timeout=30)


def jsonl(lines: list[dict]) -> bytes:
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


def line(custom_id: str, body: dict, url: str = "/v1/chat/completions") -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": url, "body": body}


def wait_done(sdk: openai.OpenAI, batch_id: str, timeout: float = 30) -> object:
    deadline = time.monotonic() + timeout
    while True:
        batch = sdk.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled") or time.monotonic() > deadline:
            return batch
        time.sleep(0.05)


def test_the_sdk_batch_example_runs_unchanged(server: LiveServer, tmp_path: Path) -> None:
    requests = [
        line(f"request-{i}", {**CHAT, "messages": [{"role": "user", "content": f"count {i}"}]}) for i in range(3)
    ]
    path = tmp_path / "batch.jsonl"
    path.write_bytes(jsonl(requests))
    sdk = client(server)
    batch_input_file = sdk.files.create(file=open(path, "rb"), purpose="batch")
    assert batch_input_file.purpose == "batch" and batch_input_file.bytes == path.stat().st_size
    batch = sdk.batches.create(
        input_file_id=batch_input_file.id,
        endpoint="/v1/chat/completions",
        completion_window="24h",
        metadata={"description": "nightly eval job"},
    )
    assert batch.status == "validating" and batch.metadata == {"description": "nightly eval job"}
    batch = wait_done(sdk, batch.id)
    assert batch.status == "completed", batch
    assert (batch.request_counts.total, batch.request_counts.completed, batch.request_counts.failed) == (3, 3, 0)
    assert batch.error_file_id is None and batch.completed_at >= batch.in_progress_at >= batch.created_at
    records = [json.loads(text) for text in sdk.files.content(batch.output_file_id).text.splitlines()]
    assert [r["custom_id"] for r in records] == ["request-0", "request-1", "request-2"]
    online = httpx.post(
        server.base_url + "/chat/completions", json=requests[1]["body"], headers={"Authorization": "Bearer key-a"}
    ).json()
    record = records[1]
    assert record["id"].startswith("batch_req_") and record["error"] is None
    response = record["response"]
    assert response["status_code"] == 200 and response["request_id"] == response["body"]["id"]
    assert response["body"]["object"] == "chat.completion"
    assert response["body"]["choices"][0]["message"] == online["choices"][0]["message"]
    assert batch.id in [b.id for b in sdk.batches.list()]
    output = sdk.files.retrieve(batch.output_file_id)
    assert output.purpose == "batch_output" and output.filename == f"{batch.id}_output.jsonl"


def test_failed_lines_go_to_the_error_file(server: LiveServer) -> None:
    sdk = client(server)
    content = jsonl(
        [
            line("good", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": 2}, "/v1/completions"),
            line("bad", {"model": "no-such-model", "prompt": "hi"}, "/v1/completions"),
            line("worse", {"model": MODEL_NAME, "prompt": "hi", "max_tokens": -1}, "/v1/completions"),
        ]
    )
    file = sdk.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
    batch = wait_done(
        sdk, sdk.batches.create(input_file_id=file.id, endpoint="/v1/completions", completion_window="24h").id
    )
    assert batch.status == "completed"
    assert (batch.request_counts.completed, batch.request_counts.failed) == (1, 2)
    [good] = [json.loads(t) for t in sdk.files.content(batch.output_file_id).text.splitlines()]
    assert good["custom_id"] == "good" and good["response"]["body"]["object"] == "text_completion"
    errors = {r["custom_id"]: r for r in map(json.loads, sdk.files.content(batch.error_file_id).text.splitlines())}
    assert errors["bad"]["response"]["status_code"] == 404
    assert errors["worse"]["response"]["status_code"] == 400
    assert "error" in errors["worse"]["response"]["body"]


def test_embeddings_batch(server: LiveServer) -> None:
    sdk = client(server)
    content = jsonl([line("e", {"model": MODEL_NAME, "input": "hello"}, "/v1/embeddings")])
    file = sdk.files.create(file=("e.jsonl", io.BytesIO(content)), purpose="batch")
    batch = wait_done(
        sdk, sdk.batches.create(input_file_id=file.id, endpoint="/v1/embeddings", completion_window="24h").id
    )
    [record] = [json.loads(t) for t in sdk.files.content(batch.output_file_id).text.splitlines()]
    assert record["response"]["body"]["data"][0]["object"] == "embedding"


def test_a_malformed_input_file_fails_the_batch(server: LiveServer) -> None:
    sdk = client(server)
    content = jsonl([line("a", CHAT), line("a", CHAT), line("b", CHAT, "/v1/completions")]) + b"not json\n"
    file = sdk.files.create(file=("bad.jsonl", io.BytesIO(content)), purpose="batch")
    batch = wait_done(
        sdk, sdk.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h").id
    )
    assert batch.status == "failed" and batch.failed_at is not None
    assert [(e.code, e.line) for e in batch.errors.data] == [
        ("duplicate_custom_id", 2),
        ("mismatched_endpoint", 3),
        ("invalid_json_line", 4),
    ]


def test_files_and_batches_are_per_tenant(server: LiveServer) -> None:
    a, b = client(server, "key-a"), client(server, "key-b")
    file = a.files.create(file=("mine.jsonl", io.BytesIO(jsonl([line("x", CHAT)]))), purpose="batch")
    batch = a.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    assert file.id not in [f.id for f in b.files.list()]
    assert batch.id not in [x.id for x in b.batches.list()]
    for call in (
        lambda: b.files.retrieve(file.id),
        lambda: b.files.content(file.id),
        lambda: b.files.delete(file.id),
        lambda: b.batches.retrieve(batch.id),
        lambda: b.batches.cancel(batch.id),
        lambda: b.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h"),
    ):
        with pytest.raises(openai.NotFoundError):
            call()
    assert a.files.delete(file.id).deleted
    with pytest.raises(openai.NotFoundError):
        a.files.retrieve(file.id)
    with pytest.raises(openai.AuthenticationError):
        client(server, "wrong").files.list()


def test_uploads_are_capped(server: LiveServer) -> None:
    sdk = client(server)
    with pytest.raises(openai.APIStatusError) as caught:
        sdk.files.create(file=("big.jsonl", io.BytesIO(b"x" * (64 * 1024 + 1))), purpose="batch")
    assert caught.value.status_code == 413 and caught.value.body["code"] == "file_too_large"
    with pytest.raises(openai.BadRequestError):
        sdk.files.create(file=("f.jsonl", io.BytesIO(b"{}")), purpose="fine-tune")
    with pytest.raises(openai.BadRequestError):
        sdk.batches.create(input_file_id="file-x", endpoint="/v1/responses", completion_window="24h")
    b = client(server, "key-b")
    ids = [b.files.create(file=("f.jsonl", io.BytesIO(b"x" * 60 * 1024)), purpose="batch").id for _ in range(4)]
    with pytest.raises(openai.APIStatusError) as caught:
        b.files.create(file=("f.jsonl", io.BytesIO(b"x" * 60 * 1024)), purpose="batch")
    assert caught.value.status_code == 413 and caught.value.body["code"] == "storage_limit_exceeded"
    for file_id in ids:
        b.files.delete(file_id)


def test_cancel_keeps_what_finished(server: LiveServer) -> None:
    sdk = client(server)
    long = {**CHAT, "max_tokens": 64, "ignore_eos": True}
    file = sdk.files.create(
        file=("c.jsonl", io.BytesIO(jsonl([line(f"c{i}", long) for i in range(40)]))), purpose="batch"
    )
    batch = sdk.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
    deadline = time.monotonic() + 30
    while sdk.batches.retrieve(batch.id).request_counts.completed < 1 and time.monotonic() < deadline:
        time.sleep(0.02)
    assert sdk.batches.cancel(batch.id).status == "cancelling"
    batch = wait_done(sdk, batch.id)
    assert batch.status == "cancelled" and batch.cancelled_at is not None
    assert 1 <= batch.request_counts.completed < 40
    records = sdk.files.content(batch.output_file_id).text.splitlines()
    assert len(records) == batch.request_counts.completed
    with pytest.raises(openai.ConflictError):
        sdk.batches.cancel(batch.id)
    server.wait_idle()


def test_batch_lines_wait_for_online_requests_and_run_at_the_lowest_priority(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    from pagoda.serve.batches.runner import BATCH_PRIORITY

    priorities: list[int] = []
    add_request = server.llm.add_request

    async def recording(request, **kwargs):  # type: ignore[no-untyped-def]
        priorities.append(request.priority)
        return await add_request(request, **kwargs)

    monkeypatch.setattr(server.llm, "add_request", recording)
    admission = server.app.state.ctx.admission
    sdk = client(server)
    file = sdk.files.create(file=("w.jsonl", io.BytesIO(jsonl([line("w", CHAT)]))), purpose="batch")
    admission.queued_sequences += 5  # online requests waiting for their first token
    try:
        batch = sdk.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
        time.sleep(1.0)
        batch = sdk.batches.retrieve(batch.id)
        assert batch.status == "in_progress" and batch.request_counts.completed == 0 and priorities == []
    finally:
        admission.queued_sequences -= 5
    assert wait_done(sdk, batch.id).request_counts.completed == 1
    assert priorities == [BATCH_PRIORITY]


def test_lines_not_run_within_the_completion_window_expire(server: LiveServer) -> None:
    sdk = client(server)
    long = {**CHAT, "max_tokens": 64, "ignore_eos": True}
    file = sdk.files.create(
        file=("x.jsonl", io.BytesIO(jsonl([line(f"x{i}", long) for i in range(60)]))), purpose="batch"
    )
    batch = wait_done(
        sdk, sdk.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="1s").id
    )
    assert batch.status == "expired" and batch.expired_at is not None
    counts = batch.request_counts
    assert counts.total == 60 and counts.completed + counts.failed == 60 and counts.failed >= 1
    errors = [json.loads(t) for t in sdk.files.content(batch.error_file_id).text.splitlines()]
    assert errors[-1]["response"] is None and errors[-1]["error"]["code"] == "batch_expired"
    server.wait_idle()


def test_batch_priority_is_the_lowest_rank_the_key_may_ask_for() -> None:
    from pagoda.serve.admission.tenants import TenantLimits
    from pagoda.serve.batches.runner import BATCH_PRIORITY, batch_priority

    assert batch_priority(Tenant("t")) == BATCH_PRIORITY
    assert batch_priority(Tenant("t", TenantLimits(priority=3, priority_range=(0, 10)))) == 10
    assert batch_priority(Tenant("t", TenantLimits(priority=2 * BATCH_PRIORITY))) == 2 * BATCH_PRIORITY


def test_serve_keeps_batches_under_the_state_directory_by_default(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    from pagoda.serve.settings import ServerSettings

    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path))
    assert ServerSettings.default_batch_store() == str(tmp_path / "pagoda" / "batches.sqlite")
    with pytest.raises(ValueError, match="--batch-concurrency"):
        ServerSettings(batch_concurrency=0)
