"""Helpers for the server tests: a tiny model on disk and a live server on a loopback port."""

from __future__ import annotations

import asyncio
import os
import shutil
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import uvicorn

from pagoda.config import DEFAULT_MODEL_DIR, DeploymentConfig, EngineConfig
from pagoda.engine.async_llm import AsyncLLM
from pagoda.http_client import server_process
from pagoda.http_client.server_process import ServerStartError, free_port  # noqa: F401 (the server tests import it from here)
from pagoda.replicas.start import start_engines
from pagoda.serve.app import build_app
from pagoda.serve.connections import http_config
from pagoda.serve.settings import ServerSettings

MODEL_NAME = "tiny-llama"
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def build_tiny_model(directory: Path) -> Path:
    """A random-weight Llama (hidden 64, 2 layers, 4 heads, 2 kv heads) with the bundled
    model's tokenizer and chat template (8k byte-level BPE)."""
    from model_factory import build_model
    from tokenizers import Tokenizer

    vocab_size = Tokenizer.from_file(str(DEFAULT_MODEL_DIR / "tokenizer.json")).get_vocab_size()
    build_model(directory, "llama", vocab_size=vocab_size)
    for name in TOKENIZER_FILES:
        shutil.copy(DEFAULT_MODEL_DIR / name, directory / name)
    return directory


@dataclass
class LiveServer:
    url: str
    llm: AsyncLLM
    app: Any
    server: uvicorn.Server
    thread: threading.Thread

    @property
    def base_url(self) -> str:
        return self.url + "/v1"

    def stats(self) -> Any:
        return self.llm.get_stats()

    def wait_idle(self, timeout: float = 10.0) -> Any:
        """Engine stats once nothing is running or waiting and every KV block is free."""
        deadline = time.monotonic() + timeout
        while True:
            stats = self.llm.get_stats()
            idle = stats.num_running == 0 and stats.num_waiting == 0 and stats.num_free_blocks == stats.num_total_blocks
            if idle or time.monotonic() > deadline:
                return stats
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(10)
        self.llm.shutdown()


def start_server(
    model_dir: Path,
    *,
    engine: dict[str, Any] | None = None,
    deployment: dict[str, Any] | None = None,
    engine_factory: Callable[[EngineConfig], Any] | None = None,
    transport: str = "thread",
    **settings: Any,
) -> LiveServer:
    """`engine`: EngineConfig fields; `deployment`: DeploymentConfig fields; `settings`:
    ServerSettings fields."""
    config = EngineConfig(
        **{"model": str(model_dir), "num_threads": 1, "num_kv_blocks": 256, "max_num_seqs": 64, **(engine or {})}
    )
    replicas = DeploymentConfig(**(deployment or {}))
    if replicas.num_replicas > 1:  # replicas behind a router (pagoda/replicas)
        llm = start_engines(config, replicas, transport=transport)  # type: ignore[assignment]
    else:
        llm = AsyncLLM(config, engine_factory=engine_factory, transport=transport)
    server_settings = ServerSettings(**{"served_model_name": MODEL_NAME, "model_path": str(model_dir), **settings})
    app = build_app(llm, server_settings)
    server = uvicorn.Server(
        http_config(app, server_settings, host="127.0.0.1", port=0, log_level="warning", lifespan="off")
    )
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started:
        if not thread.is_alive() or time.monotonic() > deadline:
            llm.shutdown()
            raise RuntimeError("the test server did not start")
        time.sleep(0.01)
    port = server.servers[0].sockets[0].getsockname()[1]
    return LiveServer(f"http://127.0.0.1:{port}", llm, app, server, thread)


def run(coro: Any) -> Any:
    return asyncio.run(coro)


REPO_ROOT = Path(__file__).resolve().parents[1]


def start_serve_process(model_dir: Path, port: int, *flags: str, timeout: float = 90) -> subprocess.Popen:
    """`pagoda serve` in a subprocess (its own process group, as in a terminal), once /health
    answers 200; stdout and stderr together in `process.stdout`."""
    command = [
        sys.executable,
        "-m",
        "pagoda.cli",
        "serve",
        "--model",
        str(model_dir),
        "--port",
        str(port),
        "--num-threads",
        "1",
        *flags,
    ]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    try:
        return server_process.start_server(
            command,
            f"http://127.0.0.1:{port}/health",
            timeout=timeout,
            env=env,
            start_new_session=True,
            name="pagoda serve",
        )
    except ServerStartError as exc:
        pytest.fail(str(exc))
