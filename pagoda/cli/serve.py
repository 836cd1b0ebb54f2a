"""`pagoda serve`: flags of the OpenAI-compatible HTTP server; serve/launch.py starts it."""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path
from typing import Any

from pagoda.cli.model_flag import take_positional_model, use_chat_model_default
from pagoda.cli.vllm_flags import add_vllm_flags, apply_gpu_memory_utilization
from pagoda.config import SMOLLM2, DeploymentConfig, EngineConfig, smollm2_path
from pagoda.serve.launch import launch_server
from pagoda.serve.settings import ServerSettings

# pagoda's chat template for SmolLM2: its own (from the GGUF file) plus tools in the Hermes
# format that the default --tool-call-parser reads; the file's template has no tools.
SMOLLM2_TOOLS_TEMPLATE = Path(__file__).resolve().parents[1] / "chat_templates" / "smollm2_tools.jinja"


def add_parser(subparsers: Any) -> None:
    parser = subparsers.add_parser(
        "serve",
        help="run the OpenAI-compatible HTTP server",
        description="Serve a model over HTTP: OpenAI's /v1/chat/completions, /v1/completions, "
        "/v1/responses, /v1/embeddings and /v1/models, Anthropic's /v1/messages, and "
        "/tokenize, /detokenize, /health, /metrics. vLLM's `vllm serve` command lines "
        "run as they are.",
    )
    ServerSettings.add_cli_args(parser)
    EngineConfig.add_cli_args(parser)
    DeploymentConfig.add_cli_args(parser)
    use_chat_model_default(parser, positional=True)
    add_vllm_flags(parser)
    parser.set_defaults(func=run_serve)


def run_serve(args: argparse.Namespace) -> int:
    engine, deployment, settings = serve_configs(args)
    if settings.models_file is not None:
        check_models_fit(settings.models_file, engine, deployment)
    return launch_server(engine, settings, deployment)


def serve_configs(args: argparse.Namespace) -> tuple[EngineConfig, DeploymentConfig, ServerSettings]:
    """The parsed flags as the configs `launch_server` takes (SystemExit with one line on a bad
    value), vLLM's spellings folded in."""
    take_positional_model(args, "pagoda serve")
    try:
        engine = EngineConfig.from_cli_args(args)
        if smollm2_path() is not None and engine.model == str(smollm2_path()):
            if args.chat_template is None:
                args.chat_template = str(SMOLLM2_TOOLS_TEMPLATE)
            if not args.served_model_names and args.model == SMOLLM2:  # its name, not the file's
                args.served_model_names = [SMOLLM2]
        deployment = DeploymentConfig.from_cli_args(args)
        settings = ServerSettings.from_cli_args(args)
    except ValueError as exc:
        raise SystemExit(f"pagoda serve: {exc}") from None
    kv_default = next(f.default for f in dataclasses.fields(EngineConfig) if f.name == "kv_cache_memory")
    engine = apply_gpu_memory_utilization(
        engine, args.gpu_memory_utilization, kv_cache_memory_given=args.kv_cache_memory != kv_default
    )
    return engine, deployment, settings


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
