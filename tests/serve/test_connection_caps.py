"""A request head past --max-header-bytes gets 431 (on either HTTP parser) before the server holds
more of it, and one client address cannot hold more than --max-connections-per-client."""

from __future__ import annotations

import json
import socket
import time
from contextlib import closing
from pathlib import Path

import httpx
import pytest

from server_utils import build_tiny_model, start_server


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model"))


def read_all(sock: socket.socket, timeout: float = 10) -> bytes:
    sock.settimeout(timeout)
    chunks = []
    while True:
        try:
            chunk = sock.recv(65536)
        except (TimeoutError, ConnectionResetError):
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks)


@pytest.mark.parametrize("parser", ["h11", "httptools"])
def test_an_oversized_head_is_a_431_and_others_are_served(model_dir: Path, parser: str) -> None:
    if parser == "httptools":
        pytest.importorskip("httptools", reason="httptools is not installed")
    live = start_server(model_dir, http_parser=parser, max_header_bytes=32 * 1024)
    try:
        address = ("127.0.0.1", int(live.url.rsplit(":", 1)[1]))
        with closing(socket.create_connection(address, timeout=10)) as sock:
            sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nX-Big: ")
            try:
                for _ in range(64):  # 4 MB of one header, as long as the server reads
                    sock.sendall(b"a" * 65536)
            except (BrokenPipeError, ConnectionResetError):
                pass
            answer = read_all(sock)
        assert answer.startswith(b"HTTP/1.1 431"), answer[:200]
        assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_header_too_large"
        # A head just under the cap, and a body far larger than it, are fine.
        ok = httpx.get(live.url + "/health", headers={"X-Fits": "b" * 30000}, timeout=30)
        assert ok.status_code == 200
        big_body = httpx.post(live.url + "/tokenize", json={"model": "tiny-llama", "prompt": "x " * 40000}, timeout=60)
        assert big_body.json()["error"]["code"] == "context_length_exceeded"  # read whole, then judged
    finally:
        live.stop()


def test_one_client_cannot_hold_every_connection(model_dir: Path) -> None:
    live = start_server(model_dir, max_connections=16, max_connections_per_client=3, header_timeout=60.0)
    try:
        address = ("127.0.0.1", int(live.url.rsplit(":", 1)[1]))
        held = [socket.create_connection(address, timeout=10) for _ in range(3)]
        try:
            time.sleep(0.5)
            with closing(socket.create_connection(address, timeout=10)) as extra:
                refused = read_all(extra)
            assert refused.startswith(b"HTTP/1.1 503"), refused[:200]
            assert json.loads(refused.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "too_many_client_connections"
        finally:
            for sock in held:
                sock.close()
        deadline = time.monotonic() + 10
        while True:  # the address's count drops as its connections close
            try:
                if httpx.get(live.url + "/health", timeout=5).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            assert time.monotonic() < deadline
            time.sleep(0.1)
    finally:
        live.stop()
