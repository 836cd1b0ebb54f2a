"""LLMEngine: the synchronous engine in text terms — tokenizer + EngineCore + output processing.

Not thread-safe: one thread drives it (LLM offline, or AsyncLLM's engine thread or process for
the server). `step()` returns one RequestOutputDelta per request that changed.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable
from typing import Any

from pagoda.config import EngineConfig
from pagoda.engine.engine_core import EngineCore, EngineStats
from pagoda.engine.output_processor import OutputProcessor
from pagoda.engine.validation import EngineLimits
from pagoda.errors import InvalidRequest
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

    def _forget(self, request_id: str) -> None:
        self.core.release(request_id)
        self.output_processor.remove(request_id)
