"""Starting a server process and waiting for its /health: the helper behind the benchmarks',
the tests' and the gate's launched servers."""

from __future__ import annotations

import sys
import textwrap
from pathlib import Path

import httpx
import pytest

from pagoda.http_client.server_process import ServerStartError, free_port, running_server, start_server

# A /health that answers 503 twice, then 200.
SERVER = textwrap.dedent("""
    import sys
    from http.server import BaseHTTPRequestHandler, HTTPServer

    class Health(BaseHTTPRequestHandler):
        asked = 0

        def do_GET(self):
            Health.asked += 1
            self.send_response(200 if Health.asked > 2 else 503)
            self.end_headers()

        def log_message(self, *args):
            pass

    print("listening", flush=True)
    HTTPServer(("127.0.0.1", int(sys.argv[1])), Health).serve_forever()
""")


def test_waits_for_a_200_and_stops_the_server_afterwards(tmp_path: Path) -> None:
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    with running_server(
        [sys.executable, "-c", SERVER, str(port)], url + "/health", timeout=30, log_path=tmp_path / "server.log"
    ) as process:
        assert httpx.get(url + "/health", trust_env=False).status_code == 200
    assert process.poll() is not None
    assert "listening" in (tmp_path / "server.log").read_text()


def test_a_server_that_exits_fails_with_its_output() -> None:
    command = [sys.executable, "-c", "print('no model here'); raise SystemExit(3)"]
    with pytest.raises(ServerStartError, match=r"(?s)toy exited with 3:.*no model here"):
        start_server(command, f"http://127.0.0.1:{free_port()}/health", timeout=30, name="toy")


def test_a_server_that_never_answers_is_stopped_after_the_timeout(tmp_path: Path) -> None:
    command = [sys.executable, "-c", "import time; print('loading', flush=True); time.sleep(60)"]
    with pytest.raises(ServerStartError, match=r"(?s)did not answer 200 .* within 1s:.*loading"):
        start_server(command, f"http://127.0.0.1:{free_port()}/health", timeout=1, log_path=tmp_path / "server.log")
