"""Where a gate side or an audit points: a running server's base URL, or a pagoda the tool
launches itself (`pagoda:ARGS`, e.g. `pagoda:--model /m --speculative ngram`) on a free
loopback port, stopped when the tool ends."""

from __future__ import annotations

import contextlib
import os
import shlex
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from pagoda.http_client.server_process import ServerStartError, free_port, start_server, stop_server

LAUNCH_PREFIX = "pagoda:"


class TargetError(RuntimeError):
    """A side could not be reached or launched; the message says which and why."""


@dataclass
class Target:
    """One OpenAI-compatible server: base URL (without /v1), model name, API key."""

    base_url: str
    model: str | None = None
    api_key: str | None = None
    label: str = "server"
    launch_args: list[str] | None = None  # set when the tool launched it

    def __post_init__(self) -> None:
        base = self.base_url.rstrip("/")
        self.base_url = base[: -len("/v1")] if base.endswith("/v1") else base

    def headers(self, api_key: str | None = None) -> dict[str, str]:
        key = api_key if api_key is not None else self.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    def url(self, path: str) -> str:
        return self.base_url + path

    def describe(self) -> dict[str, Any]:
        info: dict[str, Any] = {"base_url": self.base_url, "model": self.model}
        if self.launch_args is not None:
            info["launched"] = "pagoda serve " + shlex.join(self.launch_args)
        return info


def resolve_model(client: httpx.Client, target: Target) -> str:
    """The target's model name: the one given, else the first of GET /v1/models."""
    if target.model:
        return target.model
    try:
        response = client.get(target.url("/v1/models"), headers=target.headers())
    except httpx.HTTPError as exc:
        raise TargetError(f"{target.label}: cannot reach {target.base_url} ({exc})") from None
    if response.status_code != 200:
        raise TargetError(
            f"{target.label}: GET /v1/models answered {response.status_code}; give the model name explicitly"
        )
    models = response.json().get("data") or []
    if not models:
        raise TargetError(f"{target.label}: the server lists no models")
    target.model = str(models[0]["id"])
    return target.model


@dataclass
class LaunchedServer:
    """A `pagoda serve` child process on a loopback port; `stop` ends it."""

    process: subprocess.Popen
    target: Target
    log_path: Path

    def stop(self) -> None:
        stop_server(self.process)


def launch_pagoda(args: list[str], label: str, *, api_key: str | None = None, timeout: float = 300.0) -> LaunchedServer:
    """Start `pagoda serve ARGS --host 127.0.0.1 --port FREE` and wait for /health."""
    if any(a in ("--host", "--port") or a.startswith(("--host=", "--port=")) for a in args):
        raise TargetError(f"{label}: leave --host/--port out of pagoda:ARGS; the tool picks a free loopback port")
    port = free_port()
    handle, log_name = tempfile.mkstemp(prefix=f"pagoda-{label}-", suffix=".log")
    os.close(handle)
    command = [
        sys.executable,
        "-m",
        "pagoda.cli",
        "serve",
        *args,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--log-level",
        "warning",
    ]
    target = Target(f"http://127.0.0.1:{port}", api_key=api_key, label=label, launch_args=args)
    try:
        process = start_server(
            command,
            target.url("/health"),
            timeout=timeout,
            log_path=Path(log_name),
            name=f"`pagoda serve {shlex.join(args)}`",
            env={**os.environ, "PYTHONUNBUFFERED": "1"},
        )
    except ServerStartError as exc:
        raise TargetError(f"{label}: {exc}") from None
    return LaunchedServer(process, target, Path(log_name))


def parse_target(spec: str, label: str, *, model: str | None = None, api_key: str | None = None) -> Target | list[str]:
    """A URL -> Target; `pagoda:ARGS` -> the argument list to launch."""
    if spec.startswith(LAUNCH_PREFIX):
        return shlex.split(spec[len(LAUNCH_PREFIX) :])
    if not spec.startswith(("http://", "https://")):
        raise TargetError(f"{label}: {spec!r} is neither an http(s) URL nor pagoda:ARGS")
    return Target(spec, model=model, api_key=api_key, label=label)


@contextlib.contextmanager
def open_target(
    spec: str, label: str, *, model: str | None, api_key: str | None, launch_timeout: float
) -> Iterator[Any]:
    """The Target for a URL, or a launched pagoda's Target (stopped on exit)."""
    parsed = parse_target(spec, label, model=model, api_key=api_key)
    if isinstance(parsed, Target):
        yield parsed
        return
    server = launch_pagoda(parsed, label, api_key=api_key, timeout=launch_timeout)
    server.target.model = model
    try:
        yield server.target
    finally:
        server.stop()
