"""Start the OpenAI-compatible server: tenants, settings, the engine, the app, uvicorn.

Heavy imports (torch, fastapi, uvicorn) happen inside `launch_server` so that the OpenMP wait
policy can be set before torch loads and so that `pagoda --help` stays fast.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pagoda.config import EngineConfig
from pagoda.serve.settings import (DEFAULT_MAX_QUEUED_REQUESTS, DEFAULT_MAX_QUEUED_TOKENS,
                                   DEFAULT_MAX_REQUEST_BYTES)


@dataclass
class ServeOptions:
    """Everything `pagoda serve` needs beyond the engine's own configuration."""

    engine: EngineConfig = field(default_factory=EngineConfig)
    host: str = "127.0.0.1"
    port: int = 8000
    served_model_name: str | None = None  # default: the model directory's name
    api_key: str | None = None  # one tenant with this key
    api_keys: str | None = None  # YAML or JSON file of tenants
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_queued_requests: int | None = DEFAULT_MAX_QUEUED_REQUESTS
    max_queued_tokens: int | None = DEFAULT_MAX_QUEUED_TOKENS
    engine_transport: Literal["process", "thread"] = "process"
    log_prompts: bool = False
    log_level: str = "info"


def launch_server(options: ServeOptions) -> int:
    """Serve until interrupted. User errors (bad key file, an engine that cannot start) end the
    process with a one-line message (SystemExit)."""
    # Spinning OpenMP workers steal the cores the HTTP thread needs (see MEASURED.md).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import logging

    import uvicorn

    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.serve.app import build_app
    from pagoda.serve.settings import ServerSettings
    from pagoda.serve.tenants import TenantRegistry

    logging.basicConfig(level=options.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if options.api_key and options.api_keys:
        raise SystemExit("pagoda serve: use --api-key or --api-keys, not both")
    if options.api_keys:
        try:
            tenants = TenantRegistry.from_file(options.api_keys)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"pagoda serve: {options.api_keys}: {exc}") from None
    elif options.api_key:
        tenants = TenantRegistry.single_key(options.api_key)
    else:
        tenants = TenantRegistry.open()
    config = options.engine
    try:
        settings = ServerSettings(
            served_model_name=options.served_model_name or Path(config.model).name,
            model_path=config.model, tenants=tenants, max_request_bytes=options.max_request_bytes,
            max_queued_requests=options.max_queued_requests,
            max_queued_tokens=options.max_queued_tokens, log_prompts=options.log_prompts)
    except ValueError as exc:
        raise SystemExit(f"pagoda serve: {exc}") from None
    try:
        llm = AsyncLLM(config, transport=options.engine_transport)
    except RuntimeError as exc:
        cause = exc.__cause__ or exc
        raise SystemExit(f"pagoda serve: could not start the engine for {config.model}: "
                         f"{cause}") from None
    try:
        app = build_app(llm, settings)
        uvicorn.run(app, host=options.host, port=options.port, log_level=options.log_level,
                    timeout_graceful_shutdown=5)
    finally:
        llm.shutdown()
    return 0
