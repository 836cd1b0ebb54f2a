"""`pagoda serve`: flags of the OpenAI-compatible HTTP server; serve/launch.py starts it."""

from __future__ import annotations

import argparse
from typing import Any

from pagoda.config import DeploymentConfig, EngineConfig
from pagoda.serve.launch import launch_server
from pagoda.serve.settings import ServerSettings


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve", help="run the OpenAI-compatible HTTP server",
        description="Serve a model over an OpenAI-compatible HTTP API "
                    "(/v1/completions, /v1/chat/completions, /v1/models, /tokenize, "
                    "/detokenize, /health, /metrics).")
    ServerSettings.add_cli_args(parser)
    EngineConfig.add_cli_args(parser)
    DeploymentConfig.add_cli_args(parser)
    parser.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    try:
        engine = EngineConfig.from_cli_args(args)
        deployment = DeploymentConfig.from_cli_args(args)
        settings = ServerSettings.from_cli_args(args)
    except ValueError as exc:
        raise SystemExit(f"pagoda serve: {exc}") from None
    if settings.models_file is not None:
        check_models_fit(settings.models_file, engine, deployment)
    return launch_server(engine, settings, deployment)


def check_models_fit(path: str, engine: EngineConfig, deployment: DeploymentConfig) -> None:
    """Refuse (SystemExit) a models file that is malformed or whose models cannot all fit in
    this machine's memory, naming each model's need, before any engine starts."""
    from pagoda.cli.plan import models_fit
    from pagoda.plan import machine_memory_bytes

    try:
        fit = models_fit(path, engine, deployment, machine_memory_bytes(engine.device))
    except (OSError, ValueError) as exc:
        raise SystemExit(f"pagoda serve: {exc}") from None
    if not fit.fits:
        raise SystemExit("pagoda serve: the models do not fit this machine's memory: " + fit.describe(path, "; "))
