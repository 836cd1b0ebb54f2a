"""Cancellation, overload, engine death, and the request log, over raw HTTP."""

from __future__ import annotations

import asyncio
import json
import logging
import random
import threading
from pathlib import Path
from typing import Any

import httpx
import pytest

from pagoda.config import EngineConfig
from pagoda.engine.llm_engine import LLMEngine
from pagoda.serve.admission.tenants import Tenant, TenantLimits, TenantRegistry
from pagoda.serve.observability.prompt_log import PromptLog, PromptLogQuery
from pagoda.serve.observability.request_log import LOGGER_NAME, RequestLogger, RequestLogRecord
from server_utils import MODEL_NAME, LiveServer, build_tiny_model, start_server

SECRET_PROMPT = "import os\nclass Config:"


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory):
    return build_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server(model_dir) -> LiveServer:
    live = start_server(model_dir)
    yield live
    live.stop()


def assert_idle(server: LiveServer) -> None:
    stats = server.wait_idle()
    assert stats.num_running == 0 and stats.num_waiting == 0
    assert stats.num_free_blocks == stats.num_total_blocks
    admission = server.app.state.ctx.admission
    assert admission.queued_sequences == 0 and admission.queued_tokens == 0


def test_cut_streams_free_everything(server: LiveServer) -> None:
    cut_streams_at_random(server)


def test_cut_streams_free_everything_engine_process(model_dir) -> None:
    live = start_server(model_dir, transport="process")
    try:
        cut_streams_at_random(live)
        test_non_streamed_disconnect_aborts(live)
    finally:
        live.stop()


def cut_streams_at_random(server: LiveServer) -> None:
    """50 streams cut at random points; afterwards nothing runs and every block is free."""
    rng = random.Random(0)

    async def one(client: httpx.AsyncClient, i: int) -> None:
        chat = i % 2 == 1
        body: dict[str, Any] = {
            "model": MODEL_NAME,
            "max_tokens": 400,
            "ignore_eos": True,
            "stream": True,
            "n": 1 + i % 3,
        }
        if chat:
            body["messages"] = [{"role": "user", "content": f"request {i}"}]
        else:
            body["prompt"] = f"request {i}: " + SECRET_PROMPT
        path = "/v1/chat/completions" if chat else "/v1/completions"
        lines_to_read = rng.randrange(0, 30)
        async with client.stream("POST", path, json=body) as response:
            assert response.status_code == 200
            read = 0
            async for _ in response.aiter_lines():
                read += 1
                if read >= lines_to_read:
                    break

    async def cut_early(client: httpx.AsyncClient, i: int) -> None:
        # Sometimes the client leaves before the response even starts.
        task = asyncio.ensure_future(one(client, i))
        await asyncio.sleep(rng.uniform(0, 0.05))
        task.cancel()
        try:
            await task
        except asyncio.CancelledError:
            pass

    async def main() -> None:
        limits = httpx.Limits(max_connections=100)
        async with httpx.AsyncClient(base_url=server.url, timeout=30, limits=limits) as client:
            await asyncio.gather(*(cut_early(client, i) if i % 5 == 0 else one(client, i) for i in range(50)))

    asyncio.run(main())
    assert_idle(server)
    metrics = httpx.get(server.url + "/metrics").text
    assert 'finished_reason="abort"' in metrics


def test_non_streamed_disconnect_aborts(server: LiveServer) -> None:
    body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 480, "ignore_eos": True, "n": 4}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base_url + "/completions", json=body, timeout=0.3)
    assert_idle(server)


def test_overload_rejects_instead_of_queueing(model_dir) -> None:
    tenants = TenantRegistry({"key-a": Tenant("a", TenantLimits(max_concurrent_requests=2)), "key-b": Tenant("b")})
    live = start_server(model_dir, engine={"max_num_seqs": 4}, tenants=tenants, max_queued_requests=4)
    try:

        async def one(client: httpx.AsyncClient, i: int) -> tuple[int, Any]:
            key = "key-a" if i % 2 else "key-b"
            await asyncio.sleep(i * 0.004)  # a flood, but spread enough for several admissions
            response = await client.post(
                "/v1/completions",
                headers={"Authorization": f"Bearer {key}"},
                json={"model": MODEL_NAME, "prompt": f"load {i}", "max_tokens": 24, "ignore_eos": True},
            )
            return response.status_code, response

        async def main() -> list[tuple[int, Any]]:
            limits = httpx.Limits(max_connections=200)
            async with httpx.AsyncClient(base_url=live.url, timeout=60, limits=limits) as client:
                return await asyncio.gather(*(one(client, i) for i in range(100)))

        results = asyncio.run(main())
        statuses = [status for status, _ in results]
        assert set(statuses) <= {200, 429, 503}, statuses
        assert statuses.count(200) >= 6 and statuses.count(503) > 0 and statuses.count(429) > 0
        for status, response in results:
            if status == 200:
                assert response.json()["usage"]["completion_tokens"] == 24
            else:
                assert int(response.headers["Retry-After"]) >= 1
                assert response.json()["error"]["message"]
        assert_idle(live)
        after = httpx.post(
            live.base_url + "/completions",
            timeout=10,
            headers={"Authorization": "Bearer key-b"},
            json={"model": MODEL_NAME, "prompt": "after", "max_tokens": 2},
        )
        assert after.status_code == 200
        metrics = httpx.get(live.url + "/metrics").text
        assert 'reason="overloaded"' in metrics and 'reason="rate_limited"' in metrics
    finally:
        live.stop()


def test_health_turns_503_when_the_engine_dies(model_dir) -> None:
    broken = threading.Event()

    def fragile_engine(config: EngineConfig) -> LLMEngine:
        engine = LLMEngine(config)
        step = engine.step

        def maybe_fail() -> list:
            if broken.is_set():
                raise RuntimeError("simulated engine failure")
            return step()

        engine.step = maybe_fail  # type: ignore[method-assign]
        return engine

    live = start_server(model_dir, engine_factory=fragile_engine)
    try:
        body = {"model": MODEL_NAME, "prompt": "x", "max_tokens": 2}
        assert httpx.post(live.base_url + "/completions", json=body).status_code == 200
        assert httpx.get(live.url + "/health").status_code == 200
        broken.set()
        dying = httpx.post(live.base_url + "/completions", json=body, timeout=10)
        assert dying.status_code == 503 and dying.json()["error"]["type"] == "server_error"
        health = httpx.get(live.url + "/health")
        assert health.status_code == 503
        after = httpx.post(live.base_url + "/completions", json={**body, "stream": True})
        assert after.status_code == 503
    finally:
        live.stop()


def test_one_log_line_per_request(server: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        ok = httpx.post(
            server.base_url + "/completions",
            json={"model": MODEL_NAME, "prompt": SECRET_PROMPT, "max_tokens": 3, "ignore_eos": True},
        )
        bad = httpx.post(
            server.base_url + "/completions", json={"model": MODEL_NAME, "prompt": SECRET_PROMPT, "temperature": -1}
        )
    assert ok.status_code == 200 and bad.status_code == 400
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == LOGGER_NAME]
    assert [line["status"] for line in lines] == [200, 400]
    first = lines[0]
    assert first["model"] == MODEL_NAME and first["tenant"] == "default"
    assert first["output_tokens"] == 3 and first["prompt_tokens"] > 0
    assert first["finish_reason"] == "length" and "cached_tokens" in first
    for key in ("queue_time_s", "ttft_s", "e2e_s"):
        assert first[key] >= 0
    assert all("import os" not in r.getMessage() for r in caplog.records)


def test_log_prompts_opt_in(caplog: pytest.LogCaptureFixture, tmp_path: Path) -> None:
    """Prompts and outputs never reach the request log; --log-prompts writes them to the
    separate prompt log."""
    record = RequestLogRecord(request_id="r", endpoint="completions", prompt=["secret"], output=["answer"])
    prompt_log = PromptLog(tmp_path)
    logger = RequestLogger()
    logger.add_listener(prompt_log.record)
    with caplog.at_level(logging.INFO, logger=LOGGER_NAME):
        logger.log(record)
    prompt_log.close()
    [quiet] = (json.loads(r.getMessage()) for r in caplog.records)
    assert "prompt" not in quiet and "output" not in quiet
    [loud] = prompt_log.read(PromptLogQuery())
    assert loud["prompt"] == ["secret"] and loud["output"] == ["answer"]
