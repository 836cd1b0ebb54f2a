"""`pagoda serve`: the OpenAI-compatible HTTP server.

Heavy imports (torch, fastapi, uvicorn) happen inside `run_serve` so `pagoda --help` is fast
and so the OpenMP wait policy can be set before torch loads.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path
from typing import Any

from pagoda.config import EngineConfig, parse_bytes
from pagoda.serve.settings import (DEFAULT_MAX_QUEUED_REQUESTS, DEFAULT_MAX_QUEUED_TOKENS,
                                   DEFAULT_MAX_REQUEST_BYTES)


def _optional_limit(text: str) -> int | None:
    return None if text.lower() in ("none", "0", "unlimited") else int(text)


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API "
                    "(/v1/completions, /v1/chat/completions, /v1/models, /tokenize, "
                    "/detokenize, /health, /metrics).")
    server = parser.add_argument_group("server")
    server.add_argument("--host", default="127.0.0.1", help="address to listen on")
    server.add_argument("--port", type=int, default=8000, help="port to listen on")
    server.add_argument("--served-model-name", default=None,
                        help="model name clients use (default: the model directory's name)")
    server.add_argument("--api-key", default=None,
                        help="require this key (Authorization: Bearer KEY); one tenant")
    server.add_argument("--api-keys", default=None, metavar="FILE",
                        help="YAML or JSON file of tenants, their API keys and limits")
    server.add_argument("--max-request-bytes", type=parse_bytes, default=DEFAULT_MAX_REQUEST_BYTES,
                        help=f"largest request body (default: {DEFAULT_MAX_REQUEST_BYTES})")
    server.add_argument("--max-queued-requests", type=_optional_limit,
                        default=DEFAULT_MAX_QUEUED_REQUESTS,
                        help="requests waiting for their first token before new ones get 503 "
                             f"(default: {DEFAULT_MAX_QUEUED_REQUESTS}; 'none' for no limit)")
    server.add_argument("--max-queued-tokens", type=_optional_limit,
                        default=DEFAULT_MAX_QUEUED_TOKENS,
                        help="prompt tokens of queued requests before new ones get 503 "
                             f"(default: {DEFAULT_MAX_QUEUED_TOKENS}; 'none' for no limit)")
    server.add_argument("--engine-transport", choices=["process", "thread"], default="process",
                        help="run the engine in its own process (default: it keeps its own GIL, "
                             "so the HTTP side cannot stall it, and a crash leaves the server up "
                             "to answer 503), or on a thread of the server process (starts "
                             "faster)")
    server.add_argument("--guardrails", default=None, metavar="FILE",
                        help="YAML file of input/output guardrail rules (regex, blocklist, pii, "
                             "classifier) per tenant")
    server.add_argument("--log-prompts", action="store_true",
                        help="include prompt and output text in the request log")
    server.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"])
    EngineConfig.add_cli_args(parser)
    parser.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    # Spinning OpenMP workers steal the cores the HTTP thread needs (see MEASURED.md).
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import logging

    import uvicorn

    from pagoda.engine.async_llm import AsyncLLM
    from pagoda.serve.app import build_app
    from pagoda.serve.settings import ServerSettings
    from pagoda.serve.tenants import TenantRegistry

    logging.basicConfig(level=args.log_level.upper(),
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    if args.api_key and args.api_keys:
        raise SystemExit("pagoda serve: use --api-key or --api-keys, not both")
    if args.api_keys:
        try:
            tenants = TenantRegistry.from_file(args.api_keys)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"pagoda serve: {args.api_keys}: {exc}") from None
    elif args.api_key:
        tenants = TenantRegistry.single_key(args.api_key)
    else:
        tenants = TenantRegistry.open()
    guardrails = None
    if args.guardrails:
        from pagoda.guard import GuardrailsConfigError, load_guardrails

        try:
            guardrails = load_guardrails(args.guardrails)
        except GuardrailsConfigError as exc:
            raise SystemExit(f"pagoda serve: {args.guardrails}: {exc}") from None
    try:
        config = EngineConfig.from_cli_args(args)
        settings = ServerSettings(
            served_model_name=args.served_model_name or Path(config.model).name,
            model_path=config.model, tenants=tenants, max_request_bytes=args.max_request_bytes,
            max_queued_requests=args.max_queued_requests,
            max_queued_tokens=args.max_queued_tokens, log_prompts=args.log_prompts,
            guardrails=guardrails)
    except ValueError as exc:
        raise SystemExit(f"pagoda serve: {exc}") from None
    try:
        llm = AsyncLLM(config, transport=args.engine_transport)
    except RuntimeError as exc:
        cause = exc.__cause__ or exc
        raise SystemExit(f"pagoda serve: could not start the engine for {config.model}: "
                         f"{cause}") from None
    try:
        app = build_app(llm, settings)
        uvicorn.run(app, host=args.host, port=args.port, log_level=args.log_level,
                    timeout_graceful_shutdown=5)
    finally:
        llm.shutdown()
    return 0
