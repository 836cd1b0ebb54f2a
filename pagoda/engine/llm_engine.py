"""LLMEngine: the synchronous engine in text terms — tokenizer + EngineCore + output processing.

Not thread-safe: one thread drives it (LLM offline, or AsyncLLM's engine thread or process for
the server). `step()` returns one RequestOutputDelta per request that changed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from pagoda.config import EngineConfig
from pagoda.engine.disaggregation import check_exportable, sampling_params_from_dict
from pagoda.engine.engine_core import EngineCore, EngineStats
from pagoda.engine.output_processor import OutputProcessor
from pagoda.engine.validation import EngineLimits
from pagoda.errors import InvalidRequest
from pagoda.kv_transfer.handoff import IncomingHandoff, KVHandoff, TransferError, send_handoff
from pagoda.lora_request import LoRARequest
from pagoda.outputs import RequestOutputDelta
from pagoda.request import RequestStatus
from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer import Tokenizer

__all__ = ["LLMEngine", "EngineStats"]


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
        self._aborted: list[RequestOutputDelta] = []
        self._grammar_outcomes: list[tuple[str, str | None]] = []
        self._handoffs: list[KVHandoff] = []  # role prefill: exported, not yet taken

    @property
    def max_model_len(self) -> int:
        return self.core.max_model_len

    @property
    def engine_limits(self) -> EngineLimits:
        return self.core.engine_limits

    @property
    def generation_defaults(self) -> dict[str, Any]:
        """Sampling defaults from the model's generation_config.json."""
        return dict(self.core.model_config.generation_defaults)

    def default_sampling_params(self, **overrides: Any) -> SamplingParams:
        return SamplingParams(**{**self.generation_defaults, **overrides})

    def add_request(self, request_id: str, prompt: str | list[int], params: SamplingParams, *,
                    arrival_time: float | None = None, cache_salt: str | None = None, priority: int = 0,
                    lora_request: LoRARequest | None = None) -> None:
        """Queue a request. A string prompt is tokenized with special tokens; a list is token ids.
        Raises InvalidRequest (a ValueError) with a message fit for the client."""
        if isinstance(prompt, str):
            if not prompt:
                raise InvalidRequest("prompt is empty", param="prompt")
            prompt_text: str | None = prompt
            prompt_token_ids = self.tokenizer.encode(prompt)
        else:
            prompt_text = None
            prompt_token_ids = list(prompt)
        if self.config.role == "prefill":
            check_exportable(params)
        samples = self.core.add_request(request_id, prompt_token_ids, params, eos_token_ids=self.eos_token_ids,
                                        arrival_time=arrival_time, cache_salt=cache_salt, priority=priority,
                                        lora_request=lora_request)
        self.output_processor.add_request(request_id, prompt_text, samples)

    def add_lora(self, lora_request: LoRARequest) -> None:
        """Load a PEFT adapter under its name (InvalidRequest if bad or the name is taken)."""
        self.core.add_lora(lora_request)

    def remove_lora(self, name: str) -> None:
        """Unload an adapter (InvalidRequest model_not_found if unknown); running requests finish with it."""
        self.core.remove_lora(name)

    def list_loras(self) -> list[str]:
        return self.core.list_loras()

    def abort_request(self, request_ids: Iterable[str]) -> None:
        """Stop requests and free their blocks now; they are reported finished ("abort") by the next step()."""
        for request_id in request_ids:
            if self.core.abort_request([request_id]):
                delta = self.output_processor.finish_aborted(request_id)
                if delta is not None:
                    self._aborted.append(delta)
                self._forget(request_id)

    def step(self) -> list[RequestOutputDelta]:
        """Run one engine step; returns what each changed request gained in it."""
        deltas, self._aborted = self._aborted, []
        if self.core.has_unfinished_requests():
            progressed = self.core.step()
            for request_id, error in self.core.take_grammar_outcomes():
                if error is not None:  # its grammar failed: it never ran
                    self._forget(request_id)
                self._grammar_outcomes.append((request_id, error))
            changed, stopped = self.output_processor.process(progressed)
            if stopped:
                self.core.finish_samples(stopped, RequestStatus.FINISHED_STOPPED)
            for delta in changed:
                if delta.finished:
                    self._forget(delta.request_id)
            if self.config.role == "prefill":
                changed = self._export_prefilled(changed)
            deltas.extend(changed)
        return deltas

    def has_unfinished_requests(self) -> bool:
        return self.core.has_unfinished_requests() or bool(self._aborted)

    def is_waiting_for_grammar(self, request_id: str) -> bool:
        """A structured-output request accepted only once its grammar compiles (see step)."""
        return self.core.is_waiting_for_grammar(request_id)

    def take_grammar_outcomes(self) -> list[tuple[str, str | None]]:
        """Structured-output requests decided by the steps since the last call: (request id,
        None) when its grammar compiled and it was scheduled, (request id, message) when it
        failed (bad grammar or --structured-output-timeout); a failed one is already forgotten."""
        outcomes, self._grammar_outcomes = self._grammar_outcomes, []
        return outcomes

    def get_stats(self) -> EngineStats:
        return self.core.stats()

    def close(self) -> None:
        """Release what outlives the process otherwise (the disk KV tier's files, tensor-parallel workers)."""
        self.core.close()

    def on_worker_failure(self, callback: Callable[[str], None]) -> None:
        """Tensor parallelism: `callback(reason)` when a worker dies, even while idle."""
        self.core.on_worker_failure(callback)

    # ---- prefill/decode disaggregation (pagoda/engine/disaggregation.py) -----------------------

    def _export_prefilled(self, changed: list[RequestOutputDelta]) -> list[RequestOutputDelta]:
        """Role prefill: every request that has its first token and goes on is exported (its
        KV copied out, its blocks freed) and forgotten here; its deltas are not returned (the
        decode engine's output carries the first token too)."""
        kept = []
        for delta in changed:
            samples = self.core.requests.get(delta.request_id)
            if delta.finished or not samples or samples[0].is_finished:
                kept.append(delta)
                continue
            self._handoffs.append(self.core.handoffs.export(samples[0]))
            self._forget(delta.request_id)
        return kept

    def take_handoffs(self) -> list[KVHandoff]:
        """Role prefill: the requests exported by the steps since the last call."""
        handoffs, self._handoffs = self._handoffs, []
        return handoffs

    def send_handoff(self, handoff: KVHandoff, transport: str, address: str, timeout: float = 10.0) -> bool:
        """Ship an exported request to a decode engine's listener. False (counted as a send
        failure) if it did not arrive; this engine holds no block of it either way."""
        try:
            num_sent = send_handoff(handoff, transport, address, timeout)
        except TransferError:
            self.core.handoffs.stats.failures["send"] += 1
            return False
        self.core.handoffs.record_sent(handoff, num_sent)
        return True

    def add_prefilled_request(self, incoming: IncomingHandoff, *, fallback: bool = True,
                              arrival_time: float | None = None) -> bool:
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
            samples = self.core.add_request(header.request_id, header.prompt_token_ids, params,
                                            eos_token_ids=self.eos_token_ids, arrival_time=arrival_time,
                                            cache_salt=header.cache_salt, lora_request=lora, enqueue=False)
        except (InvalidRequest, TypeError) as error:  # TypeError: sampling params this version lacks
            incoming.reject(str(error))
            raise InvalidRequest(f"handed-off request {header.request_id!r}: {error}") from None
        request = samples[0]
        self.output_processor.add_request(header.request_id, None, samples)
        try:
            self.core.handoffs.import_request(incoming, request)
            return True
        except TransferError:
            if not fallback:
                self._forget(header.request_id)
                raise
        # Prefill here from the prompt (and the first token, if kept), as a preempted request recomputes.
        self.core.handoffs.stats.fallback_prefills += 1
        self.core.scheduler.add_request(request)
        return False

    def _forget(self, request_id: str) -> None:
        self.core.release(request_id)
        self.output_processor.remove(request_id)
