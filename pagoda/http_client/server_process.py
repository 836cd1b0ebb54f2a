"""A server in a child process: start it, wait until its /health answers, stop it.

The benchmarks, the tests and the gate's `pagoda:ARGS` sides all start servers this way, so a
server that dies while loading or never gets healthy fails the same way everywhere: stopped,
with the tail of its log in the error.
"""

from __future__ import annotations

import contextlib
import socket
import subprocess
import time
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path

import httpx

LOG_TAIL_CHARS = 3000


class ServerStartError(RuntimeError):
    """The server exited before it was healthy, or was not healthy in time; the message ends
    with the tail of its log."""


def free_port() -> int:
    """A TCP port on the loopback interface that nothing listens on right now."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def start_server(
    command: Sequence[str],
    health_url: str,
    *,
    timeout: float,
    log_path: Path | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    start_new_session: bool = False,
    name: str = "the server",
) -> subprocess.Popen:
    """Run `command` and return its process once GET `health_url` answers 200.

    stdout and stderr go together to `log_path` (overwritten), or, without one, to a text pipe
    the caller reads as `process.stdout`. If the process exits first or `timeout` seconds pass,
    it is stopped and ServerStartError names `name` and ends with the log's tail.
    """
    process: subprocess.Popen  # of text (the pipe) or of bytes (the log file)
    if log_path is None:
        process = subprocess.Popen(
            list(command),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            env=env,
            cwd=cwd,
            start_new_session=start_new_session,
        )
    else:
        log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(log_path, "w") as log:
            process = subprocess.Popen(
                list(command),
                stdout=log,
                stderr=subprocess.STDOUT,
                env=env,
                cwd=cwd,
                start_new_session=start_new_session,
            )
    deadline = time.monotonic() + timeout
    with httpx.Client(timeout=1.0, trust_env=False) as client:
        while True:
            if process.poll() is not None:
                problem = f"{name} exited with {process.returncode}"
                break
            with contextlib.suppress(httpx.HTTPError):
                if client.get(health_url).status_code == 200:
                    return process
            if time.monotonic() > deadline:
                problem = f"{name} did not answer 200 on {health_url} within {timeout:.0f}s"
                break
            time.sleep(0.2)
    stop_server(process)
    raise ServerStartError(f"{problem}:\n{_log_tail(process, log_path)}")


def stop_server(process: subprocess.Popen, grace_s: float = 20.0) -> None:
    """SIGTERM, then SIGKILL if it is still running after `grace_s` seconds."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace_s)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait()


@contextlib.contextmanager
def running_server(
    command: Sequence[str],
    health_url: str,
    *,
    timeout: float,
    log_path: Path | None = None,
    env: Mapping[str, str] | None = None,
    cwd: Path | None = None,
    name: str = "the server",
) -> Iterator[subprocess.Popen]:
    """`start_server`, stopped when the block ends."""
    process = start_server(command, health_url, timeout=timeout, log_path=log_path, env=env, cwd=cwd, name=name)
    try:
        yield process
    finally:
        stop_server(process)


def _log_tail(process: subprocess.Popen, log_path: Path | None) -> str:
    """The end of what a stopped server wrote."""
    try:
        if log_path is not None:
            text = log_path.read_text(errors="replace")
        else:
            text = process.stdout.read() if process.stdout is not None else ""
    except (OSError, ValueError):
        return ""
    return text[-LOG_TAIL_CHARS:]
