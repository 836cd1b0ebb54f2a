"""EngineCore: owns the scheduler, the KV cache manager and the model runner; `step()` runs
one scheduled batch. Works in token ids only; text lives in the output processor."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

import torch

from pagoda.artifacts.digests import ArtifactError
from pagoda.artifacts.verify import ArtifactCheck, VerificationPolicy, verify_artifact
from pagoda.config import EngineConfig
from pagoda.core.kv_cache_groups import (KVCacheGroup, kv_cache_groups, layers_per_page,
                                         longest_sequence_blocks, pages_per_sequence, release_blocker)
from pagoda.core.kv_cache_manager import KVCacheManager
from pagoda.core.scheduler import Scheduler
from pagoda.engine.disaggregation import DisaggStats
from pagoda.engine.max_num_seqs import resolve_max_num_seqs
from pagoda.engine.token_histogram import TokenHistogram
from pagoda.engine.validation import (EngineLimits, check_lora_enabled, check_lora_updatable,
                                      check_request_id_free, validate_request)
from pagoda.engine.threads import available_cores
from pagoda.executor.pipeline import PipelineExecutor
from pagoda.executor.tensor_parallel import TensorParallelExecutor
from pagoda.errors import InvalidRequest
from pagoda.kernels import resolve_kernels
from pagoda.kv_transfer.tiers import KVTiers, KVTierStats
from pagoda.lora.manager import LoRAManager
from pagoda.lora_request import LoRARequest
from pagoda.model.loader import load_model, load_model_config
from pagoda.model.moe_load import ExpertLoadMeter, MoEStats
from pagoda.model.pipeline import PipelineStage, pipeline_stages
from pagoda.quant.kv_cache_dtype import make_kv_cache_format
from pagoda.quant.weight_formats import make_weight_format
from pagoda.request import Request, RequestStatus
from pagoda.sampling_params import SamplingParams
from pagoda.spec_decode.controller import SpecDecodeController, SpecDecodeStats
from pagoda.spec_decode.draft_proposer import DraftModelProposer
from pagoda.structured.compiler import StructuredOutputStats
from pagoda.structured.manager import StructuredOutputManager
from pagoda.worker.model_runner import ModelRunner, StepTimings, SubmittedStep

logger = logging.getLogger(__name__)

_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


@dataclass
class EngineStats:
    """A snapshot for metrics. Token counters are cumulative since start."""

    num_running: int
    num_waiting: int
    kv_cache_usage: float
    num_total_blocks: int
    num_free_blocks: int
    prefix_cache_queries: int
    prefix_cache_hits: int
    num_preemptions: int
    num_prompt_tokens: int
    num_generation_tokens: int
    last_step_timings: StepTimings
    spec_decode: SpecDecodeStats
    kv_tiers: KVTierStats | None = None  # None when no host tier is configured
    iteration_tokens: TokenHistogram | None = None  # tokens computed per step
    structured_output: StructuredOutputStats | None = None
    lora: LoRAStats | None = None  # None without --enable-lora
    disaggregation: DisaggStats | None = None  # KV handoffs (the engine's KVConnector)
    moe: MoEStats | None = None  # expert load, with --moe-metrics on a MoE model


@dataclass
class CoreStepResult:
    """What one EngineCore.step() did, in token terms."""

    progressed: list[Request] = field(default_factory=list)  # samples that received tokens
    # Structured-output requests whose grammar finished compiling: scheduled now ...
    grammars_compiled: list[str] = field(default_factory=list)
    # ... or failed (bad grammar, --structured-output-timeout): the message; they never ran.
    grammars_failed: dict[str, str] = field(default_factory=dict)


@dataclass
class InFlightStep:
    """A step submitted to the model runner and not yet collected."""

    submitted: SubmittedStep
    schedule_s: float  # seconds the scheduler took to make it


@dataclass
class LoRAStats:
    """Adapters of the running and waiting requests (vLLM's lora_requests_info gauge)."""

    max_loras: int
    running_adapters: list[str]
    waiting_adapters: list[str]
    loaded_adapters: list[str]
    num_slot_loads: int  # adapters copied into a device slot since start (LRU misses)


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


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        # Torch's thread count is the driver's to set (pagoda.engine.threads), on its own thread.
        self.config = config
        self.verification = VerificationPolicy(config.verify_manifest, config.verify_key)
        # With verification on, every file of the model is hashed on a thread while the weights
        # load; the manifest's id is the weights digest provenance reports (None unverified).
        artifact_check = None
        if self.verification.enabled:
            artifact_check = ArtifactCheck(config.model, self.verification).start()
            if config.tokenizer not in (None, config.model):
                verify_artifact(config.tokenizer, self.verification)
        self.weights_digest: str | None = None
        self.model_config = load_model_config(config.model)
        self.device = resolve_device(config.device)
        self.dtype = resolve_dtype(config.dtype, self.model_config.config_dtype, self.device)
        self.max_model_len = config.max_model_len or self.model_config.max_position_embeddings
        if self.max_model_len > self.model_config.max_position_embeddings:
            raise ValueError(f"max_model_len {self.max_model_len} exceeds the model's "
                             f"max_position_embeddings {self.model_config.max_position_embeddings}")
        if not config.enable_chunked_prefill and config.max_num_batched_tokens < self.max_model_len:
            logger.info("chunked prefill is off: prompts longer than %d tokens will be rejected",
                        config.max_num_batched_tokens)

        self.kernels = resolve_kernels(self.device, config.native_kernels)
        self.weight_format = make_weight_format(config.quantization, config.quantization_group_size,
                                                config.quantization_zero_point, self.kernels.native_layout)
        self.kernels.linear.check(self.weight_format, self.device, self.dtype)
        # Tensor parallelism: ranks 1..N-1 load their shards beside this one (rank 0), with as
        # many threads as the driver gave this thread (engine/threads.py). Pipeline parallelism:
        # stages 1..P-1 load their layers, this process is the first stage.
        self.stages = self._pipeline_stages()
        self.num_micro_batches = len(self.stages) if self.stages is not None else 1
        self.executor: TensorParallelExecutor | None = None
        if self.stages is not None:
            self.executor = PipelineExecutor(config, self.device, self.dtype, self.weight_format,
                                             torch.get_num_threads(), self.stages, self.model_config.vocab_size)
        elif config.tensor_parallel_size > 1:
            self.executor = TensorParallelExecutor(config, self.device, self.dtype, self.weight_format,
                                                   torch.get_num_threads())
        try:
            model = load_model(config.model, self.model_config, self.dtype, self.device, self.weight_format,
                               self.executor.group if self.executor else None,
                           self.stages[0] if self.stages is not None else None, self.kernels)
        except ValueError:
            if artifact_check is not None:
                artifact_check.result()  # a tampered file is named as such, not as a corrupt one
            raise
        if artifact_check is not None:
            try:
                self.weights_digest = artifact_check.result()
            except ArtifactError:
                del model  # nothing loaded from an unverified artifact stays in memory
                if self.executor is not None:
                    self.executor.shutdown()
                raise
        draft_model = self._load_draft_model() if config.speculative == "draft" else None
        self.moe_meter = ExpertLoadMeter(model, config.tensor_parallel_size if config.enable_expert_parallel else None) \
            if config.moe_metrics and self.model_config.moe is not None else None
        self.lora = self._load_loras(model) if config.enable_lora else None
        self.kv_format = make_kv_cache_format(config.kv_cache_dtype, self.dtype)
        # The same formula `pagoda plan` uses (ModelConfig.kv_bytes_per_token, pagoda.quant.storage_bytes).
        element_bytes = torch.tensor([], dtype=self.dtype).element_size()
        # Sliding-window layers release the blocks behind their windows, in KV cache groups of
        # their own (pagoda.core.kv_cache_groups); a pool block holds one layer of each group member.
        windows = self.model_config.layer_sliding_windows
        self.release_blocker = release_blocker(config) if any(w is not None for w in windows) else None
        self.kv_groups = kv_cache_groups(windows, release=self.release_blocker is None)
        if self.release_blocker is not None:
            logger.info("sliding-window KV blocks are kept whole: %s", self.release_blocker)
        # Per rank: each holds its KV heads' slice of every block.
        bytes_per_block = model.config.kv_bytes_per_token(element_bytes, model.num_kv_heads,
                                                          kv_cache_dtype=config.kv_cache_dtype) * config.block_size
        bytes_per_block = bytes_per_block * layers_per_page(self.kv_groups) // model.config.num_layers
        if self.stages is not None:  # each stage holds its layers' share of a block: the largest bounds the pool
            bytes_per_block = bytes_per_block * max(stage_layers_per_page(self.kv_groups, stage)
                                                    for stage in self.stages) // layers_per_page(self.kv_groups)
        if draft_model is not None:
            bytes_per_block += draft_model.config.kv_bytes_per_token(
                element_bytes, kv_cache_dtype=config.kv_cache_dtype) * config.block_size
        self.num_blocks = self._num_kv_blocks(bytes_per_block)
        self.kv_tiers = KVTiers(config, bytes_per_block, str(self.dtype).removeprefix("torch.")) \
            if config.kv_offload_memory is not None else None
        self.kv_cache = KVCacheManager(self.num_blocks, config.block_size, config.enable_prefix_caching,
                                       host_tier=self.kv_tiers.host if self.kv_tiers else None,
                                       preemption=self.kv_tiers.policy if self.kv_tiers else None,
                                       groups=self.kv_groups)
        self.scheduler = Scheduler(
            self.kv_cache, max_num_seqs=config.max_num_seqs_bound, max_num_batched_tokens=config.max_num_batched_tokens,
            max_model_len=self.max_model_len, enable_chunked_prefill=config.enable_chunked_prefill,
            policy=config.scheduling_policy, draft_shares_blocks=draft_model is not None,
            max_loras=config.max_loras if self.lora is not None else None,
            long_rope_boundary=self.model_config.long_rope_boundary, num_micro_batches=self.num_micro_batches)
        # Steps submitted and not yet collected: up to one per pipeline stage (pagoda.executor.pipeline).
        self.in_flight: deque[InFlightStep] = deque()
        backend = self.kernels.attention_backend(config.attention_backend, self.kv_format)
        drafter = None
        if draft_model is not None:
            drafter = DraftModelProposer(draft_model, backend, self.num_blocks, config.block_size, self.dtype,
                                         self.device, self.kv_format)
        self.speculation = SpecDecodeController(config, drafter)
        self.runner = ModelRunner(model, backend, self.num_blocks, config.block_size, self.dtype, self.device,
                                  config.seed, max_num_seqs=config.max_num_seqs_bound,
                                  max_model_len=self.max_model_len,
                                  enforce_eager=config.enforce_eager or self.executor is not None,
                                  speculator=self.speculation if config.speculative else None,
                                  kv_format=self.kv_format, lora=self.lora, groups=self.kv_groups)
        if self.executor is not None:
            self.executor.start_serving(self.num_blocks, self.kv_groups)
            if isinstance(self.executor, PipelineExecutor):
                self.runner.pipeline = self.executor
            else:
                self.runner.tensor_parallel = self.executor
        self.engine_limits = EngineLimits(
            max_model_len=self.max_model_len, vocab_size=self.model_config.vocab_size,
            num_kv_blocks=self.num_blocks if self.kv_cache.single_table else longest_sequence_blocks(
                self.kv_groups, self.num_blocks, config.block_size, self.max_model_len,
                config.max_num_batched_tokens),
            block_size=config.block_size,
            max_num_batched_tokens=config.max_num_batched_tokens,
            enable_chunked_prefill=config.enable_chunked_prefill)
        if self.kv_tiers is not None:
            # The same caches _copy_blocks copies: the target's, then the draft model's, so a
            # block's KV travels between tiers for both models at once.
            caches = [t for pair in self.runner.kv_caches for t in pair]
            caches += [t for pair in self.speculation.kv_caches for t in pair]
            self.runner.kv_transfer = self.kv_tiers.attach(caches)
        self.requests: dict[str, list[Request]] = {}  # user request id -> its samples
        # Grammars compile beside the loop; its tokenizer index starts building now.
        self.structured = StructuredOutputManager(
            config.tokenizer or config.model, self.model_config.vocab_size, self.model_config.eos_token_ids,
            timeout_s=config.structured_output_timeout, max_workers=config.structured_output_compile_threads)
        # Step statistics: written here only, read by stats().
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.iteration_tokens = TokenHistogram()
        self.last_step_timings = StepTimings()
        # ---- --max-num-seqs default (pagoda/engine/max_num_seqs.py): calibrated on real steps ----
        self.max_num_seqs_choice = resolve_max_num_seqs(self, config.max_num_seqs, config.max_num_seqs_itl_ms)
        self.scheduler.max_num_seqs = self.max_num_seqs_choice.value
        if not self.max_num_seqs_choice.explicit:  # calibration steps are not traffic
            self.num_prompt_tokens = self.num_generation_tokens = 0
            self.iteration_tokens = TokenHistogram()
            self.last_step_timings = StepTimings()
            self.scheduler.prefix_cache_queries = self.scheduler.prefix_cache_hits = 0
            self.speculation.reset_stats()
        # ---- end --max-num-seqs default ----
        logger.info("engine ready: %s, %s on %s, weights=%s, %d KV blocks of %d tokens (kv %s), attention=%s",
                    self.model_config.architecture, self.dtype, self.device,
                    model.model.layers[0].self_attn.o_proj.weight_format.name,
                    self.num_blocks, config.block_size, config.kv_cache_dtype, backend.name)

    def _pipeline_stages(self) -> list[PipelineStage] | None:
        """--pipeline-parallel-size's stages (None without), checked against the model and the
        machine before any process starts."""
        num_stages = self.config.pipeline_parallel_size
        if num_stages == 1:
            return None
        stages = pipeline_stages(self.model_config.num_layers, num_stages, self.config.pp_layer_counts)
        ranks = num_stages * self.config.tensor_parallel_size
        if self.device.type == "cuda":
            available, what = torch.cuda.device_count(), "CUDA devices"
        else:
            available, what = available_cores(), "CPU cores"
        if ranks > available:
            raise ValueError(f"pipeline_parallel_size {num_stages} x tensor_parallel_size "
                             f"{self.config.tensor_parallel_size} = {ranks} ranks, but only {available} {what} "
                             f"are available")
        return stages

    def _load_draft_model(self):
        draft_dir = self.config.draft_model
        if self.verification.enabled:
            verify_artifact(draft_dir, self.verification)
        draft_config = load_model_config(draft_dir)
        if draft_config.vocab_size != self.model_config.vocab_size:
            raise ValueError(f"draft model {draft_dir} has a vocabulary of {draft_config.vocab_size} tokens, the "
                             f"target {self.model_config.vocab_size}: they must share the tokenizer")
        if draft_config.max_position_embeddings < self.max_model_len:
            raise ValueError(f"draft model {draft_dir} supports {draft_config.max_position_embeddings} positions, "
                             f"fewer than max_model_len {self.max_model_len}")
        return load_model(draft_dir, draft_config, self.dtype, self.device, self.weight_format, kernels=self.kernels)

    def _load_loras(self, model) -> LoRAManager:
        """Wrap the projections and load --lora-modules; a bad adapter stops the start."""
        manager = LoRAManager(model, max_loras=self.config.max_loras, max_lora_rank=self.config.max_lora_rank,
                              dtype=self.dtype, device=self.device)
        for name, path in self.config.lora_module_paths():
            try:
                self._verify_adapter(name, path)
                manager.add(name, path)
            except InvalidRequest as error:
                raise ValueError(f"--lora-modules: {error}") from None
        return manager

    def _num_kv_blocks(self, bytes_per_block: int) -> int:
        if self.config.num_kv_blocks is not None:  # blocks of every layer: the same memory in pages
            return self.config.num_kv_blocks * self.model_config.num_layers // layers_per_page(self.kv_groups)
        num_blocks = self.config.kv_cache_bytes // bytes_per_block
        # More than every running sequence at full length could ever use is wasted memory.
        useful = self.config.max_num_seqs_bound * pages_per_sequence(
            self.kv_groups, self.max_model_len, self.config.block_size, self.config.max_num_batched_tokens)
        num_blocks = min(num_blocks, useful)
        if num_blocks < 1:
            raise ValueError(f"kv_cache_memory {self.config.kv_cache_memory} holds no KV block "
                             f"({bytes_per_block} bytes each)")
        return num_blocks

    # ---- requests ------------------------------------------------------------------------------

    def add_request(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams, *,
                    eos_token_ids: Iterable[int] = (), arrival_time: float | None = None,
                    cache_salt: str | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None, enqueue: bool = True) -> list[Request]:
        """Validate and queue a request; returns its samples (n of them). Raises InvalidRequest.
        With enqueue=False the caller schedules it (a KV handoff being imported)."""
        check_request_id_free(request_id, self.requests)
        max_output = validate_request(prompt_token_ids, params, self.engine_limits)
        if params.pooling is not None and self.config.pipeline_parallel_size > 1:
            # The hidden states to pool are the last stage's; only logits come back from it.
            raise InvalidRequest("embeddings are not supported with pipeline parallelism yet "
                                 "(--pipeline-parallel-size > 1)", param="input")
        adapter = None
        if lora_request is not None:
            check_lora_enabled(lora_request.lora_name, self.lora is not None)
            adapter = self.lora.resolve(lora_request)
        lead = Request(
            request_id=request_id if params.n == 1 else f"{request_id}#0",
            prompt_token_ids=list(prompt_token_ids), sampling_params=params,
            eos_token_ids=frozenset(eos_token_ids), max_output_tokens=max_output,
            arrival_time=arrival_time or time.time(), cache_salt=cache_salt, priority=priority,
            parent_id=request_id, lora=adapter,
            long_rope=self.scheduler.needs_long_rope(len(prompt_token_ids)))
        if adapter is not None:
            self.lora.retain(adapter)  # released with the request (release())
        lead.pending_forks = [lead.new_sample(i) for i in range(1, params.n)]
        samples = [lead, *lead.pending_forks]
        self.requests[request_id] = samples
        if not enqueue:
            return samples
        if params.structured_outputs is not None:
            self.structured.submit(request_id, samples)  # joins the scheduler once compiled
        else:
            self.scheduler.add_request(lead)
        return samples

    def abort_request(self, request_ids: Iterable[str]) -> list[Request]:
        """End requests now and free their blocks; unknown ids are ignored."""
        aborted = []
        for request_id in request_ids:
            samples = self.requests.get(request_id)
            if samples:
                self.scheduler.finish_requests(samples, RequestStatus.FINISHED_ABORTED)
                aborted.extend(samples)
        return aborted

    def finish_samples(self, samples: Iterable[Request], status: RequestStatus) -> None:
        """End individual samples (a stop string matched in the output processor)."""
        self.scheduler.finish_requests(samples, status)

    def release(self, request_id: str) -> None:
        """Forget a finished request."""
        samples = self.requests.pop(request_id, None)
        if samples and samples[0].lora is not None and self.lora is not None:
            self.lora.release(samples[0].lora)

    # ---- LoRA adapters -------------------------------------------------------------------------

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter at run time; InvalidRequest if it is bad or its name is taken."""
        manager = self._require_lora(lora_request.lora_name)
        self._verify_adapter(lora_request.lora_name, lora_request.lora_path)
        manager.add(lora_request.lora_name, lora_request.lora_path)

    def _verify_adapter(self, name: str, path: str) -> None:
        """An adapter proves itself as the model does (--verify-manifest / --verify-key)."""
        if not self.verification.enabled:
            return
        try:
            verify_artifact(path, self.verification)
        except ArtifactError as error:
            raise InvalidRequest(f"LoRA adapter {name!r} failed verification: {error}", param="lora_path",
                                 code="adapter_verification_failed") from None

    def remove_lora(self, name: str) -> None:
        """Unload an adapter: new requests cannot name it; running ones finish with it."""
        self._require_lora(name).remove(name)

    def list_loras(self) -> list[str]:
        return self.lora.names() if self.lora is not None else []

    def _require_lora(self, name: str) -> LoRAManager:
        check_lora_updatable(name, self.lora is not None)
        return self.lora

    def has_unfinished_requests(self) -> bool:
        """Requests to schedule, grammars compiling, or steps in flight (even of aborted requests)."""
        return self.scheduler.has_unfinished_requests() or self.structured.has_pending or bool(self.in_flight)

    def is_waiting_for_grammar(self, request_id: str) -> bool:
        samples = self.requests.get(request_id)
        return bool(samples) and samples[0].sampling_params.structured_outputs is not None \
            and samples[0].structured_output is None and not samples[0].is_finished

    def _admit_compiled(self, result: CoreStepResult) -> None:
        if not self.structured.has_pending:
            return
        if not self.scheduler.has_unfinished_requests():
            self.structured.wait(0.01)  # nothing else to do: don't spin
        ready, failed = self.structured.poll()
        for request_id, samples in ready:
            self.scheduler.add_request(samples[0])
            result.grammars_compiled.append(request_id)
        for request_id, message in failed:
            self.scheduler.finish_requests(self.requests.get(request_id, []), RequestStatus.FINISHED_ABORTED)
            result.grammars_failed[request_id] = message

    # ---- the step ------------------------------------------------------------------------------

    def step(self) -> CoreStepResult:
        """Schedule and submit one batch; collect the oldest submitted one once as many are in
        flight as there are pipeline stages (one without stages), or when nothing new could be
        scheduled."""
        started = time.perf_counter()
        result = CoreStepResult()
        self._admit_compiled(result)
        self.scheduler.admit_imported()
        self.speculation.plan(self.scheduler.not_in_flight())
        scheduler_output = self.scheduler.schedule()
        if not scheduler_output.is_empty:
            schedule_s = time.perf_counter() - started
            self.iteration_tokens.observe(scheduler_output.num_batched_tokens)
            self.in_flight.append(InFlightStep(self.runner.submit(scheduler_output), schedule_s))
        elif scheduler_output.kv_transfers:  # a request swapped itself out and nothing runs
            self.runner.kv_transfer.run(scheduler_output.kv_transfers)
        if not self.in_flight or (len(self.in_flight) < self.num_micro_batches and not scheduler_output.is_empty):
            return result
        self._collect(self.in_flight.popleft(), result)
        return result

    def _collect(self, step: InFlightStep, result: CoreStepResult) -> None:
        """Sample a submitted step and advance its requests."""
        scheduler_output = step.submitted.scheduler_output
        runner_output = self.runner.collect(step.submitted)
        executed = time.perf_counter()
        if self.moe_meter is not None:
            self.moe_meter.after_step()
        for entry in scheduler_output.scheduled:
            entries = runner_output.prompt_logprobs.get(entry.request.request_id)
            if entries is not None:
                _record_prompt_logprobs(entry.request, entry.num_computed_before, entries)
            embedding = runner_output.pooled.get(entry.request.request_id)
            if embedding is not None:  # a pooling request's prompt is done (worker/pooling.py)
                entry.request.embedding = embedding
        outputs_before = {id(e.request): e.request.num_output_tokens for e in scheduler_output.scheduled}
        self.speculation.record(scheduler_output, runner_output.num_accepted)
        progressed = self.scheduler.update_from_output(scheduler_output, runner_output.sampled_token_ids)
        grammar_done = self.structured.advance(progressed, outputs_before)
        if grammar_done:
            self.scheduler.finish_requests(grammar_done, RequestStatus.FINISHED_STOPPED)
        for request in progressed:
            num_before = outputs_before[id(request)]
            if num_before == 0:
                self.num_prompt_tokens += request.num_prompt_tokens
            self.num_generation_tokens += request.num_output_tokens - num_before
            entries = runner_output.logprobs.get(request.request_id)
            if entries is not None:
                for entry, token_id in zip(entries, request.output_token_ids[num_before:]):
                    request.output_logprobs.append(entry)
                    request.cumulative_logprob += entry[token_id].logprob
        self.last_step_timings = replace(runner_output.timings, schedule=step.schedule_s,
                                         update=time.perf_counter() - executed)
        if self.kv_tiers is not None:
            self.kv_tiers.observe_step(scheduler_output.num_batched_tokens, self.last_step_timings.forward)
        result.progressed = progressed

    def close(self) -> None:
        """Finish pending KV copies and remove the disk tier's files (unless they persist);
        stop the tensor-parallel workers."""
        if self.kv_tiers is not None:
            self.kv_tiers.close()
        if self.executor is not None:
            self.executor.shutdown()

    def on_worker_failure(self, callback: Callable[[str], None]) -> None:
        """Tensor parallelism: call `callback(reason)` if a worker dies, even while idle."""
        if self.executor is not None:
            self.executor.on_failure(callback)

    def stats(self) -> EngineStats:
        return EngineStats(
            num_running=len(self.scheduler.running),
            num_waiting=len(self.scheduler.waiting),
            kv_cache_usage=self.kv_cache.usage,
            num_total_blocks=self.num_blocks,
            num_free_blocks=self.kv_cache.num_free_blocks,
            prefix_cache_queries=self.scheduler.prefix_cache_queries,
            prefix_cache_hits=self.scheduler.prefix_cache_hits,
            num_preemptions=self.scheduler.num_preemptions,
            num_prompt_tokens=self.num_prompt_tokens,
            num_generation_tokens=self.num_generation_tokens,
            last_step_timings=self.last_step_timings,
            spec_decode=self.speculation.stats(),
            iteration_tokens=self.iteration_tokens.copy(),
            kv_tiers=self.kv_tiers.stats(self.kv_cache.tier_hits, self.kv_cache.num_swapped,
                                         self.scheduler.num_preemptions_by_mode) if self.kv_tiers else None,
            structured_output=self.structured.stats(),
            lora=self._lora_stats(),
            moe=self.moe_meter.stats() if self.moe_meter is not None else None,
        )

    def _lora_stats(self) -> LoRAStats | None:
        if self.lora is None:
            return None

        def names(requests) -> list[str]:
            return sorted({r.lora.name for r in requests if r.lora is not None})

        return LoRAStats(max_loras=self.lora.max_loras, running_adapters=names(self.scheduler.running),
                         waiting_adapters=names(self.scheduler.waiting), loaded_adapters=self.lora.names(),
                         num_slot_loads=self.lora.slots.num_loads)


def _record_prompt_logprobs(request: Request, first_position: int, entries: list) -> None:
    """Entries score prompt positions first_position + 1, ...; a recompute after preemption
    scores them again, and only positions not yet recorded are kept."""
    if not request.prompt_logprobs:
        request.prompt_logprobs.append(None)  # the first prompt token has no context
    skip = len(request.prompt_logprobs) - (first_position + 1)
    if skip < len(entries):
        request.prompt_logprobs.extend(entries[max(skip, 0):])


def stage_layers_per_page(groups: list[KVCacheGroup], stage: PipelineStage) -> int:
    """Layers of a pool block a pipeline stage holds: the places its layers take in the groups
    (pagoda.worker.paged_model allocates only those)."""
    return len({place for group in groups for place, layer in enumerate(group.layers) if stage.holds_layer(layer)})
