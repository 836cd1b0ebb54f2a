"""A batch survives the server: `pagoda serve` killed mid-batch (SIGKILL, no shutdown) and a
server started again on the same --batch-store runs only the lines without a result and keeps
the others. (The second server runs in this process: it starts in a fraction of the time.)"""

from __future__ import annotations

import io
import json
import os
import signal
import sqlite3
import time
from pathlib import Path

import openai
import pytest

from server_utils import build_tiny_model, free_port, start_serve_process, start_server

LINES = 12


def wait_for(condition, timeout: float = 60):  # type: ignore[no-untyped-def]
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.02)
    pytest.fail("timed out")


def stored_results(store: Path) -> dict[str, dict]:
    with sqlite3.connect(store) as db:
        return {
            json.loads(record)["custom_id"]: json.loads(record)
            for (record,) in db.execute("SELECT record FROM results")
        }


def test_a_killed_server_resumes_its_batch_where_it_stopped(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "model")
    store = tmp_path / "state" / "batches.sqlite"
    flags = (
        "--batch-store",
        str(store),
        "--batch-concurrency",
        "1",
        "--engine-transport",
        "thread",
        "--num-kv-blocks",
        "64",
    )
    port = free_port()
    process = start_serve_process(model, port, *flags)
    try:
        sdk = openai.OpenAI(base_url=f"http://127.0.0.1:{port}/v1", api_key="none", max_retries=0, timeout=30)
        body = {"messages": [{"role": "user", "content": "go"}], "max_tokens": 32, "ignore_eos": True, "temperature": 0}
        content = "".join(
            json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions", "body": body}) + "\n"
            for i in range(LINES)
        ).encode()
        file = sdk.files.create(file=("in.jsonl", io.BytesIO(content)), purpose="batch")
        batch = sdk.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions", completion_window="24h")
        wait_for(lambda: sdk.batches.retrieve(batch.id).request_counts.completed >= 3)
    finally:
        os.killpg(process.pid, signal.SIGKILL)
        process.wait(30)
    before = stored_results(store)
    assert 3 <= len(before) < LINES  # killed mid-batch
    server = start_server(model, batch_store=str(store), batch_concurrency=4)
    try:
        sdk = openai.OpenAI(base_url=server.base_url, api_key="none", max_retries=0, timeout=30)
        done = wait_for(lambda: (b := sdk.batches.retrieve(batch.id)).status == "completed" and b)
        counts = done.request_counts
        assert (counts.total, counts.completed, counts.failed) == (LINES, LINES, 0)
        records = {r["custom_id"]: r for r in map(json.loads, sdk.files.content(done.output_file_id).text.splitlines())}
        assert sorted(records) == sorted(f"r{i}" for i in range(LINES))
        for custom_id, record in before.items():  # not run again: the same answer, request id and all
            assert records[custom_id] == record
        assert all(r["response"]["status_code"] == 200 for r in records.values())
    finally:
        server.stop()
