"""EngineCore: owns the scheduler, the KV cache manager and the model runner; `step()` runs
one scheduled batch. Works in token ids only; text lives in the output processor."""

from __future__ import annotations

import logging
import time
from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field, replace

from pagoda.config import EngineConfig
from pagoda.core.encoder_cache import EncoderCacheStats
from pagoda.engine.assembly import (
    attach_kv_tiers,
    build_kv_tiers,
    build_model_stack,
    build_runner,
    build_scheduler,
    engine_limits,
    plan_engine_kv_pool,
    verify_adapter,
)
from pagoda.engine.disaggregation import DisaggStats
from pagoda.engine.engine_request import EngineRequest
from pagoda.engine.max_num_seqs import resolve_max_num_seqs
from pagoda.engine.token_histogram import TokenHistogram
from pagoda.engine.validation import (
    check_classifier_use,
    check_lora_enabled,
    check_lora_updatable,
    check_media,
    check_request_id_free,
    validate_request,
)
from pagoda.errors import InvalidRequest
from pagoda.kv_transfer.tiers import KVTierStats
from pagoda.lora.manager import LoRAManager
from pagoda.lora_request import LoRARequest
from pagoda.model.moe_load import MoEStats
from pagoda.quant.kv_cache_dtype import make_kv_cache_format
from pagoda.request import Request, RequestStatus
from pagoda.spec_decode.controller import SpecDecodeStats
from pagoda.structured.compiler import StructuredOutputStats
from pagoda.structured.manager import StructuredOutputManager
from pagoda.worker.model_runner import StepTimings, SubmittedStep

logger = logging.getLogger(__name__)


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
    encoder: EncoderCacheStats | None = None  # images encoded and encoder-cache hits (vision-language models)


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


class EngineCore:
    def __init__(self, config: EngineConfig) -> None:
        # Torch's thread count is the driver's to set (pagoda.engine.threads), on its own thread.
        # What is built here comes from pagoda.engine.assembly; the core wires it and runs it.
        self.config = config
        stack = build_model_stack(config)
        self.model_config, self.device, self.dtype = stack.model_config, stack.device, stack.dtype
        self.max_model_len, self.weights_digest = stack.max_model_len, stack.weights_digest
        self.verification, self.kernels, self.weight_format = stack.verification, stack.kernels, stack.weight_format
        self.stages, self.executor, self.num_micro_batches = stack.stages, stack.executor, stack.num_micro_batches
        self.lora, self.moe_meter = stack.lora, stack.moe_meter
        self.kv_format = make_kv_cache_format(config.kv_cache_dtype, self.dtype)
        plan = plan_engine_kv_pool(config, stack)
        self.kv_groups, self.release_blocker, self.num_blocks = plan.groups, plan.release_blocker, plan.num_blocks
        self.kv_pool_memory = plan.describe_memory()  # the pool's bytes and why, for the banner
        self.kv_tiers = build_kv_tiers(config, plan, self.dtype)
        self.kv_cache, self.scheduler = build_scheduler(config, stack, plan, self.kv_tiers)
        # Steps submitted and not yet collected: up to one per pipeline stage (pagoda.executor.pipeline).
        self.in_flight: deque[InFlightStep] = deque()
        self.runner, self.speculation = build_runner(config, stack, plan, self.kv_format)
        self.engine_limits = engine_limits(config, stack, plan, self.kv_cache)
        attach_kv_tiers(self.kv_tiers, self.runner, self.speculation)
        self.runner.encoder_cache = self.scheduler.encoder_cache
        self.requests: dict[str, list[Request]] = {}  # user request id -> its samples
        # Grammars compile beside the loop; its tokenizer index starts building now.
        self.structured = StructuredOutputManager(
            config.tokenizer or config.model,
            self.model_config.vocab_size,
            self.model_config.eos_token_ids,
            timeout_s=config.structured_output_timeout,
            max_workers=config.structured_output_compile_threads,
        )
        self._reset_step_stats()
        self._resolve_max_num_seqs()
        self._log_ready(stack.model.first_attention.o_proj.weight_format.name)

    def _log_ready(self, weights: str) -> None:
        slots = self.kv_cache.state_slots  # a hybrid model's state cache
        logger.info(
            "engine ready: %s, %s on %s, weights=%s, %d KV blocks of %d tokens (kv %s), attention=%s%s",
            self.model_config.architecture,
            self.dtype,
            self.device,
            weights,
            self.num_blocks,
            self.config.block_size,
            self.config.kv_cache_dtype,
            self.runner.backend.name,
            "" if slots is None else f", state cache of {slots.num_slots} sequences",
        )

    def _reset_step_stats(self) -> None:
        """Step statistics: written by steps only, read by stats()."""
        self.num_prompt_tokens = 0
        self.num_generation_tokens = 0
        self.iteration_tokens = TokenHistogram()
        self.last_step_timings = StepTimings()

    def _resolve_max_num_seqs(self) -> None:
        """The --max-num-seqs default (pagoda/engine/max_num_seqs.py): calibrated on real steps,
        whose statistics are then forgotten (calibration steps are not traffic)."""
        classifier = self.model_config.classifier
        # A sequence classifier never decodes: there is no decode step to hold to the ITL budget.
        itl_budget_ms = None if classifier is not None and not classifier.generates else self.config.max_num_seqs_itl_ms
        self.max_num_seqs_choice = resolve_max_num_seqs(self, self.config.max_num_seqs, itl_budget_ms)
        self.scheduler.max_num_seqs = self.max_num_seqs_choice.value
        if not self.max_num_seqs_choice.explicit:
            self._reset_step_stats()
            self.scheduler.prefix_cache_queries = self.scheduler.prefix_cache_hits = 0
            self.speculation.reset_stats()

    # ---- requests ------------------------------------------------------------------------------

    def add_request(
        self, request: EngineRequest, *, eos_token_ids: Iterable[int] = (), enqueue: bool = True
    ) -> list[Request]:
        """Validate and queue a request (its prompt as token ids); returns its samples (n of
        them). Raises InvalidRequest. With enqueue=False the caller schedules it (a KV handoff
        being imported)."""
        request_id, params, prompt_token_ids = request.request_id, request.params, request.prompt_token_ids
        check_request_id_free(request_id, self.requests)
        max_output = validate_request(prompt_token_ids, params, self.engine_limits)
        if params.pooling is not None and self.config.pipeline_parallel_size > 1:
            # The hidden states to pool are the last stage's; only logits come back from it.
            raise InvalidRequest(
                "embeddings are not supported with pipeline parallelism yet (--pipeline-parallel-size > 1)",
                param="input",
            )
        check_classifier_use(params, self.model_config.classifier)
        check_media(prompt_token_ids, request.media, self.engine_limits)
        adapter = None
        if request.lora_request is not None:
            check_lora_enabled(request.lora_request.lora_name, self.lora is not None)
            assert self.lora is not None  # check_lora_enabled raised otherwise
            adapter = self.lora.resolve(request.lora_request)
        lead = Request(
            request_id=request_id if params.n == 1 else f"{request_id}#0",
            prompt_token_ids=prompt_token_ids,
            sampling_params=params,
            eos_token_ids=frozenset(eos_token_ids),
            max_output_tokens=max_output,
            arrival_time=request.arrival_time or time.time(),
            cache_salt=request.cache_salt,
            priority=request.priority,
            parent_id=request_id,
            lora=adapter,
            long_rope=self.scheduler.needs_long_rope(len(prompt_token_ids)),
            media=request.media,
        )
        if adapter is not None:
            assert self.lora is not None  # an adapter was resolved by it
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
        verify_adapter(self.verification, lora_request.lora_name, lora_request.lora_path)
        manager.add(lora_request.lora_name, lora_request.lora_path)

    def remove_lora(self, name: str) -> None:
        """Unload an adapter: new requests cannot name it; running ones finish with it."""
        self._require_lora(name).remove(name)

    def list_loras(self) -> list[str]:
        return self.lora.names() if self.lora is not None else []

    def _require_lora(self, name: str) -> LoRAManager:
        check_lora_updatable(name, self.lora is not None)
        assert self.lora is not None  # check_lora_updatable raised otherwise
        return self.lora

    def has_unfinished_requests(self) -> bool:
        """Requests to schedule, grammars compiling, or steps in flight (even of aborted requests)."""
        return self.scheduler.has_unfinished_requests() or self.structured.has_pending or bool(self.in_flight)

    def is_waiting_for_grammar(self, request_id: str) -> bool:
        samples = self.requests.get(request_id)
        if not samples:
            return False
        lead = samples[0]
        return (
            lead.sampling_params.structured_outputs is not None
            and lead.structured_output is None
            and not lead.is_finished
        )

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
            transfer = self.runner.kv_transfer
            assert transfer is not None, "the scheduler plans tier copies only with KV tiers attached"
            transfer.run(scheduler_output.kv_transfers)
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
                for position, token_id in zip(entries, request.output_token_ids[num_before:]):
                    request.output_logprobs.append(position)
                    request.cumulative_logprob += position[token_id].logprob
        self.last_step_timings = replace(
            runner_output.timings, schedule=step.schedule_s, update=time.perf_counter() - executed
        )
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
            kv_tiers=self.kv_tiers.stats(
                self.kv_cache.tier_hits, self.kv_cache.num_swapped, self.scheduler.num_preemptions_by_mode
            )
            if self.kv_tiers
            else None,
            structured_output=self.structured.stats(),
            lora=self._lora_stats(),
            moe=self.moe_meter.stats() if self.moe_meter is not None else None,
            encoder=self.scheduler.encoder_cache.snapshot() if self.scheduler.encoder_cache is not None else None,
        )

    def _lora_stats(self) -> LoRAStats | None:
        if self.lora is None:
            return None

        def names(requests) -> list[str]:
            return sorted({r.lora.name for r in requests if r.lora is not None})

        return LoRAStats(
            max_loras=self.lora.max_loras,
            running_adapters=names(self.scheduler.running),
            waiting_adapters=names(self.scheduler.waiting),
            loaded_adapters=self.lora.names(),
            num_slot_loads=self.lora.slots.num_loads,
        )


def _record_prompt_logprobs(request: Request, first_position: int, entries: list) -> None:
    """Entries score prompt positions first_position + 1, ...; a recompute after preemption
    scores them again, and only positions not yet recorded are kept."""
    if not request.prompt_logprobs:
        request.prompt_logprobs.append(None)  # the first prompt token has no context
    skip = len(request.prompt_logprobs) - (first_position + 1)
    if skip < len(entries):
        request.prompt_logprobs.extend(entries[max(skip, 0) :])
