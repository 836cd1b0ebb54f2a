"""Self-healing engines through the real server, with real faults (SIGKILL of an engine process):
the dead engine is reaped, its streams end with engine_dead (logged and counted as a server
error), it is restarted with backoff and rejoins the router, /health and /metrics show it, and
past --max-replica-restarts it stays down and says why. A single engine is restarted the same
way, and with --no-restart `pagoda serve` exits non-zero."""

from __future__ import annotations

import asyncio
import json
import logging
import os
import signal
import time
from pathlib import Path
from typing import Any

import httpx
import pytest
from prometheus_client.parser import text_string_to_metric_families

from pagoda.http_client.sse import aiter_sse_events, iter_sse_events
from pagoda.replicas.replica_set import ReplicaSet
from pagoda.serve.observability.request_log import LOGGER_NAME
from server_utils import MODEL_NAME, LiveServer, build_tiny_model, free_port, start_serve_process, start_server

TIMEOUT_S = 60


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("supervision") / "model")


@pytest.fixture(scope="module")
def server(model: Path) -> LiveServer:
    live = start_server(
        model,
        transport="process",
        engine={"max_num_seqs": 4},
        deployment={
            "data_parallel_size": 2,
            "router": "round_robin",
            "replica_restart_backoff": 0.2,
            "max_replica_restarts": 1,
        },
    )
    yield live
    live.stop()


def replica_set(server: LiveServer) -> ReplicaSet:
    assert isinstance(server.llm, ReplicaSet)
    return server.llm


def health(url: str) -> httpx.Response:
    return httpx.get(url + "/health", timeout=10)


def wait_for(condition: Any, what: str, timeout: float = TIMEOUT_S) -> Any:
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def reaped(pid: int) -> bool:
    """Gone from the process table: not running, and no zombie left either."""
    return not Path(f"/proc/{pid}").exists()


def metric_samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url + "/metrics", timeout=10).text
    return {
        (s.name, tuple(sorted((k, v) for k, v in s.labels.items() if k != "model_name"))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def wait_idle(server: LiveServer) -> None:
    """Every live replica idle with every KV block free, and the router's accounts at zero."""

    def idle() -> bool:
        live = [r for r in replica_set(server).replicas if r.is_alive]
        return all(
            s.num_running == s.num_waiting == 0
            and s.num_free_blocks == s.num_total_blocks
            and r.outstanding_tokens == 0
            and r.num_requests == 0
            for r in live
            for s in [r.llm.get_stats()]
        )

    wait_for(idle, "idle replicas with every KV block free", timeout=15)


async def stream_until_killed(server: LiveServer, victim_pid: int, num_streams: int) -> list[list[dict]]:
    """Start `num_streams` streams, SIGKILL `victim_pid` once each has produced a token, and
    return every stream's events."""
    started = [asyncio.Event() for _ in range(num_streams)]

    async def one(client: httpx.AsyncClient, i: int) -> list[dict]:
        events: list[dict] = []
        async with client.stream(
            "POST",
            "/completions",
            json={
                "model": MODEL_NAME,
                "prompt": f"stream {i} says",
                "max_tokens": 400,
                "temperature": 0,
                "ignore_eos": True,
                "stream": True,
            },
        ) as response:
            assert response.status_code == 200
            async for event in aiter_sse_events(response.aiter_lines()):
                if event.done:
                    break
                events.append(event.json())
                started[i].set()
        return events

    async with httpx.AsyncClient(base_url=server.base_url, timeout=TIMEOUT_S) as client:
        tasks = [asyncio.ensure_future(one(client, i)) for i in range(num_streams)]
        await asyncio.wait_for(asyncio.gather(*(e.wait() for e in started)), TIMEOUT_S)
        os.kill(victim_pid, signal.SIGKILL)
        return await asyncio.gather(*tasks)


def test_a_killed_replica_is_reaped_restarted_and_rejoins(server: LiveServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER_NAME)
    replicas = replica_set(server)
    victim = replicas.replicas[1]
    old_pid = victim.llm.engine_pid
    assert old_pid is not None and old_pid != os.getpid()

    streams = asyncio.run(stream_until_killed(server, old_pid, num_streams=4))
    failed = [events for events in streams if "error" in events[-1]]
    # Round robin put two streams on each replica; the two on the killed one end mid-stream.
    assert len(failed) == 2, [events[-1] for events in streams]
    assert all(events[-1]["error"]["code"] == "engine_dead" for events in failed)
    assert all(events[-1]["choices"][0]["finish_reason"] == "length" for events in streams if events not in failed)

    # Reaped (no zombie), and the exit is known.
    wait_for(lambda: reaped(old_pid), f"engine {old_pid} reaped", timeout=15)
    with pytest.raises(ChildProcessError):
        os.waitpid(old_pid, os.WNOHANG)

    # Logged and counted as server errors, not as client disconnects or successes.
    lines = [json.loads(r.getMessage()) for r in caplog.records if r.name == LOGGER_NAME]
    errors = [line for line in lines if line.get("error_code") == "engine_dead"]
    assert len(errors) == 2, lines
    assert all(line["status"] == 503 and line["finish_reason"] == "engine_dead" for line in errors)
    assert not [line for line in lines if line["status"] == 499]

    # Back: the same label, a new pid, one restart; in rotation again.
    def restarted() -> dict | None:
        body = health(server.url).json()
        entry = body["replicas"][1]
        return body if entry["alive"] and entry["pid"] != old_pid else None

    body = wait_for(restarted, "replica 1 restarted")
    assert body["status"] == "ok"
    entry = body["replicas"][1]
    assert (entry["replica"], entry["status"], entry["restarts"]) == ("1", "ok", 1)
    assert entry["pid"] == victim.llm.engine_pid and "error" not in entry
    routed_before = victim.num_routed
    for i in range(2):
        response = httpx.post(
            server.base_url + "/completions",
            timeout=TIMEOUT_S,
            json={"model": MODEL_NAME, "prompt": f"after the restart {i}", "max_tokens": 4},
        )
        assert response.status_code == 200
    assert victim.num_routed == routed_before + 1  # round robin reached the restarted replica
    wait_idle(server)

    samples = metric_samples(server.url)
    assert samples[("pagoda:replica_restarts_total", (("replica", "1"),))] == 1
    assert samples[("pagoda:replica_restarts_total", (("replica", "0"),))] == 0
    assert samples[("pagoda:replica_up", (("replica", "1"),))] == 1
    assert samples[("pagoda:request_rejected_total", (("reason", "engine_dead"),))] == 2
    assert ("pagoda:request_success_total", (("finished_reason", "abort"),)) not in samples


def test_past_its_restart_budget_a_replica_stays_down_and_says_why(server: LiveServer) -> None:
    """Runs after the restart above: --max-replica-restarts 1 is spent, so a second death is final."""
    victim = replica_set(server).replicas[1]
    pid = victim.llm.engine_pid
    os.kill(pid, signal.SIGKILL)

    def failed() -> dict | None:
        body = health(server.url).json()
        return body if body["replicas"][1]["status"] == "failed" else None

    body = wait_for(failed, "replica 1 given up")
    entry = body["replicas"][1]
    assert body["status"] == "degraded" and not entry["alive"] and entry["restarts"] == 1
    assert "--max-replica-restarts" in entry["error"] and "SIGKILL" in entry["error"]
    wait_for(lambda: reaped(pid), f"engine {pid} reaped", timeout=15)
    assert health(server.url).status_code == 200
    # Still serving on the replica left.
    response = httpx.post(
        server.base_url + "/completions",
        timeout=TIMEOUT_S,
        json={"model": MODEL_NAME, "prompt": "one replica left", "max_tokens": 4},
    )
    assert response.status_code == 200
    assert metric_samples(server.url)[("pagoda:replica_up", (("replica", "1"),))] == 0
    wait_idle(server)


# ---- a single engine, in `pagoda serve` --------------------------------------------------------


def engine_state(url: str) -> tuple[int, dict]:
    response = health(url)
    return response.status_code, response.json()


def test_a_single_engine_is_restarted(model: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start_serve_process(model, port, "--num-kv-blocks", "64", "--replica-restart-backoff", "0.1")
    try:
        status, body = engine_state(url)
        assert status == 200 and body["status"] == "ok" and body["restarts"] == 0
        old_pid = body["pid"]
        os.kill(old_pid, signal.SIGKILL)
        seen: list[tuple[int, str]] = []

        def restarted() -> dict | None:
            status, body = engine_state(url)
            seen.append((status, body["status"]))
            return body if body["status"] == "ok" and body["pid"] != old_pid else None

        body = wait_for(restarted, "the engine restarted")
        assert body["restarts"] == 1 and body["alive"]
        # Down while it restarted: 503, saying so.
        assert (503, "restarting") in seen, seen
        assert not Path(f"/proc/{old_pid}").exists()  # reaped by the server
        response = httpx.post(
            url + "/v1/completions", timeout=TIMEOUT_S, json={"prompt": "back again", "max_tokens": 4}
        )
        assert response.status_code == 200
        assert 'pagoda:replica_restarts_total{model_name="model"} 1.0' in httpx.get(url + "/metrics").text
    finally:
        process.terminate()
        process.wait(30)


def test_without_restarts_a_dead_engine_ends_the_server_non_zero(model: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    process = start_serve_process(model, port, "--num-kv-blocks", "64", "--no-restart")
    events = []
    try:
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            timeout=TIMEOUT_S,
            json={"prompt": "in flight", "max_tokens": 400, "ignore_eos": True, "stream": True},
        ) as response:
            for event in iter_sse_events(response.iter_lines()):
                if event.done:
                    break
                events.append(event.json())
                if len(events) == 1:  # mid-stream
                    os.kill(engine_state(url)[1]["pid"], signal.SIGKILL)
        process.wait(TIMEOUT_S)
    finally:
        if process.poll() is None:
            process.kill()
    assert events[-1]["error"]["code"] == "engine_dead"  # failed before the server went
    output = process.stdout.read()
    assert process.returncode not in (0, None), output
    assert "--no-restart" in output.splitlines()[-1] and "SIGKILL" in output.splitlines()[-1], output
    assert "Traceback" not in output
