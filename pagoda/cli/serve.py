"""`pagoda serve`: flags of the OpenAI-compatible HTTP server; serve/launch.py starts it."""

from __future__ import annotations

import argparse
from typing import Any

from pagoda.cli.options import options_from_args
from pagoda.config import EngineConfig, parse_bytes
from pagoda.serve.launch import DEFAULT_SHUTDOWN_TIMEOUT_S, ServeOptions, launch_server
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
    server.add_argument("--host", default="127.0.0.1", help="address to listen on (default: 127.0.0.1)")
    server.add_argument("--port", type=int, default=8000, help="port to listen on (default: 8000)")
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
    server.add_argument("--tool-call-parser", choices=["hermes", "llama3_json", "mistral"], default="hermes",
                        help="how the model writes tool calls (default: hermes, as Qwen2.5/3 do)")
    server.add_argument("--guardrails", default=None, metavar="FILE",
                        help="YAML file of input/output guardrail rules (regex, blocklist, pii, "
                             "classifier) per tenant (default: off)")
    server.add_argument("--allow-runtime-lora", action="store_true",
                        help="let admin keys load and unload LoRA adapters at run time (POST "
                             "/v1/load_lora_adapter, /v1/unload_lora_adapter; needs --enable-lora)")
    server.add_argument("--log-prompts", action="store_true",
                        help="include prompt and output text in the request log")
    server.add_argument("--log-level", default="info",
                        choices=["critical", "error", "warning", "info", "debug"],
                        help="server log level (default: info)")
    server.add_argument("--shutdown-timeout", type=float, default=DEFAULT_SHUTDOWN_TIMEOUT_S,
                        help="on Ctrl-C or SIGTERM, seconds to let running requests finish while new "
                             "ones get 503; a second Ctrl-C exits at once "
                             f"(default: {DEFAULT_SHUTDOWN_TIMEOUT_S:g})")
    server.add_argument("--target-ttft-ms", type=float, default=None,
                        help="latency-aware admission: refuse new requests (503 + Retry-After) while "
                             "the recent p90 time to first token exceeds this (default: off)")
    server.add_argument("--target-itl-ms", type=float, default=None,
                        help="latency-aware admission: refuse new requests while the recent p90 "
                             "inter-token latency exceeds this (default: off)")
    server.add_argument("--metrics-compat", choices=["none", "vllm"], default="none",
                        help="also export every metric under vLLM's vllm: names, for existing vLLM "
                             "dashboards (default: none)")
    EngineConfig.add_cli_args(parser)
    parser.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    try:
        engine = EngineConfig.from_cli_args(args)
    except ValueError as exc:
        raise SystemExit(f"pagoda serve: {exc}") from None
    return launch_server(options_from_args(ServeOptions, args, engine=engine))
