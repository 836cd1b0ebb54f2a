"""Stopping like a server: the first SIGINT/SIGTERM drains (new requests get 503, running ones
finish) within --shutdown-timeout; a second one exits at once; no traceback; one start banner;
the engine process never outlives the server."""

from __future__ import annotations

import asyncio
import os
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import uvicorn

from pagoda.serve.drain import DrainGate, DrainingServer
from server_utils import build_tiny_model, free_port, start_serve_process

# ---- the drain itself, in process (signals are simulated by calling the handler) -----------


async def slow_app(scope: dict, receive, send) -> None:
    """A request that takes 1.5 s, like a long generation."""
    await asyncio.sleep(1.5 if scope["path"] == "/slow" else 0)
    await send({"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]})
    await send({"type": "http.response.body", "body": b"done"})


def serve_in_thread(shutdown_timeout: float) -> tuple[DrainingServer, threading.Thread, str, list[bool]]:
    gate = DrainGate(slow_app)
    forced: list[bool] = []
    server = DrainingServer(
        uvicorn.Config(gate, host="127.0.0.1", port=0, log_level="warning", lifespan="off"),
        gate,
        shutdown_timeout,
        on_force_exit=lambda: forced.append(True),
    )
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    while not server.started:
        time.sleep(0.01)
    return server, thread, f"http://127.0.0.1:{server.servers[0].sockets[0].getsockname()[1]}", forced


def test_first_signal_drains_running_requests_and_refuses_new_ones() -> None:
    server, thread, url, forced = serve_in_thread(shutdown_timeout=30)
    result: dict[str, httpx.Response] = {}
    slow = threading.Thread(target=lambda: result.update(slow=httpx.get(url + "/slow", timeout=30)))
    slow.start()
    time.sleep(0.3)
    assert server.gate.in_flight == 1
    server.handle_exit(signal.SIGTERM, None)
    refused = httpx.get(url + "/fast", timeout=5)
    assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
    assert refused.headers["retry-after"] == "5"
    assert not server.should_exit  # still draining
    slow.join(10)
    assert result["slow"].status_code == 200 and result["slow"].text == "done"
    thread.join(10)
    assert not thread.is_alive() and not forced


def test_drain_is_bounded_and_a_second_signal_forces_the_exit() -> None:
    server, thread, url, forced = serve_in_thread(shutdown_timeout=0.2)
    slow = threading.Thread(target=lambda: httpx.get(url + "/slow", timeout=30), daemon=True)
    slow.start()
    time.sleep(0.3)
    started = time.monotonic()
    server.handle_exit(signal.SIGINT, None)
    time.sleep(0.1)
    server.handle_exit(signal.SIGINT, None)
    assert forced == [True] and server.force_exit
    thread.join(10)
    assert not thread.is_alive() and time.monotonic() - started < 1.4  # before the slow request ends


# ---- `pagoda serve` in a subprocess ----------------------------------------------------------


def start(model: Path, port: int, *extra: str) -> subprocess.Popen:
    return start_serve_process(model, port, "--num-kv-blocks", "64", "--log-level", "info", *extra)


def engine_children(pid: int) -> list[int]:
    found = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
            except OSError:
                continue
            if int(fields[1]) == pid and fields[0] != "Z":
                found.append(int(entry.name))
    return found


def wait_gone(pids: list[int], timeout: float = 10) -> None:
    deadline = time.monotonic() + timeout
    for pid in pids:
        while Path(f"/proc/{pid}").exists() and "Z" not in Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1][:3]:
            assert time.monotonic() < deadline, f"process {pid} outlived the server"
            time.sleep(0.1)


def test_serve_banner_sigterm_and_ctrl_c_twice(tmp_path: Path) -> None:
    model = build_tiny_model(tmp_path / "model")
    port = free_port()
    process = start(model, port, "--shutdown-timeout", "30")
    engines = engine_children(process.pid)
    assert engines, "the engine runs in its own process by default"
    try:
        process.send_signal(signal.SIGTERM)  # nothing in flight: exits promptly
        process.wait(30)
    finally:
        if process.poll() is None:
            process.kill()
    output = process.stdout.read()
    assert process.returncode == 0 and "Traceback" not in output, output
    assert output.count("pagoda serve is ready") == 1
    for line in ("model", "device", "context", "KV pool", "features", "listening"):
        assert f"\n  {line}" in output
    wait_gone(engines)

    port = free_port()
    process = start(model, port, "--shutdown-timeout", "60")
    engines = engine_children(process.pid)
    url = f"http://127.0.0.1:{port}"
    threading.Thread(
        target=lambda: httpx.post(
            url + "/v1/completions",
            timeout=120,
            json={"prompt": "hello", "max_tokens": 400, "n": 16, "ignore_eos": True},
        ),
        daemon=True,
    ).start()
    try:
        time.sleep(0.5)
        os.killpg(process.pid, signal.SIGINT)
        time.sleep(0.2)
        started = time.monotonic()
        os.killpg(process.pid, signal.SIGINT)
        process.wait(20)
        assert time.monotonic() - started < 15  # not the 60 s drain
    finally:
        if process.poll() is None:
            process.kill()
    output = process.stdout.read()
    assert "Traceback" not in output, output
    wait_gone(engines)


def test_ctrl_c_to_the_process_group_lets_a_running_stream_finish(tmp_path: Path) -> None:
    """Ctrl-C in a terminal signals the engine process too: it must keep serving the drain."""
    model = build_tiny_model(tmp_path / "model")
    port = free_port()
    # n=4 needs four seats: more than the default --max-num-seqs of a 64-block pool (two full contexts).
    process = start(model, port, "--shutdown-timeout", "60", "--max-num-seqs", "4")
    url = f"http://127.0.0.1:{port}"
    try:
        with httpx.stream(
            "POST",
            url + "/v1/completions",
            timeout=120,
            json={
                "prompt": "hello",
                "max_tokens": 300,
                "n": 4,
                "ignore_eos": True,
                "stream": True,
                "stream_options": {"include_usage": True},
            },
        ) as response:
            lines = response.iter_lines()
            first = next(line for line in lines if line.startswith("data: "))
            assert '"text"' in first
            os.killpg(process.pid, signal.SIGINT)  # the request is in flight
            rest = [line for line in lines if line.startswith("data: ")]
        assert rest[-1] == "data: [DONE]"
        assert '"completion_tokens":1200' in rest[-2]  # all 4 x 300 tokens: drained, not cut
        process.wait(30)
    finally:
        if process.poll() is None:
            process.kill()
    output = process.stdout.read()
    assert process.returncode == 0 and "Traceback" not in output, output
