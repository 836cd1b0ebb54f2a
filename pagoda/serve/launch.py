"""Start the OpenAI-compatible server: tenants, settings, the engine, the app, uvicorn.

Heavy imports (torch, fastapi, uvicorn) happen inside `launch_server` so that the OpenMP wait
policy can be set before torch loads and so that `pagoda --help` stays fast.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Literal

from pagoda.config import EngineConfig
from pagoda.engine.threads import prefer_passive_omp_wait
from pagoda.serve.settings import (DEFAULT_MAX_QUEUED_REQUESTS, DEFAULT_MAX_QUEUED_TOKENS,
                                   DEFAULT_MAX_REQUEST_BYTES)

if TYPE_CHECKING:
    from pagoda.engine.client import EngineClient

DEFAULT_SHUTDOWN_TIMEOUT_S = 5.0


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
    shutdown_timeout: float = DEFAULT_SHUTDOWN_TIMEOUT_S  # seconds the first Ctrl-C/SIGTERM drains
    target_ttft_ms: float | None = None  # latency-aware admission (serve/latency_targets.py)
    target_itl_ms: float | None = None
    metrics_compat: Literal["none", "vllm"] = "none"
    tool_call_parser: str = "hermes"  # pagoda/serve/tool_calls.py PARSERS
    guardrails: str | None = None  # YAML file of guardrail rules (pagoda/guard/config.py)
    allow_runtime_lora: bool = False  # LoRA load/unload endpoints for admin keys


def launch_server(options: ServeOptions) -> int:
    """Serve until interrupted. User errors (bad key file, an engine that cannot start) end the
    process with a one-line message (SystemExit)."""
    # Spinning OpenMP workers steal the cores the HTTP thread needs: pagoda/engine/threads.py.
    prefer_passive_omp_wait()
    import logging

    import uvicorn

    from pagoda.replicas.start import start_engines
    from pagoda.serve.app import build_app
    from pagoda.serve.drain import DrainGate, DrainingServer
    from pagoda.serve.latency_targets import LatencyTargets
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
    guardrails = None
    if options.guardrails:
        from pagoda.guard import GuardrailsConfigError, load_guardrails

        try:
            guardrails = load_guardrails(options.guardrails)
        except GuardrailsConfigError as exc:
            raise SystemExit(f"pagoda serve: {options.guardrails}: {exc}") from None
    config = options.engine
    try:
        settings = ServerSettings(
            served_model_name=options.served_model_name or Path(config.model).name,
            model_path=config.model, tenants=tenants, max_request_bytes=options.max_request_bytes,
            max_queued_requests=options.max_queued_requests,
            max_queued_tokens=options.max_queued_tokens, log_prompts=options.log_prompts,
            latency_targets=LatencyTargets(
                ttft_s=None if options.target_ttft_ms is None else options.target_ttft_ms / 1000,
                itl_s=None if options.target_itl_ms is None else options.target_itl_ms / 1000),
            metrics_compat=options.metrics_compat, guardrails=guardrails,
            tool_call_parser=options.tool_call_parser, allow_runtime_lora=options.allow_runtime_lora)
        if options.allow_runtime_lora and not config.enable_lora:
            raise ValueError("--allow-runtime-lora needs --enable-lora")
        for name, _ in config.lora_module_paths():
            if name == settings.served_model_name:
                raise ValueError(f"--lora-modules: adapter {name!r} has the served model's name")
        if options.shutdown_timeout < 0:
            raise ValueError(f"--shutdown-timeout must be >= 0, got {options.shutdown_timeout}")
    except ValueError as exc:
        raise SystemExit(f"pagoda serve: {exc}") from None
    try:
        llm = start_engines(config, transport=options.engine_transport)  # replicas: pagoda/replicas
    except RuntimeError as exc:
        cause = exc.__cause__ or exc
        raise SystemExit(f"pagoda serve: could not start the engine for {config.model}: "
                         f"{cause}") from None
    except (OSError, ValueError) as exc:  # --replica-pools / --route-rules
        raise SystemExit(f"pagoda serve: {exc}") from None
    try:
        gate = DrainGate(build_app(llm, settings))
        server = DrainingServer(
            uvicorn.Config(gate, host=options.host, port=options.port, log_level=options.log_level,
                           timeout_graceful_shutdown=1, lifespan="off"),  # the app has no lifespan hooks
            gate, options.shutdown_timeout, on_force_exit=lambda: llm.shutdown(timeout=0))
        logging.getLogger("pagoda.serve").info("%s", startup_banner(options, llm, settings))
        server.run()
    finally:
        llm.shutdown()
    return 0


def max_num_seqs_line(llm: EngineClient) -> str:
    """--max-num-seqs as the engine resolved it, and why."""
    choice = llm.max_num_seqs_choice
    return choice.describe() if choice is not None else str(llm.config.max_num_seqs)


def startup_banner(options: ServeOptions, llm: EngineClient, settings: object) -> str:
    """One block at start: model, dtype, context, KV pool, features, URL."""
    from pagoda.config import parse_replica_roles
    from pagoda.engine.engine_core import resolve_device, resolve_dtype
    from pagoda.model.model_config import ModelConfig

    config = options.engine
    model_config = ModelConfig.from_dir(config.model)
    device = resolve_device(config.device)
    dtype = str(resolve_dtype(config.dtype, model_config.config_dtype, device)).removeprefix("torch.")
    stats = llm.get_stats()
    max_model_len = llm.max_model_len
    blocks = stats.num_total_blocks if stats is not None else 0
    tokens = blocks * config.block_size
    features = [name for name, on in (
        ("prefix caching", config.enable_prefix_caching),
        ("chunked prefill", config.enable_chunked_prefill),
        (f"speculative decoding ({config.speculative})", bool(config.speculative)),
        (f"scheduling {config.scheduling_policy}", config.scheduling_policy != "fcfs"),
        ("latency targets", settings.latency_targets is not None  # type: ignore[attr-defined]
         and settings.latency_targets.enabled),  # type: ignore[attr-defined]
        ("vllm: metric names", options.metrics_compat == "vllm"),
        ("guardrails", options.guardrails is not None),
        (f"LoRA (max {config.max_loras} per step, rank <= {config.max_lora_rank}"
         f"{', runtime loading' if options.allow_runtime_lora else ''}: "
         f"{', '.join(llm.lora_names) or 'no adapters yet'})", config.enable_lora),
        (f"tensor parallel {config.tensor_parallel_size} ({config.distributed_executor_backend})",
         config.tensor_parallel_size > 1),
    ) if on]
    return "\n".join([
        "pagoda serve is ready",
        f"  model      {settings.served_model_name} ({config.model})",  # type: ignore[attr-defined]
        f"  device     {device.type}, {dtype}, engine in a {llm.transport}"
        + (f", {' + '.join(f'{n} {role}' for role, n in (parse_replica_roles(config.replica_roles) or {}).items())}"
           f" replicas ({config.router} router, "
           f"KV handoff over {config.kv_transport})" if config.replica_roles
           else f", {config.data_parallel_size} replicas ({config.router} router)"
           if config.data_parallel_size > 1 else ""),
        f"  context    {max_model_len} tokens",
        f"  KV pool    {blocks} blocks x {config.block_size} = {tokens} tokens "
        f"({tokens // max(max_model_len, 1)} sequences at full context)",
        f"  max seqs   {max_num_seqs_line(llm)}",
        f"  features   {', '.join(features) or 'none'}",
        f"  listening  http://{options.host}:{options.port}/v1 (shutdown drains for {options.shutdown_timeout:g} s)",
    ])
