"""LLMEngine: the synchronous engine in text terms — tokenizer + EngineCore + output processing.

Not thread-safe: one thread drives it (LLM offline, or AsyncLLM's engine thread or process for
the server). `step()` returns one RequestOutputDelta per request that changed.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
from typing import Any

from pagoda.config import EngineConfig
from pagoda.engine.disaggregation import check_exportable, sampling_params_from_dict
from pagoda.engine.engine_core import EngineCore, EngineStats
from pagoda.engine.output_processor import OutputProcessor
from pagoda.engine.roles import HandoffTarget
from pagoda.engine.transport.messages import HandoffOutcome
from pagoda.engine.validation import EngineLimits
from pagoda.errors import InvalidRequest
from pagoda.kv_transfer.handoff import HandoffRefused, IncomingHandoff, KVHandoff, TransferError, send_handoff
from pagoda.kv_transfer.handoff_threads import HandoffThreads, HeaderArrived, Received, Sent
from pagoda.lora_request import LoRARequest
from pagoda.outputs import RequestOutputDelta
from pagoda.request import Request, RequestStatus
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
        self._handoffs: list[KVHandoff] = []  # role prefill: exported without a target, not yet taken
        # ---- disaggregation under a router (see the section below) ----
        self._handoff_threads: HandoffThreads | None = None
        self._targets: dict[str, HandoffTarget] = {}  # role prefill: where each request goes
        self._outcomes: list[tuple[str, HandoffOutcome]] = []  # role prefill: not yet taken
        self._awaiting: dict[str, Request] = {}  # role decode: waiting for their KV, no header yet
        # role decode: blocks being written by a receive thread: (incoming, request, skip, started)
        self._receiving: dict[str, tuple[IncomingHandoff, Request, int, float]] = {}
        self._aborted_receiving: set[str] = set()
        if config.role != "both":
            self._handoff_threads = HandoffThreads()
        if config.role == "decode":
            self._handoff_threads.listen(config.kv_transport, _listen_address(config), config.kv_transfer_timeout)

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
                    lora_request: LoRARequest | None = None, handoff: HandoffTarget | None = None,
                    awaiting_kv: bool = False) -> None:
        """Queue a request. A string prompt is tokenized with special tokens; a list is token ids.
        Raises InvalidRequest (a ValueError) with a message fit for the client.

        Disaggregation: a prefill engine sends the request and its KV to `handoff` once it has
        its first token; a decode engine holds an `awaiting_kv` request until that arrives (or
        prefill_locally is called)."""
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
        elif handoff is not None:
            raise InvalidRequest(f"a KV handoff target was given to a {self.config.role}-role engine")
        if awaiting_kv and self.config.role != "decode":
            raise InvalidRequest(f"a {self.config.role}-role engine does not receive KV handoffs")
        samples = self.core.add_request(request_id, prompt_token_ids, params, eos_token_ids=self.eos_token_ids,
                                        arrival_time=arrival_time, cache_salt=cache_salt, priority=priority,
                                        lora_request=lora_request, enqueue=not awaiting_kv)
        self.output_processor.add_request(request_id, prompt_text, samples)
        if handoff is not None:
            self._targets[request_id] = handoff
        if awaiting_kv:
            self._awaiting[request_id] = samples[0]

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
            if request_id in self._receiving:
                # A receive thread is writing its blocks: they are freed once it ends.
                self._aborted_receiving.add(request_id)
                continue
            self._awaiting.pop(request_id, None)
            self.core.handoffs.drop_ready(request_id)  # then aborted like a waiting request
            if self.core.abort_request([request_id]):
                delta = self.output_processor.finish_aborted(request_id)
                if delta is not None:
                    self._aborted.append(delta)
                self._forget(request_id)

    def step(self) -> list[RequestOutputDelta]:
        """Run one engine step; returns what each changed request gained in it."""
        if self._handoff_threads is not None:
            self._apply_handoff_events()
            self.core.handoffs.admit_ready()
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
        """Work for step(): scheduled requests, aborts to report, or KV handoff events."""
        return (self.core.has_unfinished_requests() or bool(self._aborted) or bool(self.core.handoffs.ready)
                or (self._handoff_threads is not None and self._handoff_threads.has_events()))

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
        """Release what outlives the process otherwise (the disk KV tier's files, tensor-parallel
        workers, a decode engine's KV listener)."""
        if self._handoff_threads is not None:
            self._handoff_threads.close()
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
            handoff = self.core.handoffs.export(samples[0])
            target = self._targets.pop(delta.request_id, None)
            if target is None:
                self._handoffs.append(handoff)  # the engine-level API: the caller sends it
            else:
                handoff.header.request_id = target.request_id  # the decode engine's id for it
                self._handoff_threads.send(delta.request_id, handoff, target.transport, target.address,
                                           target.timeout)
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

    # ---- disaggregation under a router: the handoff threads' events, applied between steps ----

    @property
    def kv_address(self) -> str | None:
        """Role decode: where prefill engines send KV handoffs."""
        return self._handoff_threads.address if self._handoff_threads is not None else None

    def set_wake(self, wake: Callable[[], None]) -> None:
        """`wake()` (from another thread) whenever a KV handoff event awaits step()."""
        if self._handoff_threads is not None:
            self._handoff_threads.set_wake(wake)

    def take_handoff_outcomes(self) -> list[tuple[str, HandoffOutcome]]:
        """Role prefill: requests whose handoff to their target ended since the last call
        (sent or failed); they are gone from this engine either way."""
        outcomes, self._outcomes = self._outcomes, []
        return outcomes

    def prefill_locally(self, request_ids: Iterable[str]) -> None:
        """Role decode: stop awaiting these requests' KV and prefill them here. A request whose
        KV is already arriving finishes its import (or falls back by itself if that fails)."""
        for request_id in request_ids:
            request = self._awaiting.pop(request_id, None)
            if request is not None:
                self.core.handoffs.stats.fallback_prefills += 1
                self.core.scheduler.add_request(request)

    def _apply_handoff_events(self) -> None:
        for event in self._handoff_threads.take_events():
            if isinstance(event, HeaderArrived):
                self._begin_receive(event.incoming)
            elif isinstance(event, Received):
                self._end_receive(event)
            elif isinstance(event, Sent):
                self._sent(event)

    def _begin_receive(self, incoming: IncomingHandoff) -> None:
        request_id = incoming.header.request_id
        request = self._awaiting.pop(request_id, None)
        if request is None:  # aborted, prefilled here after a timeout, or never announced
            self.core.handoffs.stats.failures["refused"] += 1
            incoming.reject(f"request {request_id!r} is not awaiting a KV handoff here")
            return
        started = time.perf_counter()
        try:
            skip = self.core.handoffs.begin_import(incoming, request)
        except TransferError:  # refused (identity, no free blocks): nothing is held; prefill here
            self.core.handoffs.stats.fallback_prefills += 1
            self.core.scheduler.add_request(request)
            return
        self._receiving[request_id] = (incoming, request, skip, started)
        self._handoff_threads.receive(incoming, request_id, skip,
                                      lambda indices, data: self.core.handoffs.write_blocks(request, indices, data))

    def _end_receive(self, event: Received) -> None:
        incoming, request, skip, started = self._receiving.pop(event.request_id)
        if event.request_id in self._aborted_receiving:
            self._aborted_receiving.discard(event.request_id)
            self.abort_request([event.request_id])  # frees the blocks the receive wrote
            return
        if event.error is not None:
            self.core.handoffs.abandon_import(request)
            self.core.handoffs.stats.fallback_prefills += 1
            self.core.scheduler.add_request(request)  # recompute prompt (and first token) here
            return
        self.core.handoffs.finish_import(incoming, request, skip, started)

    def _sent(self, event: Sent) -> None:
        if event.error is None:
            self.core.handoffs.record_sent(event.handoff, event.num_sent)
            outcome = HandoffOutcome(True)
        else:
            kind = "refused" if isinstance(event.error, HandoffRefused) else "send"
            self.core.handoffs.stats.failures[kind] += 1
            outcome = HandoffOutcome(False, str(event.error))
        self._outcomes.append((event.request_id, outcome))

    def _forget(self, request_id: str) -> None:
        self._targets.pop(request_id, None)
        self._awaiting.pop(request_id, None)
        self.core.release(request_id)
        self.output_processor.remove(request_id)


def _listen_address(config: EngineConfig) -> str | None:
    """A decode engine's KV listener: --kv-listen, else loopback (every interface with Ray,
    whose prefill replicas may run on other nodes); shm picks a socket path itself."""
    if config.kv_transport != "tcp":
        return None
    if config.kv_listen is not None:
        return config.kv_listen
    return "0.0.0.0:0" if config.distributed_executor_backend == "ray" else "127.0.0.1:0"
