"""LLMEngine: the synchronous engine in text terms — tokenizer + EngineCore + output processing.

Not thread-safe: one thread drives it (LLM offline, or AsyncLLM's engine thread or process for
the server). `step()` returns one EngineStepOutput: the deltas of the requests that changed,
and what else happened to requests since the previous step (adds accepted or refused, grammar
failures, KV handoffs ended). Prefill/decode disaggregation lives behind `kv_connector`.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Iterable
from dataclasses import replace
from typing import Any

from pagoda.config import EngineConfig
from pagoda.engine.beam_search import BeamSearchRunner
from pagoda.engine.commands import run_command
from pagoda.engine.disaggregation import sampling_params_from_dict
from pagoda.engine.engine_core import EngineCore, EngineStats
from pagoda.engine.engine_request import EngineRequest
from pagoda.engine.kv_connector import KVConnector
from pagoda.engine.output_processor import OutputProcessor
from pagoda.engine.roles import HandoffTarget
from pagoda.engine.sleep_mode import SleepMode
from pagoda.engine.step_output import EngineStepOutput
from pagoda.engine.validation import EngineLimits, check_prompt_text, check_role_accepts, invalid_handoff
from pagoda.engine.weight_updates import WeightUpdates
from pagoda.errors import InvalidRequest
from pagoda.kv_transfer.handoff import IncomingHandoff, TransferError
from pagoda.lora_request import LoRARequest
from pagoda.model.classifier_config import ClassifierConfig
from pagoda.request import RequestStatus
from pagoda.sampling_params import SamplingParams, tokenize_bad_words
from pagoda.structured.grammar import grammar_failure
from pagoda.tokenizer import Tokenizer

__all__ = ["LLMEngine", "EngineStats"]

logger = logging.getLogger(__name__)


class LLMEngine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.core = EngineCore(config)
        self.tokenizer = Tokenizer.from_pretrained(config.tokenizer or config.model)
        self.output_processor = OutputProcessor(self.tokenizer)
        model_config = self.core.model_config
        eos = set(model_config.eos_token_ids)
        if self.tokenizer.eos_token_id is not None:
            eos.add(self.tokenizer.eos_token_id)
        self.eos_token_ids = frozenset(eos)
        self.kv_connector = KVConnector(config, self.core)
        self.beam_searches = BeamSearchRunner(self.core, self.tokenizer, self.eos_token_ids)
        self._output = EngineStepOutput()  # what the next step() reports besides its own deltas
        self.weight_updates = WeightUpdates(self.core)
        self.sleep_mode = SleepMode(self.core, self.weight_updates)
        self.paused: str | None = None  # "keep": nothing steps; "wait": in-flight requests finish
        self._drain_waiters: list[str] = []  # pause(wait) commands answered once nothing is in flight

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def engine_limits(self) -> EngineLimits:
        return self.core.engine_limits

    @property
    def classifier(self) -> ClassifierConfig | None:
        """The model's classifier head (scoring, classification), or None for a plain LM."""
        return self.core.model_config.classifier

    @property
    def generation_defaults(self) -> dict[str, Any]:
        """Sampling defaults from the model's generation_config.json."""
        return dict(self.core.model_config.generation_defaults)

    def default_sampling_params(self, **overrides: Any) -> SamplingParams:
        return SamplingParams(**{**self.generation_defaults, **overrides})

    def add_request(
        self, request: EngineRequest, *, handoff: HandoffTarget | None = None, awaiting_kv: bool = False
    ) -> None:
        """Queue a request. A string prompt is tokenized with special tokens; a list is token ids.
        Raises InvalidRequest (a ValueError) with a message fit for the client; the next step()
        reports the request as accepted (a structured-output one once its grammar compiled) or
        refused with that error.

        Disaggregation: a prefill engine sends the request and its KV to `handoff` once it has
        its first token; a decode engine holds an `awaiting_kv` request until that arrives (or
        kv_connector.prefill_locally is called)."""
        try:
            self._add_request(request, handoff, awaiting_kv)
        except Exception as error:
            self._output.refused[request.request_id] = _refusal(error)
            raise
        if not self.is_waiting_for_grammar(request.request_id):
            self._output.accepted.append(request.request_id)

    def _add_request(self, request: EngineRequest, handoff: HandoffTarget | None, awaiting_kv: bool) -> None:
        request_id, params = request.request_id, request.params
        prompt_text: str | None = None
        if isinstance(request.prompt, str):
            check_prompt_text(request.prompt)
            prompt_text = request.prompt
            request = replace(request, prompt=self.tokenizer.encode(request.prompt))
        check_role_accepts(self.config.role, params, handoff, awaiting_kv)
        if self.beam_searches.owns(request_id):
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        if params.use_beam_search:
            if handoff is not None or awaiting_kv:
                raise InvalidRequest("use_beam_search is not supported across a KV handoff", param="use_beam_search")
            self.beam_searches.add(request, prompt_text)
            return
        if params.bad_words and params.bad_words_token_ids is None:  # the sampler bans token ids
            request = replace(
                request, params=params.clone(bad_words_token_ids=tokenize_bad_words(params.bad_words, self.tokenizer))
            )
        samples = self.core.add_request(request, eos_token_ids=self.eos_token_ids, enqueue=not awaiting_kv)
        self.output_processor.add_request(request_id, prompt_text, samples)
        self.kv_connector.on_add(samples[0], handoff, awaiting_kv)

    def add_prefilled_request(
        self, incoming: IncomingHandoff, *, fallback: bool = True, arrival_time: float | None = None
    ) -> bool:
        """Continue a request handed off by a prefill engine. Its KV blocks are received into
        freshly allocated blocks (those this engine's prefix cache lacks); True when they were.
        If the transfer fails or is refused, what was allocated is released and, with
        `fallback`, the request is queued to prefill here (False is returned; the caller sees
        no error), else TransferError is raised. The prefill engine's first token is kept
        unless the handoff was refused for its identity (another model, tenant or adapter
        computed it): then this engine samples the first token itself."""
        header = incoming.header
        lora = LoRARequest(lora_name=header.lora_name) if header.lora_name is not None else None
        try:
            params = sampling_params_from_dict(header.sampling_params)
            request = EngineRequest(
                header.request_id,
                header.prompt_token_ids,
                params,
                arrival_time=arrival_time,
                cache_salt=header.cache_salt,
                lora_request=lora,
            )
            samples = self.core.add_request(request, eos_token_ids=self.eos_token_ids, enqueue=False)
        except (InvalidRequest, TypeError) as error:  # TypeError: sampling params this version lacks
            incoming.reject(str(error))
            raise invalid_handoff(header.request_id, error) from None
        self.output_processor.add_request(header.request_id, None, samples)
        try:
            return self.kv_connector.import_request(incoming, samples[0], fallback=fallback)
        except TransferError:
            self._forget(header.request_id)
            raise

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load a PEFT adapter under its name (InvalidRequest if bad or the name is taken)."""
        self.core.add_lora(lora_request)

    def remove_lora(self, name: str) -> None:
        """Unload an adapter (InvalidRequest model_not_found if unknown); running requests finish with it."""
        self.core.remove_lora(name)

    def update_lora(self, control_id: str, lora_request: LoRARequest, *, unload: bool = False) -> None:
        """Load (or with `unload`, unload) an adapter between steps, never touching the running
        batch. Raises as add_lora / remove_lora; the next step() answers under `control_id`:
        accepted, or refused with the reason."""
        try:
            if unload:
                self.remove_lora(lora_request.lora_name)
            else:
                self.add_lora(lora_request)
        except Exception as error:
            self._output.refused[control_id] = (
                error
                if isinstance(error, InvalidRequest)
                else RuntimeError(f"the engine could not update LoRA adapter {lora_request.lora_name!r}: {error!r}")
            )
            raise
        self._output.accepted.append(control_id)

    # ---- commands: weight updates, pause, sleep (engine/commands.py names them) ------------

    def run_command(self, control_id: str, command: str, args: dict[str, Any]) -> None:
        """Apply one command between steps; the next step() answers under `control_id`: accepted,
        or refused with the reason (an InvalidRequest)."""
        try:
            answered = run_command(self, command, args)
        except Exception as error:
            if not isinstance(error, InvalidRequest):
                logger.exception("engine command %s failed", command)
            self._output.refused[control_id] = (
                error if isinstance(error, InvalidRequest) else InvalidRequest(f"{command} failed: {error}")
            )
            return
        if answered:
            self._output.accepted.append(control_id)
        else:
            self._drain_waiters.append(control_id)

    def pause(self, mode: str) -> bool:
        """Stop stepping requests: "keep" freezes them in place, "abort" ends them (finish reason
        abort), "wait" lets those in flight finish (True once nothing is; else the next step that
        drains them answers). The front holds new requests meanwhile."""
        if mode not in ("keep", "wait", "abort"):
            raise InvalidRequest(f"mode must be keep, wait or abort, got {mode!r}")
        if mode == "abort":
            self.abort_request(list(self.core.requests))
        self.paused = mode
        return mode != "wait" or not self.core.has_unfinished_requests()

    def resume(self) -> None:
        self.paused = None

    def list_loras(self) -> list[str]:
        return self.core.list_loras()

    def abort_request(self, request_ids: Iterable[str]) -> None:
        """Stop requests and free their blocks now; they are reported finished ("abort") by the next step()."""
        for request_id in request_ids:
            beam_search_aborted = self.beam_searches.abort(request_id)  # None: not a beam search
            if beam_search_aborted is not None:
                self._output.deltas.append(beam_search_aborted)
                continue
            if self.kv_connector.on_abort(request_id):
                continue  # a receive thread is writing its blocks: aborted once it ends
            if self.core.abort_request([request_id]):
                delta = self.output_processor.finish_aborted(request_id)
                if delta is not None:
                    self._output.deltas.append(delta)
                self._forget(request_id)

    def step(self) -> EngineStepOutput:
        """Run one engine step (when there is work); returns what it and the calls since the
        previous step did to requests."""
        self.abort_request(self.kv_connector.before_step(self._output.handoffs))
        output, self._output = self._output, EngineStepOutput()
        if not self.core.has_unfinished_requests() or self.paused == "keep" or self.sleep_mode.level:
            return self._answer_drained(output)
        result = self.core.step()
        output.accepted.extend(result.grammars_compiled)
        for request_id, message in result.grammars_failed.items():  # it never ran
            output.refused[request_id] = grammar_failure(message)
            self._forget(request_id)
        progressed, beam_answers = self.beam_searches.take(result.progressed)
        changed, stopped = self.output_processor.process(progressed)
        if stopped:
            self.core.finish_samples(stopped, RequestStatus.FINISHED_STOPPED)
        for delta in changed:
            if delta.finished:
                self._forget(delta.request_id)
        exported = self.kv_connector.after_step(progressed, changed)
        for request_id in exported:
            self._forget(request_id)
        output.deltas.extend(delta for delta in changed if delta.request_id not in exported)
        output.deltas.extend(beam_answers)
        return self._answer_drained(output)

    def _answer_drained(self, output: EngineStepOutput) -> EngineStepOutput:
        """pause(wait) is answered by the step after which nothing is in flight."""
        if self._drain_waiters and not self.core.has_unfinished_requests():
            output.accepted.extend(self._drain_waiters)
            self._drain_waiters = []
        return output

    def has_unfinished_requests(self) -> bool:
        """Work for step(): scheduled requests, aborts to report, or KV handoff events."""
        stepping = self.paused != "keep" and not self.sleep_mode.level
        return (
            (stepping and self.core.has_unfinished_requests())
            or bool(self._output.deltas)
            or self.kv_connector.has_events()
        )

    def is_waiting_for_grammar(self, request_id: str) -> bool:
        """A structured-output request accepted only once its grammar compiles (see step)."""
        return self.core.is_waiting_for_grammar(request_id)

    def get_stats(self) -> EngineStats:
        stats = self.core.stats()
        stats.disaggregation = self.kv_connector.stats()
        return stats

    def close(self) -> None:
        """Release what outlives the process otherwise (the disk KV tier's files, tensor-parallel
        workers, a decode engine's KV listener)."""
        self.kv_connector.close()
        self.core.close()

    def on_worker_failure(self, callback: Callable[[str], None]) -> None:
        """Tensor parallelism: `callback(reason)` when a worker dies, even while idle."""
        self.core.on_worker_failure(callback)

    def _forget(self, request_id: str) -> None:
        self.kv_connector.forget(request_id)
        self.core.release(request_id)
        self.output_processor.remove(request_id)


def _refusal(error: Exception) -> BaseException:
    """What the caller of a refused add sees: the InvalidRequest, any other ValueError as one,
    or (a bug for this request) a RuntimeError naming it."""
    if isinstance(error, InvalidRequest):
        return error
    if isinstance(error, ValueError):
        return InvalidRequest(str(error))
    return RuntimeError(f"the engine could not add the request: {error!r}")
