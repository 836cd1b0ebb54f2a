"""Start the OpenAI-compatible server: tenants, settings, the engine, the app, uvicorn.

Heavy imports (torch, fastapi, uvicorn) happen inside `launch_server` so that the OpenMP wait
policy can be set before torch loads and so that `pagoda --help` stays fast.
"""

from __future__ import annotations

import dataclasses
import gc
import logging
import signal
import threading
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, TypedDict

from pagoda.config import DeploymentConfig, EngineConfig
from pagoda.engine.threads import prefer_passive_omp_wait
from pagoda.serve.settings import ServerSettings

if TYPE_CHECKING:
    from pagoda.engine.client import EngineClient
    from pagoda.guard import GuardrailsConfig
    from pagoda.model.model_config import ModelConfig
    from pagoda.serve.admission.tenants import TenantRegistry
    from pagoda.serve.drain import DrainingServer
    from pagoda.serve.model_registry import ModelRegistry
    from pagoda.serve.models_file import ModelsFile
    from pagoda.serve.observability.cost import PriceTable

# How often --no-restart looks whether an engine is left.
DEATH_WATCH_INTERVAL_S = 0.2


def launch_server(config: EngineConfig, settings: ServerSettings, deployment: DeploymentConfig | None = None) -> int:
    """Serve until interrupted: `deployment` (default: one engine) of engines configured by
    `config`, behind the HTTP side configured by `settings`. User errors (bad key file, an
    engine that cannot start) end the process with a one-line message (SystemExit)."""
    # Spinning OpenMP workers steal the cores the HTTP thread needs: pagoda/engine/threads.py.
    prefer_passive_omp_wait()
    from pagoda.artifacts.verify import VerificationPolicy, check_before_load
    from pagoda.model.loader import load_model_config
    from pagoda.replicas.start import start_engines
    from pagoda.serve.model_registry import ModelRegistry

    deployment = deployment or DeploymentConfig()
    logging.basicConfig(level=settings.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        # What this process reads itself (config, tokenizer, template) is checked before it is
        # read; the engine checks the weights while it loads them.
        policy = VerificationPolicy(config.verify_manifest, config.verify_key)
        for artifact in dict.fromkeys(filter(None, (config.model, config.tokenizer))):
            check_before_load(artifact, policy)
    except ValueError as exc:
        raise SystemExit(f"pagoda serve: {exc}") from None
    settings = dataclasses.replace(settings, **built_settings(settings, config))
    if settings.batch_store is None:  # the Batch API persists by default: a restart resumes batches
        settings = dataclasses.replace(settings, batch_store=ServerSettings.default_batch_store())
    if settings.models_file is not None:
        return _serve_models(config, settings, deployment)
    try:
        if settings.allow_runtime_lora and not config.enable_lora:
            raise ValueError("--allow-runtime-lora needs --enable-lora")
        for name, _ in config.lora_module_paths():
            if name == settings.served_model_name:
                raise ValueError(f"--lora-modules: adapter {name!r} has the served model's name")
    except ValueError as exc:
        raise SystemExit(f"pagoda serve: {exc}") from None
    try:
        # Read before anything else does: a model pagoda cannot run (an unknown architecture, a
        # corrupt GGUF) is named as such, before transformers reads its config for the tokenizer.
        load_model_config(config.model)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"pagoda serve: {exc}") from None
    try:
        llm = start_engines(config, deployment, transport=settings.engine_transport)  # replicas: pagoda/replicas
    except RuntimeError as exc:
        cause = exc.__cause__ or exc
        raise SystemExit(f"pagoda serve: could not start the engine for {config.model}: {cause}") from None
    except (OSError, ValueError) as exc:  # --replica-pools / --route-rules
        raise SystemExit(f"pagoda serve: {exc}") from None
    aliases = settings.served_model_names[1:]
    if settings.served_model_names and len(set(settings.served_model_names)) != len(settings.served_model_names):
        llm.shutdown()
        raise SystemExit("pagoda serve: --served-model-name lists a name twice")
    registry = ModelRegistry.single(llm, settings.served_model_name or "", config.model, aliases)
    banner = lambda: startup_banner(config, deployment, settings, llm)  # noqa: E731
    return _run(registry, settings, deployment.restart, banner)


def _serve_models(config: EngineConfig, settings: ServerSettings, deployment: DeploymentConfig) -> int:
    """--models FILE: start every model's engines (all or none), then serve them."""
    from pagoda.replicas.start import start_engines
    from pagoda.serve.model_registry import ModelRegistry, ServedModel
    from pagoda.serve.models_file import load_models_file

    assert settings.models_file is not None
    if settings.served_model_names:
        raise SystemExit("pagoda serve: --served-model-name and --models: name the models in the file")
    try:
        models_file = load_models_file(settings.models_file)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"pagoda serve: {exc}") from None
    settings = dataclasses.replace(
        settings, prices=_price_table(settings, [entry.name for entry in models_file.models])
    )
    served: list[ServedModel] = []
    try:
        for entry in models_file.models:
            engine = entry.engine_config(config, len(models_file.models))
            try:
                llm = start_engines(engine, entry.deployment_config(deployment), transport=settings.engine_transport)
            except RuntimeError as exc:
                raise SystemExit(
                    f"pagoda serve: {models_file.path}:{entry.line}: could not start model "
                    f"{entry.name!r} ({engine.model}): {exc.__cause__ or exc}"
                ) from None
            except (OSError, ValueError) as exc:
                raise SystemExit(
                    f"pagoda serve: {models_file.path}:{entry.line}: model {entry.name!r}: {exc}"
                ) from None
            served.append(ServedModel(entry.name, llm, engine.model, entry.aliases, entry.fallbacks))
        registry = ModelRegistry(served, models_file.routes, models_file.canary)
    except BaseException:
        for model in served:
            model.llm.shutdown()
        raise
    return _run(
        registry,
        dataclasses.replace(settings, served_model_name=served[0].name),
        deployment.restart,
        lambda: models_banner(models_file, registry, settings),
    )


def _run(registry: ModelRegistry, settings: ServerSettings, restart: bool, banner: Callable[[], str]) -> int:
    """Serve `registry`'s models until interrupted, then shut their engines down."""
    from pagoda.serve.app import build_app
    from pagoda.serve.connections import http_config, raise_file_limit
    from pagoda.serve.drain import DrainGate, DrainingServer

    death_watch = None
    try:
        gate = DrainGate(build_app(registry, settings))
        raise_file_limit(settings.max_connections)
        server = DrainingServer(
            http_config(
                gate,
                settings,
                host=settings.host,
                port=settings.port,
                log_level=settings.log_level,
                timeout_graceful_shutdown=1,
                lifespan="off",
            ),  # the app has no lifespan hooks
            gate,
            settings.shutdown_timeout,
            on_force_exit=lambda: registry.shutdown(timeout=0),
        )
        logging.getLogger("pagoda.serve").info("%s", banner())
        if not restart:
            death_watch = EngineDeathWatch(registry, server)
        # What exists now lives as long as the server: out of the collector's sight, a full
        # collection walks only what requests create. While one runs no thread moves, the
        # event loop's included, so its length is a stall of every request.
        gc.collect()
        gc.freeze()
        server.run()
    finally:
        if death_watch is not None:
            death_watch.stop()
        registry.shutdown()
    if death_watch is not None and death_watch.error is not None:
        raise SystemExit(f"pagoda serve: the engine stopped ({death_watch.error}); exiting (--no-restart)")
    return 0


class EngineDeathWatch:
    """--no-restart: once no engine is left, stop the server as on SIGTERM (new requests get
    503; the failed ones end with their error event) so that it exits non-zero and an outside
    supervisor restarts it."""

    def __init__(self, llm: EngineClient | ModelRegistry, server: DrainingServer) -> None:
        self.error: BaseException | None = None  # what stopped the engine, once it did
        self._llm = llm
        self._server = server
        self._stopped = threading.Event()
        threading.Thread(target=self._watch, name="pagoda-engine-death-watch", daemon=True).start()

    def _watch(self) -> None:
        while not self._stopped.wait(DEATH_WATCH_INTERVAL_S):
            if self._server.should_exit or self._server.gate.draining:
                return  # shutting down anyway
            if not self._llm.is_alive:
                self.error = self._llm.error or RuntimeError("no engine is left")
                logging.getLogger("pagoda.serve").error(
                    "the engine stopped (%s) and --no-restart is set: shutting the server down", self.error
                )
                self._server.handle_exit(signal.SIGTERM, None)
                return

    def stop(self) -> None:
        self._stopped.set()


class BuiltSettings(TypedDict):
    """The ServerSettings fields launch builds from the flags."""

    served_model_name: str
    model_path: str
    tenants: TenantRegistry
    guardrails: GuardrailsConfig | None
    prices: PriceTable | None


def built_settings(settings: ServerSettings, config: EngineConfig) -> BuiltSettings:
    """The settings launch builds from the flags: the served model's name and path, the tenants
    (--api-key or --api-keys), the loaded guardrails and price table; SystemExit for a bad file."""
    from pagoda.serve.admission.tenants import TenantRegistry

    if settings.api_key and settings.api_keys:
        raise SystemExit("pagoda serve: use --api-key or --api-keys, not both")
    if settings.api_keys:
        try:
            tenants = TenantRegistry.from_file(settings.api_keys)
        except (OSError, ValueError) as exc:
            raise SystemExit(f"pagoda serve: {settings.api_keys}: {exc}") from None
    elif settings.api_key:
        tenants = TenantRegistry.single_key(settings.api_key)
    else:
        tenants = TenantRegistry.open()
    guardrails = None
    if settings.guardrails_file:
        from pagoda.guard import GuardrailsConfigError, load_guardrails

        try:
            guardrails = load_guardrails(settings.guardrails_file)
        except GuardrailsConfigError as exc:
            raise SystemExit(f"pagoda serve: {settings.guardrails_file}: {exc}") from None
    names = settings.served_model_names
    served_model_name = names[0] if names else settings.served_model_name or Path(config.model).name
    return {
        "served_model_name": served_model_name,
        "model_path": config.model,
        "tenants": tenants,
        "guardrails": guardrails,
        "prices": _price_table(settings, [served_model_name]) if settings.models_file is None else None,
    }


def _price_table(settings: ServerSettings, served_models: list[str]) -> PriceTable | None:
    """--price-table, loaded and checked against the served model names (one line and exit
    when it is malformed)."""
    if not settings.price_table:
        return None
    from pagoda.serve.observability.cost import PriceTableError, load_price_table

    try:
        return load_price_table(settings.price_table, served_models)
    except PriceTableError as exc:
        raise SystemExit(f"pagoda serve: {settings.price_table}: {exc}") from None


def max_num_seqs_line(llm: EngineClient) -> str:
    """--max-num-seqs as the engine resolved it, and why."""
    choice = llm.max_num_seqs_choice
    return choice.describe() if choice is not None else str(llm.config.max_num_seqs)


def kv_pool_line(config: EngineConfig, model_config: ModelConfig, blocks: int, max_model_len: int) -> str:
    """The pool and the full-context sequences it holds, counting sliding-window release."""
    from pagoda.core.kv_cache_groups import kv_cache_groups, pages_per_sequence, release_blocker

    windows = model_config.layer_sliding_windows
    blocker = release_blocker(config) if any(w is not None for w in windows) else None
    groups = kv_cache_groups(windows, release=blocker is None)
    if len(groups) == 1 and groups[0].window is None:
        tokens = blocks * config.block_size
        line = (
            f"{blocks} blocks x {config.block_size} = {tokens} tokens ({tokens // max(max_model_len, 1)} "
            f"sequences at full context)"
        )
        return line + (f"; sliding-window KV kept whole: {blocker}" if blocker else "")
    local = sorted({g.window for g in groups if g.window is not None})
    per_sequence = pages_per_sequence(groups, max_model_len, config.block_size)
    return (
        f"{blocks} blocks x {config.block_size} tokens in {len(groups)} layer groups "
        f"({blocks // per_sequence} sequences at full context; sliding layers keep "
        f"{', '.join(map(str, local))} tokens)"
    )


def startup_banner(
    config: EngineConfig, deployment: DeploymentConfig, settings: ServerSettings, llm: EngineClient
) -> str:
    """One block at start: model, dtype, context, KV pool, features, URL."""
    from pagoda.config import parse_replica_roles
    from pagoda.engine.assembly import resolve_device, resolve_dtype
    from pagoda.kernels import describe_native
    from pagoda.model.loader import load_model_config

    model_config = load_model_config(config.model)  # a directory or a GGUF file
    device = resolve_device(config.device)
    torch_dtype = resolve_dtype(config.dtype, model_config.config_dtype, device)
    dtype = str(torch_dtype).removeprefix("torch.")
    stats = llm.get_stats()
    max_model_len = llm.max_model_len
    blocks = stats.num_total_blocks if stats is not None else 0
    native_kernels = describe_native(config.native_kernels, device)
    features = [
        name
        for name, on in (
            (native_kernels or "", native_kernels is not None),
            ("prefix caching", config.enable_prefix_caching),
            ("chunked prefill", config.enable_chunked_prefill),
            (f"speculative decoding ({config.speculative})", bool(config.speculative)),
            (f"scheduling {config.scheduling_policy}", config.scheduling_policy != "fcfs"),
            ("latency targets", settings.latency_targets.enabled),
            ("vllm: metric names", settings.metrics_compat == "vllm"),
            ("guardrails", settings.guardrails is not None),
            ("cost by --price-table", settings.prices is not None),
            (
                f"LoRA (max {config.max_loras} per step, rank <= {config.max_lora_rank}"
                f"{', runtime loading' if settings.allow_runtime_lora else ''}: "
                f"{', '.join(llm.lora_names) or 'no adapters yet'})",
                config.enable_lora,
            ),
            (
                f"tensor parallel {config.tensor_parallel_size} ({config.distributed_executor_backend})",
                config.tensor_parallel_size > 1,
            ),
            (
                f"pipeline parallel {config.pipeline_parallel_size}"
                f"{f' (layers {config.pp_layer_partition})' if config.pp_layer_partition else ''}",
                config.pipeline_parallel_size > 1,
            ),
            (
                "autoscaling {} to {} replicas".format(*deployment.replica_range),
                deployment.autoscaling and config.distributed_executor_backend == "ray",
            ),
        )
        if on
    ]
    return "\n".join(
        [
            "pagoda serve is ready",
            f"  model      {settings.served_model_name} ({config.model})",
            f"  device     {device.type}, {dtype}, engine in a {llm.transport}"
            + (
                ", "
                + " + ".join(f"{n} {role}" for role, n in (parse_replica_roles(deployment.replica_roles) or {}).items())
                + f" replicas ({deployment.router} router, "
                f"KV handoff over {config.kv_transport})"
                if deployment.replica_roles
                else f", {deployment.num_replicas} replicas ({deployment.router} router)"
                if deployment.num_replicas > 1
                else ""
            ),
            f"  context    {max_model_len} tokens",
            f"  KV pool    {kv_pool_line(config, model_config, blocks, max_model_len)}, {llm.kv_pool_memory}",
            f"  max seqs   {max_num_seqs_line(llm)}",
            f"  features   {', '.join(features) or 'none'}",
            f"  listening  http://{settings.host}:{settings.port}/v1 "
            f"(shutdown drains for {settings.shutdown_timeout:g} s)",
        ]
    )


def models_banner(models_file: ModelsFile, registry: ModelRegistry, settings: ServerSettings) -> str:
    """One block at start for --models: each model, its names, engines and fallbacks; the routes."""
    lines = [f"pagoda serve is ready: {len(registry)} models from {models_file.path}"]
    for model in registry:
        names = ", ".join(model.names)
        fallbacks = ", ".join(target.label for target in model.fallbacks) or "none"
        autoscale = model.llm.health().get("autoscale")
        scaling = f", autoscaling {autoscale['min']} to {autoscale['max']} replicas" if autoscale else ""
        lines.append(
            f"  {names:<24} {model.model_path}: {model.llm.transport}, context {model.llm.max_model_len}, "
            f"max seqs {model.llm.config.max_num_seqs}{scaling}, fallbacks {fallbacks}"
        )
    for route in registry.routes:
        lines.append(
            f"  route {route.name}: {len(route.rules)} rules -> "
            f"{', '.join(dict.fromkeys(rule.model for rule in route.rules))}"
        )
    lines.append(
        f"  listening  http://{settings.host}:{settings.port}/v1 (shutdown drains for {settings.shutdown_timeout:g} s)"
    )
    return "\n".join(lines)
