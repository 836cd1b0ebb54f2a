"""Nothing one client sends stalls the event loop or holds the server: multi-megabyte /tokenize
and /detokenize bodies, large non-streamed answers, clients that send their headers a byte at a
time, and more connections than the server takes."""

from __future__ import annotations

import gc
import json
import socket
import threading
import time
from collections.abc import Callable
from contextlib import closing
from pathlib import Path
from typing import Any

import httpx
import pytest

import pagoda.serve.api.handler as handler
from server_utils import LiveServer, build_tiny_model, start_server


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_tiny_model(tmp_path_factory.mktemp("model"))


@pytest.fixture(scope="module")
def server(model_dir: Path) -> LiveServer:
    live = start_server(model_dir)
    yield live
    live.stop()


@pytest.fixture(scope="module", params=["h11", "httptools"])
def impatient_server(model_dir: Path, request: pytest.FixtureRequest) -> LiveServer:
    """Each HTTP parser the connection guards sit on."""
    if request.param == "httptools":
        pytest.importorskip("httptools", reason="httptools is not installed")
    live = start_server(
        model_dir, header_timeout=1.0, keep_alive_timeout=1.0, body_timeout=1.0, http_parser=request.param
    )
    yield live
    live.stop()


@pytest.fixture
def frozen_gc() -> None:
    """The heap as `pagoda serve` keeps it (launch.py): what startup built is out of the
    collector's sight, so a full collection walks only what requests create."""
    gc.collect()
    gc.freeze()
    yield
    gc.unfreeze()


@pytest.fixture(scope="module")
def long_context_server(tmp_path_factory: pytest.TempPathFactory) -> LiveServer:
    """A context so long that megabyte prompts are tokenized and answered whole."""
    model = build_tiny_model(tmp_path_factory.mktemp("long"))
    config = json.loads((model / "config.json").read_text())
    config["max_position_embeddings"] = 4_000_000
    (model / "config.json").write_text(json.dumps(config))
    live = start_server(model, max_request_bytes=16 * 2**20)
    yield live
    live.stop()


def health_latencies_while(url: str, work: Callable[[], Any], *, settle: float = 0.3) -> tuple[list[float], Any]:
    """/health latencies measured while `work` runs on another thread, and its result."""
    result: dict[str, Any] = {}

    def run() -> None:
        try:
            result["value"] = work()
        except BaseException as exc:  # reported below, on the test's thread
            result["error"] = exc

    worker = threading.Thread(target=run)
    latencies = []
    with httpx.Client(timeout=60) as client:
        client.get(url + "/health")
        worker.start()
        time.sleep(settle)
        while worker.is_alive():
            started = time.monotonic()
            assert client.get(url + "/health").status_code == 200
            latencies.append(time.monotonic() - started)
            time.sleep(0.02)
    worker.join()
    if "error" in result:
        raise result["error"]
    return latencies, result["value"]


def baseline_health(url: str) -> float:
    with httpx.Client(timeout=30) as client:
        samples = []
        for _ in range(10):
            started = time.monotonic()
            client.get(url + "/health")
            samples.append(time.monotonic() - started)
    return max(samples)


# ---- /tokenize and /detokenize ----------------------------------------------------------------


def test_megabyte_tokenize_leaves_health_answering(long_context_server: LiveServer) -> None:
    url = long_context_server.url
    baseline = baseline_health(url)
    prompt = "lorem ipsum dolor sit amet " * 40_000  # 1 MB

    def tokenize() -> dict[str, Any]:
        response = httpx.post(url + "/tokenize", timeout=120, json={"prompt": prompt, "return_token_strs": True})
        assert response.status_code == 200, response.text[:300]
        return response.json()

    latencies, body = health_latencies_while(url, tokenize)
    assert body["count"] == len(body["tokens"]) == len(body["token_strs"]) > 100_000
    assert "".join(body["token_strs"]).endswith("sit amet ")
    # Tokenized on the event loop, the request held /health for seconds.
    assert max(latencies, default=0) < 1.0 + baseline, (max(latencies), baseline)


def test_megabyte_detokenize_leaves_health_answering(long_context_server: LiveServer) -> None:
    url = long_context_server.url
    baseline = baseline_health(url)
    tokens = httpx.post(url + "/tokenize", timeout=60, json={"prompt": "def f(x): return x\n"}).json()["tokens"]
    many = tokens * (2_000_000 // len(tokens))

    def detokenize() -> str:
        response = httpx.post(url + "/detokenize", timeout=120, json={"tokens": many})
        assert response.status_code == 200, response.text[:300]
        return response.json()["prompt"]

    latencies, text = health_latencies_while(url, detokenize, settle=0.1)
    assert text.count("def f(x): return x") == len(many) // len(tokens)
    assert max(latencies, default=0) < 1.0 + baseline, (max(latencies), baseline)


def test_tokenize_refuses_a_prompt_provably_over_the_context_without_tokenizing(server: LiveServer) -> None:
    started = time.monotonic()
    response = httpx.post(
        server.url + "/tokenize", timeout=60, json={"prompt": "word " * 1_500_000, "return_token_strs": True}
    )  # 7.5 MB
    assert response.status_code == 400, response.text[:300]
    error = response.json()["error"]
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
    assert time.monotonic() - started < 5
    chat = httpx.post(
        server.url + "/tokenize", timeout=60, json={"messages": [{"role": "user", "content": "x " * 1_000_000}]}
    )
    assert chat.status_code == 400 and chat.json()["error"]["param"] == "messages"


def test_tokenize_answers_at_most_the_context(server: LiveServer) -> None:
    max_model_len = server.llm.max_model_len
    # Over the context once tokenized, though not provably so by its length alone.
    over = httpx.post(
        server.url + "/tokenize", timeout=60, json={"prompt": "word " * (2 * max_model_len), "return_token_strs": True}
    )
    assert over.status_code == 400, over.text[:300]
    error = over.json()["error"]
    assert (error["param"], error["code"]) == ("prompt", "context_length_exceeded")
    assert str(max_model_len) in error["message"]
    fits = httpx.post(
        server.url + "/tokenize", timeout=60, json={"prompt": "word " * (max_model_len // 4), "return_token_strs": True}
    ).json()
    assert fits["count"] <= max_model_len and len(fits["token_strs"]) == fits["count"]
    too_many = httpx.post(server.url + "/detokenize", timeout=60, json={"tokens": [5] * (max_model_len + 1)})
    assert too_many.status_code == 400 and too_many.json()["error"]["param"] == "tokens"


def test_tokenization_beyond_its_waiting_room_is_refused_with_503() -> None:
    import asyncio

    from starlette.responses import Response

    from pagoda.serve.api.tokenization import TokenizationEndpoints
    from pagoda.serve.errors import APIError

    endpoints = TokenizationEndpoints(ctx=None, max_concurrent=1, max_waiting=1)  # type: ignore[arg-type]

    def slow(_: object) -> Response:
        time.sleep(0.3)
        return Response(b"{}")

    async def three() -> list[Any]:
        return await asyncio.gather(*(endpoints.on_worker(slow, None) for _ in range(3)), return_exceptions=True)

    outcomes = asyncio.run(three())
    refused = [o for o in outcomes if isinstance(o, APIError)]
    assert len(refused) == 1 and refused[0].status == 503 and "Retry-After" in refused[0].headers
    assert sum(isinstance(o, Response) for o in outcomes) == 2


# ---- large non-streamed answers ----------------------------------------------------------------


def starlette_json(body: Any) -> bytes:
    """What JSONResponse writes for `body` (the path of small answers)."""
    return json.dumps(body, ensure_ascii=False, allow_nan=False, indent=None, separators=(",", ":")).encode("utf-8")


def without_ids(body: dict[str, Any]) -> dict[str, Any]:
    return {k: v for k, v in body.items() if k not in ("id", "created")}


@pytest.mark.parametrize(
    "path,body",
    [
        (
            "/v1/completions",
            {"prompt": "def main():", "n": 32, "logprobs": 20, "max_tokens": 96, "temperature": 0, "echo": True},
        ),
        (
            "/v1/chat/completions",
            {
                "messages": [{"role": "user", "content": "hi"}],
                "n": 32,
                "logprobs": True,
                "top_logprobs": 20,
                "max_tokens": 96,
                "temperature": 0,
            },
        ),
    ],
)
def test_large_answer_is_written_off_the_loop_as_the_small_path_writes_it(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch, frozen_gc: None, path: str, body: dict[str, Any]
) -> None:
    url = server.url
    baseline = baseline_health(url)

    def ask() -> httpx.Response:
        response = httpx.post(url + path, json=body, timeout=120)
        assert response.status_code == 200, response.text[:300]
        return response

    latencies, large = health_latencies_while(url, ask, settle=0.05)
    assert max(latencies, default=0) < 1.0 + baseline, (max(latencies), baseline)
    parsed = large.json()
    assert len(parsed["choices"]) == 32 and large.headers["content-type"] == "application/json"
    assert large.content == starlette_json(parsed)  # the very bytes JSONResponse writes
    with monkeypatch.context() as patch:  # the same answer through the small path
        patch.setattr(handler, "LARGE_ANSWER_CELLS", 10**12)
        small = ask()
    assert without_ids(small.json()) == without_ids(parsed)
    assert len(small.content) == len(large.content)


# ---- slow clients and connection floods --------------------------------------------------------


def host_port(server: LiveServer) -> tuple[str, int]:
    host, port = server.url.removeprefix("http://").split(":")
    return host, int(port)


def read_until_closed(sock: socket.socket, timeout: float) -> tuple[bytes, float]:
    """Everything the server sends until it closes the connection, and when that was."""
    sock.settimeout(timeout)
    received = b""
    try:
        while chunk := sock.recv(65536):
            received += chunk
    except ConnectionResetError:
        pass
    return received, time.monotonic()


def test_headers_sent_a_byte_at_a_time_are_cut_off(impatient_server: LiveServer) -> None:
    request = b"GET /health HTTP/1.1\r\nHost: localhost\r\nUser-Agent: slow\r\n\r\n"
    with closing(socket.create_connection(host_port(impatient_server), timeout=10)) as sock:
        started = time.monotonic()
        closed_at = None
        for byte in request:
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                closed_at = time.monotonic()
                break
            time.sleep(0.5)
            sock.setblocking(False)
            try:
                if sock.recv(65536) == b"":
                    closed_at = time.monotonic()
                    break
            except BlockingIOError:
                pass
            except ConnectionResetError:
                closed_at = time.monotonic()
                break
            finally:
                sock.setblocking(True)
        assert closed_at is not None, "served a request whose headers took 30 s"
        assert closed_at - started < 10  # header timeout 1 s; the whole head would take 30 s


def test_a_body_sent_a_byte_at_a_time_gets_408(impatient_server: LiveServer) -> None:
    body = json.dumps({"model": "m", "prompt": "hello", "max_tokens": 1}).encode()
    head = (
        b"POST /v1/completions HTTP/1.1\r\nHost: localhost\r\ncontent-type: application/json\r\n"
        b"content-length: " + str(len(body)).encode() + b"\r\n\r\n"
    )
    with closing(socket.create_connection(host_port(impatient_server), timeout=10)) as sock:
        sock.sendall(head)
        started = time.monotonic()
        answer = b""
        sock.settimeout(0.3)
        for byte in body:  # the whole body would take ~20 s; the deadline is 1 s
            try:
                sock.sendall(bytes([byte]))
                answer += sock.recv(65536)
            except TimeoutError:
                continue
            except (BrokenPipeError, ConnectionResetError):
                break
            if answer:
                break
        if not answer:
            answer, _ = read_until_closed(sock, timeout=10)
    assert time.monotonic() - started < 10
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "request_timeout"


def test_idle_connections_are_closed_unserved(impatient_server: LiveServer) -> None:
    with closing(socket.create_connection(host_port(impatient_server), timeout=10)) as silent:
        received, closed_at = read_until_closed(silent, timeout=15)
        assert received == b""  # closed after the header timeout, never answered
    with closing(socket.create_connection(host_port(impatient_server), timeout=10)) as kept_alive:
        kept_alive.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\n\r\n")
        received, _ = read_until_closed(kept_alive, timeout=15)  # closed after the keep-alive timeout
        assert received.startswith(b"HTTP/1.1 200")


@pytest.mark.parametrize("parser", ["h11", "httptools"])
def test_connections_beyond_the_cap_are_refused(model_dir: Path, parser: str) -> None:
    if parser == "httptools":
        pytest.importorskip("httptools", reason="httptools is not installed")
    live = start_server(model_dir, max_connections=4, header_timeout=60.0, http_parser=parser)
    try:
        address = host_port(live)
        held = [socket.create_connection(address, timeout=10) for _ in range(4)]
        try:
            time.sleep(0.5)  # accepted by the server
            with closing(socket.create_connection(address, timeout=10)) as extra:
                received, _ = read_until_closed(extra, timeout=10)
            assert received == b"" or received.startswith(b"HTTP/1.1 503"), received[:200]
            if received:
                assert json.loads(received.split(b"\r\n\r\n", 1)[1])["error"]["code"] == "too_many_connections"
            for sock in held:  # the held ones are still served
                sock.sendall(b"GET /health HTTP/1.1\r\nHost: localhost\r\nConnection: close\r\n\r\n")
                answer, _ = read_until_closed(sock, timeout=10)
                assert answer.startswith(b"HTTP/1.1 200"), answer[:200]
        finally:
            for sock in held:
                sock.close()
        deadline = time.monotonic() + 10
        while True:
            try:
                assert httpx.get(live.url + "/health", timeout=10).status_code == 200
                break
            except httpx.TransportError:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.1)
    finally:
        live.stop()
