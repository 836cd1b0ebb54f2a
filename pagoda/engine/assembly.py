"""Assembling one engine's parts, apart from the core that runs them (engine_core.py).

`build_model_stack` loads what computes: artifact verification, weight format and kernels,
the tensor- or pipeline-parallel executor, the model, the draft model, LoRA adapters.
`plan_engine_kv_pool` sizes the KV pool for that stack (pagoda.core.kv_plan), `build_kv_tiers`
the host and disk tiers under it, and `build_runner` joins model, pool and speculation into the
model runner. Each takes the settings it reads; the core only wires the results together.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from pagoda.artifacts.digests import ArtifactError
from pagoda.artifacts.verify import ArtifactCheck, VerificationPolicy, verify_artifact
from pagoda.config import EngineConfig, LoRAConfig
from pagoda.core.encoder_cache import EncoderCache
from pagoda.core.kv_cache_groups import longest_sequence_blocks, release_blocker
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.kv_memory import KVMemory, free_after_weights, free_memory_bytes, kv_pool_memory
from pagoda.core.kv_plan import KVPoolPlan, plan_kv_pool
from pagoda.core.scheduler import Scheduler
from pagoda.core.state_slots import StateSlots
from pagoda.core.state_snapshots import StateSnapshots
from pagoda.engine.hybrid_settings import check_hybrid_settings
from pagoda.engine.threads import available_cores
from pagoda.engine.validation import EngineLimits
from pagoda.errors import InvalidRequest
from pagoda.executor.pipeline import PipelineExecutor
from pagoda.executor.tensor_parallel import TensorParallelExecutor
from pagoda.kernels import Kernels, resolve_kernels
from pagoda.kv_transfer.tiers import KVTiers, model_fingerprint
from pagoda.lora.manager import LoRAManager
from pagoda.model.decoder import DecoderModel
from pagoda.model.loader import load_model, load_model_config
from pagoda.model.moe_load import ExpertLoadMeter
from pagoda.model.pipeline import PipelineStage, pipeline_stages
from pagoda.quant.weight_formats import WeightFormat, make_weight_format
from pagoda.spec_decode.controller import SpecDecodeController
from pagoda.spec_decode.draft_proposer import DraftModelProposer
from pagoda.worker.model_runner import ModelRunner

if TYPE_CHECKING:
    from pagoda.model.model_config import ModelConfig
    from pagoda.quant.kv_cache_dtype import KVCacheFormat

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    return torch.device(name)


def resolve_dtype(name: str, config_dtype: str | None, device: torch.device) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device.type == "cpu":
        return torch.float32  # transformers-identical greedy outputs; --dtype bfloat16 trades that for speed
    return _DTYPES.get(config_dtype or "", torch.bfloat16) if config_dtype != "float32" else torch.bfloat16


@dataclass
class ModelStack:
    """What computes in one engine, loaded and checked (build_model_stack)."""

    model_config: ModelConfig
    device: torch.device
    dtype: torch.dtype
    max_model_len: int
    verification: VerificationPolicy
    weights_digest: str | None  # the verified manifest's digest (--verify-manifest), else None
    kernels: Kernels  # the ops the model's layers call, resolved once for the device (pagoda.kernels)
    weight_format: WeightFormat
    stages: list[PipelineStage] | None  # pipeline parallelism: every stage, this process the first
    executor: TensorParallelExecutor | None  # the other ranks or stages, None on one
    model: Any  # the target model (this rank's shard, or the first stage's layers)
    draft_model: Any | None  # --speculative draft
    lora: LoRAManager | None  # --enable-lora
    moe_meter: ExpertLoadMeter | None  # --moe-metrics on a MoE model
    free_before_load: int | None = None  # memory free on the device before the weights loaded (kv auto)

    @property
    def num_micro_batches(self) -> int:
        """Steps in flight at once: one per pipeline stage."""
        return len(self.stages) if self.stages is not None else 1


def build_model_stack(config: EngineConfig) -> ModelStack:
    """Load the model (and draft model, adapters) the settings name, on the ranks they name.
    Raises ValueError for settings the model or machine cannot meet, ArtifactError for files
    that fail verification (nothing loaded from them stays in memory)."""
    verification = VerificationPolicy(config.verify_manifest, config.verify_key)
    # With verification on, every file of the model is hashed on a thread while the weights
    # load; the manifest's id is the weights digest provenance reports (None unverified).
    artifact_check = None
    if verification.enabled:
        artifact_check = ArtifactCheck(config.model, verification).start()
        if config.tokenizer not in (None, config.model):
            verify_artifact(config.tokenizer, verification)
    model_config = load_model_config(config.model, config.score_tokens, config.tokenizer)
    check_hybrid_settings(config, model_config)
    device = resolve_device(config.device)
    dtype = resolve_dtype(config.dtype, model_config.config_dtype, device)
    max_model_len = config.max_model_len or model_config.max_position_embeddings
    if max_model_len > model_config.max_position_embeddings:
        raise ValueError(
            f"max_model_len {max_model_len} exceeds the model's "
            f"max_position_embeddings {model_config.max_position_embeddings}"
        )
    if not config.enable_chunked_prefill and config.max_num_batched_tokens < max_model_len:
        logger.info(
            "chunked prefill is off: prompts longer than %d tokens will be rejected", config.max_num_batched_tokens
        )
    kernels = resolve_kernels(device, config.native_kernels)
    weight_format = make_weight_format(
        config.quantization, config.quantization_group_size, config.quantization_zero_point, kernels.native_layout
    )
    kernels.linear.check(weight_format, device, dtype)
    # --kv-cache-memory auto shares what the weights leave free (pagoda.core.kv_memory).
    auto_kv = config.kv_cache_bytes is None and config.num_kv_blocks is None
    free_before_load = free_memory_bytes(device) if auto_kv else None
    # Tensor parallelism: ranks 1..N-1 load their shards beside this one (rank 0), with as
    # many threads as the driver gave this thread (engine/threads.py). Pipeline parallelism:
    # stages 1..P-1 load their layers, this process is the first stage.
    stages = _pipeline_stages(config, model_config, device)
    executor: TensorParallelExecutor | None = None
    if stages is not None:
        executor = PipelineExecutor(config, device, dtype, torch.get_num_threads(), stages, model_config.vocab_size)
    elif config.tensor_parallel_size > 1:
        executor = TensorParallelExecutor(config, device, dtype, torch.get_num_threads())
    try:
        model = load_model(
            config.model,
            model_config,
            dtype,
            device,
            weight_format,
            executor.group if executor else None,
            stages[0] if stages is not None else None,
            kernels,
        )
    except ValueError:
        if artifact_check is not None:
            artifact_check.result()  # a tampered file is named as such, not as a corrupt one
        raise
    weights_digest = None
    if artifact_check is not None:
        try:
            weights_digest = artifact_check.result()
        except ArtifactError:
            del model  # nothing loaded from an unverified artifact stays in memory
            if executor is not None:
                executor.shutdown()
            raise
    draft_model = None
    if config.speculative == "draft":
        draft_model = _load_draft_model(
            config.draft_model, model_config, max_model_len, dtype, device, weight_format, verification, kernels
        )
    moe_meter = (
        ExpertLoadMeter(model, config.tensor_parallel_size if config.enable_expert_parallel else None)
        if config.moe_metrics and model_config.moe is not None
        else None
    )
    lora = load_loras(config.lora, model, dtype, device, verification) if config.enable_lora else None
    return ModelStack(
        model_config,
        device,
        dtype,
        max_model_len,
        verification,
        weights_digest,
        kernels,
        weight_format,
        stages,
        executor,
        model,
        draft_model,
        lora,
        moe_meter,
        free_before_load,
    )


def _pipeline_stages(
    config: EngineConfig, model_config: ModelConfig, device: torch.device
) -> list[PipelineStage] | None:
    """--pipeline-parallel-size's stages (None without), checked against the model and the
    machine before any process starts."""
    parallel = config.parallel
    num_stages = parallel.pipeline_parallel_size
    if num_stages == 1:
        return None
    stages = pipeline_stages(model_config.num_layers, num_stages, parallel.pp_layer_counts)
    ranks = num_stages * parallel.tensor_parallel_size
    if device.type == "cuda":
        available, what = torch.cuda.device_count(), "CUDA devices"
    else:
        available, what = available_cores(), "CPU cores"
    if ranks > available:
        raise ValueError(
            f"pipeline_parallel_size {num_stages} x tensor_parallel_size "
            f"{parallel.tensor_parallel_size} = {ranks} ranks, but only {available} {what} "
            f"are available"
        )
    return stages


def _load_draft_model(
    draft_dir: str | None,
    target: ModelConfig,
    max_model_len: int,
    dtype: torch.dtype,
    device: torch.device,
    weight_format: WeightFormat,
    verification: VerificationPolicy,
    kernels: Kernels,
) -> DecoderModel:
    assert draft_dir is not None  # SpeculativeConfig requires it with speculative=draft
    if verification.enabled:
        verify_artifact(draft_dir, verification)
    draft_config = load_model_config(draft_dir)
    if draft_config.vocab_size != target.vocab_size:
        raise ValueError(
            f"draft model {draft_dir} has a vocabulary of {draft_config.vocab_size} tokens, the "
            f"target {target.vocab_size}: they must share the tokenizer"
        )
    if draft_config.max_position_embeddings < max_model_len:
        raise ValueError(
            f"draft model {draft_dir} supports {draft_config.max_position_embeddings} positions, "
            f"fewer than max_model_len {max_model_len}"
        )
    return load_model(draft_dir, draft_config, dtype, device, weight_format, kernels=kernels)


def load_loras(
    lora: LoRAConfig, model: Any, dtype: torch.dtype, device: torch.device, verification: VerificationPolicy
) -> LoRAManager:
    """Wrap the projections and load --lora-modules; a bad adapter stops the start."""
    manager = LoRAManager(model, max_loras=lora.max_loras, max_lora_rank=lora.max_lora_rank, dtype=dtype, device=device)
    for name, path in lora.lora_module_paths():
        try:
            verify_adapter(verification, name, path)
            manager.add(name, path)
        except InvalidRequest as error:
            raise ValueError(f"--lora-modules: {error}") from None
    return manager


def verify_adapter(verification: VerificationPolicy, name: str, path: str) -> None:
    """An adapter proves itself as the model does (--verify-manifest / --verify-key)."""
    if not verification.enabled:
        return
    try:
        verify_artifact(path, verification)
    except ArtifactError as error:
        raise InvalidRequest(
            f"LoRA adapter {name!r} failed verification: {error}", param="lora_path", code="adapter_verification_failed"
        ) from None


def plan_engine_kv_pool(config: EngineConfig, stack: ModelStack) -> KVPoolPlan:
    """The KV pool of this stack under these settings (pagoda.core.kv_plan)."""
    return plan_kv_pool(
        config.cache,
        config.scheduler,
        stack.model.config,
        engine_kv_memory(config, stack),
        num_kv_heads=stack.model.num_kv_heads,
        element_bytes=torch.tensor([], dtype=stack.dtype).element_size(),
        max_model_len=stack.max_model_len,
        release_blocker=release_blocker(config),
        stages=stack.stages,
        draft_config=stack.draft_model.config if stack.draft_model is not None else None,
    )


def engine_kv_memory(config: EngineConfig, stack: ModelStack) -> KVMemory:
    """The bytes the pool may take on each rank: --kv-cache-memory, or the share of the memory the
    weights leave free (pagoda.core.kv_memory), split between this host's data-parallel replicas
    and, on the CPU, between the ranks (each holds its part of the weights and of the pool)."""
    if stack.free_before_load is None:  # --kv-cache-memory or --num-kv-blocks
        return kv_pool_memory(config.cache, None)
    cpu_ranks = config.tensor_parallel_size * config.pipeline_parallel_size if stack.device.type == "cpu" else 1
    models = [stack.model] + ([stack.draft_model] if stack.draft_model is not None else [])
    weights = sum(dict(_storage_bytes(t) for m in models for t in (*m.parameters(), *m.buffers())).values())
    free = free_after_weights(stack.free_before_load, free_memory_bytes(stack.device), weights * cpu_ranks)
    return kv_pool_memory(config.cache, free, parts=config.num_replicas * cpu_ranks)


def _storage_bytes(tensor: torch.Tensor) -> tuple[int, int]:
    """(an identity of the memory `tensor` views, its bytes): tied weights share one storage.
    Opaque tensors (oneDNN's packed weights) have no storage to name: their own bytes."""
    try:
        storage = tensor.untyped_storage()
        return storage.data_ptr(), storage.nbytes()
    except (NotImplementedError, RuntimeError):
        return id(tensor), tensor.numel() * tensor.element_size()


def build_kv_tiers(config: EngineConfig, plan: KVPoolPlan, dtype: torch.dtype) -> KVTiers | None:
    """The host (and disk) tiers under the pool, with --kv-offload-memory; None without."""
    if config.kv_offload_memory is None:
        return None
    fingerprint = model_fingerprint(config, str(dtype).removeprefix("torch."))
    return KVTiers(config.cache, plan.bytes_per_block, fingerprint)


def build_runner(
    config: EngineConfig, stack: ModelStack, plan: KVPoolPlan, kv_format: KVCacheFormat
) -> tuple[ModelRunner, SpecDecodeController]:
    """The model runner over the pool, with speculation, and the executor's ranks serving the
    same block ids."""
    backend_name = config.attention_backend
    if backend_name == "auto" and stack.model_config.mla is not None:
        backend_name = "torch"  # latent attention runs on the torch backend only (kernels/attention/latent.py)
    backend = stack.kernels.attention_backend(backend_name, kv_format)
    vision = stack.model_config.vision
    if vision is not None and vision.bidirectional and backend.name != "torch":  # its masks are the torch backend's
        raise ValueError(f"{config.model}: images attending both ways need --attention-backend torch")
    drafter = None
    if stack.draft_model is not None:
        drafter = DraftModelProposer(
            stack.draft_model, backend, plan.num_blocks, config.block_size, stack.dtype, stack.device, kv_format
        )
    speculation = SpecDecodeController(config.speculation, drafter)
    runner = ModelRunner(
        stack.model,
        backend,
        plan.num_blocks,
        config.block_size,
        stack.dtype,
        stack.device,
        config.seed,
        max_num_seqs=config.max_num_seqs_bound,
        max_model_len=stack.max_model_len,
        enforce_eager=config.enforce_eager or stack.executor is not None,
        speculator=speculation if config.speculative else None,
        kv_format=kv_format,
        lora=stack.lora,
        groups=plan.groups,
        num_state_slots=plan.num_state_slots + plan.num_state_snapshots,
    )
    if stack.executor is not None:
        stack.executor.start_serving(plan.num_blocks, plan.groups)
        if isinstance(stack.executor, PipelineExecutor):
            runner.pipeline = stack.executor
        else:
            runner.tensor_parallel = stack.executor
    return runner, speculation


def build_scheduler(
    config: EngineConfig, stack: ModelStack, plan: KVPoolPlan, kv_tiers: KVTiers | None
) -> tuple[KVCacheManager, Scheduler]:
    """The KV cache manager over the planned pool (its tiers beneath) and the scheduler over it."""
    kv_cache = KVCacheManager(
        plan.num_blocks,
        config.block_size,
        config.enable_prefix_caching,
        host_tier=kv_tiers.host if kv_tiers else None,
        preemption=kv_tiers.policy if kv_tiers else None,
        groups=plan.groups,
        state_slots=StateSlots(plan.num_state_slots) if plan.num_state_slots else None,
        # snapshot slots follow the sequences' own in the state cache
        state_snapshots=StateSnapshots(plan.num_state_slots, plan.num_state_snapshots)
        if plan.num_state_snapshots
        else None,
    )
    scheduler = Scheduler(
        kv_cache,
        # a hybrid model runs no more sequences than its state cache has slots
        max_num_seqs=min(config.max_num_seqs_bound, plan.num_state_slots or config.max_num_seqs_bound),
        max_num_batched_tokens=config.max_num_batched_tokens,
        max_model_len=stack.max_model_len,
        enable_chunked_prefill=config.enable_chunked_prefill,
        policy=config.scheduling_policy,
        draft_shares_blocks=stack.draft_model is not None,
        max_loras=config.max_loras if stack.lora is not None else None,
        long_rope_boundary=stack.model_config.long_rope_boundary,
        num_micro_batches=stack.num_micro_batches,
    )
    if stack.model_config.vision is not None:  # images: the encoder step's budget and cache
        if config.tensor_parallel_size > 1 or config.pipeline_parallel_size > 1 or config.role != "both":
            # (a handoff's header carries no images: the decode engine could not key its blocks)
            raise ValueError(
                f"{config.model}: vision-language models run without tensor or pipeline parallelism "
                f"and without prefill/decode disaggregation"
            )
        scheduler.encoder_cache = EncoderCache(config.encoder_cache_tokens)
        scheduler.max_num_encoder_tokens = config.max_num_encoder_tokens
        scheduler.whole_images = stack.model_config.vision.bidirectional
        per_image = int(stack.model_config.vision.options.get("mm_tokens_per_image", 0))
        if scheduler.whole_images and config.max_num_batched_tokens < per_image:
            raise ValueError(
                f"{config.model}: an image's {per_image} tokens are computed in one step: "
                f"--max-num-batched-tokens must be at least that (got {config.max_num_batched_tokens})"
            )
    return kv_cache, scheduler


def engine_limits(config: EngineConfig, stack: ModelStack, plan: KVPoolPlan, kv_cache: KVCacheManager) -> EngineLimits:
    """What a request may ask of this engine (pagoda.engine.validation)."""
    num_kv_blocks = (
        plan.num_blocks
        if kv_cache.single_table
        else longest_sequence_blocks(
            plan.groups, plan.num_blocks, config.block_size, stack.max_model_len, config.max_num_batched_tokens
        )
    )
    return EngineLimits(
        max_model_len=stack.max_model_len,
        vocab_size=stack.model_config.vocab_size,
        num_kv_blocks=num_kv_blocks,
        block_size=config.block_size,
        max_num_batched_tokens=config.max_num_batched_tokens,
        enable_chunked_prefill=config.enable_chunked_prefill,
        image_token_id=stack.model_config.vision.image_token_id if stack.model_config.vision is not None else None,
    )


def attach_kv_tiers(kv_tiers: KVTiers | None, runner: ModelRunner, speculation: SpecDecodeController) -> None:
    """The tiers copy the same caches the runner's block copies do: the target's, then the draft
    model's, so a block's KV travels between tiers for both models at once."""
    if kv_tiers is None:
        return
    caches = [t for pair in runner.distinct_kv_caches for t in pair]
    caches += [t for pair in speculation.kv_caches for t in pair]
    runner.kv_transfer = kv_tiers.attach(caches)
