"""AsyncLLM: an LLMEngine driven by its own thread or process, with an asyncio front.

The engine is synchronous and not thread-safe, so exactly one thread ever touches it; a
transport (pagoda/engine/transport/) runs it and carries add/abort messages there and each
step's results back. This front routes those results to per-request streams
(request_stream.py) on the callers' event loops, one `call_soon_threadsafe` per loop per step.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from collections import defaultdict
from collections.abc import AsyncIterator, Callable, Iterable
from dataclasses import replace
from functools import partial
from typing import TYPE_CHECKING, Any

from pagoda.config import EngineConfig
from pagoda.engine.client import EngineAsleepError, generate_outputs
from pagoda.engine.engine_request import EngineRequest
from pagoda.engine.request_stream import RequestStream, deliver_all
from pagoda.engine.roles import HandoffTarget
from pagoda.engine.step_output import EngineStepOutput
from pagoda.engine.transport import AbortRequests, AddRequest, EngineDeadError, TransportKind, create_transport
from pagoda.engine.transport.base import EngineFactory, TransportStarter
from pagoda.engine.transport.messages import EngineCommand, PrefillLocally, UpdateLoRA
from pagoda.engine.validation import EngineLimits, check_request_id_free, validate_request
from pagoda.lora_request import LoRARequest
from pagoda.model.classifier_config import ClassifierConfig
from pagoda.outputs import RequestOutput
from pagoda.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda.engine.llm_engine import EngineStats

logger = logging.getLogger(__name__)

PAUSED_POLL_S = 0.005  # how often a request held by a pause looks for the resume

__all__ = ["AsyncLLM", "EngineDeadError", "RequestStream"]


class AsyncLLM:
    """asyncio front of one LLMEngine running on its own thread or in its own process: the
    EngineClient of one engine."""

    def __init__(
        self,
        config: EngineConfig,
        *,
        transport: TransportKind | TransportStarter = "thread",
        engine_factory: EngineFactory | None = None,
        startup_timeout: float | None = None,
    ) -> None:
        """`engine_factory` builds the engine instead of LLMEngine(config); on the process
        transport it must be a module-level function or class (the engine process imports it by
        name). `transport` may also be a TransportStarter: a transport from elsewhere (a replica
        as a Ray actor)."""
        if not callable(transport) and transport not in ("thread", "process"):
            raise ValueError(f"transport must be 'thread' or 'process', got {transport!r}")
        self.config = config
        self._streams: dict[str, RequestStream] = {}
        self._lock = threading.Lock()  # guards _streams, _error and _stopped
        self._error: BaseException | None = None
        self._stopped = False
        self._paused = False
        self._sleep_level = 0
        if callable(transport):
            self._transport = transport(
                config, engine_factory, self._on_emitted, self._on_death, startup_timeout=startup_timeout
            )
        else:
            self._transport = create_transport(
                transport, config, engine_factory, self._on_emitted, self._on_death, startup_timeout=startup_timeout
            )
        self.transport: str = self._transport.kind
        info = self._transport.info
        self._stats: EngineStats = info.stats
        self.tokenizer = self._transport.tokenizer
        self.max_model_len: int = info.max_model_len
        self.generation_defaults: dict = info.generation_defaults
        self.classifier: ClassifierConfig | None = info.classifier
        self.engine_limits: EngineLimits = info.engine_limits
        # --max-num-seqs as the engine resolved it (its default is measured at startup).
        self.max_num_seqs_choice = info.max_num_seqs_choice
        self.kv_pool_memory: str = info.kv_pool_memory  # the KV pool's bytes and why
        self.kv_address: str | None = info.kv_address  # role decode: its KV listener
        self.weights_digest: str | None = info.weights_digest  # verified at load, else None
        if config.max_num_seqs is None:
            self.config = replace(config, max_num_seqs=info.max_num_seqs_choice.value)

    # ---- public API ----------------------------------------------------------------------------

    @property
    def is_alive(self) -> bool:
        return self._error is None and not self._stopped and self._transport.is_alive()

    @property
    def error(self) -> BaseException | None:
        return self._error

    def health(self) -> dict[str, Any]:
        """ok, or dead with the error that stopped the engine; and the engine's pid."""
        if self.is_alive:
            if self._sleep_level:
                return {"status": "asleep", "pid": self.engine_pid, "sleep_level": self._sleep_level}
            return {"status": "ok", "pid": self.engine_pid}
        return {"status": "dead", "pid": self.engine_pid, "error": repr(self.error)}

    def get_stats(self) -> EngineStats | None:
        return self._stats

    def replica_stats(self) -> dict[str, EngineStats | None]:
        """Empty: one engine has no replicas (its metrics carry no replica label)."""
        return {}

    @property
    def engine_pid(self) -> int | None:
        """The engine's process (this one on the thread transport; None for a Ray actor)."""
        return self._transport.engine_pid

    @property
    def lora_names(self) -> list[str]:
        """Adapters the engine has loaded (as of its last step or LoRA update)."""
        stats = self._stats
        lora = getattr(stats, "lora", None)
        return list(lora.loaded_adapters) if lora is not None else []

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter between engine steps; raises InvalidRequest with the reason."""
        await self._update_lora(UpdateLoRA("", lora_request))

    async def remove_lora(self, name: str) -> None:
        """Unload an adapter (running requests finish with it); InvalidRequest if unknown."""
        await self._update_lora(UpdateLoRA("", LoRARequest(name), unload=True))

    async def _update_lora(self, message: UpdateLoRA) -> None:
        message.control_id = f"lora-update-{uuid.uuid4().hex}"
        await self._control(message)

    # ---- engine commands: weight updates, pause, sleep (engine/commands.py) ----------------

    @property
    def sleep_level(self) -> int:
        """0 awake; 1 or 2 asleep (requests are refused with EngineAsleepError)."""
        return self._sleep_level

    @property
    def paused(self) -> bool:
        """New requests wait (in add_request) until resume."""
        return self._paused

    async def engine_command(self, command: str, args: dict[str, Any] | None = None) -> None:
        """Run one of engine/commands.py's commands between engine steps; raises InvalidRequest
        with the reason it was refused. Pause holds new requests here until resume; sleep refuses
        them until wake_up."""
        args = dict(args or {})
        if command == "pause":
            self._paused = True  # held from now on, while the engine stops what is in flight
        try:
            await self._control(EngineCommand(f"command-{uuid.uuid4().hex}", command, args))
        except BaseException:
            if command == "pause":
                self._paused = False
            raise
        if command == "resume":
            self._paused = False
        elif command == "sleep":
            self._sleep_level = int(args.get("level", 1))
        elif command == "wake_up":
            self._sleep_level = 0

    async def _control(self, message: UpdateLoRA | EngineCommand) -> None:
        # Answered like an add: ACCEPTED or the refusal, on a stream of its own.
        stream = RequestStream(message.control_id, asyncio.get_running_loop())
        with self._lock:
            if self._error is not None or self._stopped:
                raise EngineDeadError("the engine is not running") from self._error
            self._streams[message.control_id] = stream
        self._transport.send(message)
        try:
            await stream.wait_accepted()
        finally:
            with self._lock:
                self._streams.pop(message.control_id, None)

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequest if the engine would refuse this request (the engine's own
        check, run here so a caller can refuse it before queueing it)."""
        validate_request(prompt_token_ids, params, self.engine_limits)

    async def add_request(
        self,
        request: EngineRequest,
        *,
        wake: asyncio.Event | None = None,
        handoff: HandoffTarget | None = None,
        awaiting_kv: bool = False,
    ) -> RequestStream:
        """Submit a request; returns its stream once the engine accepted it (EngineClient).

        Raises InvalidRequest (a ValueError) or EngineDeadError. The request's route hints mean
        nothing to one engine. `handoff` and `awaiting_kv`: see LLMEngine.add_request
        (disaggregation, used by the router).
        """
        while self._paused and not self._sleep_level:  # until resume (a pause is short: a weight update)
            await asyncio.sleep(PAUSED_POLL_S)
        if self._sleep_level:
            raise EngineAsleepError(f"the model is asleep (level {self._sleep_level}): POST /wake_up first")
        request_id = request.request_id
        stream = RequestStream(request_id, asyncio.get_running_loop(), wake)
        with self._lock:
            if self._error is not None or self._stopped:
                raise EngineDeadError("the engine is not running") from self._error
            check_request_id_free(request_id, self._streams)
            self._streams[request_id] = stream
        # Sent after registering: once the engine has died, whatever is registered is failed.
        self._transport.send(AddRequest(request, handoff, awaiting_kv))
        try:
            await stream.wait_accepted()
        except asyncio.CancelledError:
            self.abort([request_id])
            raise
        return stream

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """The request's whole output so far, after each step the consumer reads (independent
        copies); the request is aborted if the consumer stops early."""
        return generate_outputs(self, request)

    def abort(self, request_ids: Iterable[str]) -> None:
        """Stop requests; their streams get nothing more and the engine frees their blocks."""
        ids = list(request_ids)
        with self._lock:
            for request_id in ids:
                self._streams.pop(request_id, None)
            running = self._error is None and not self._stopped
        if ids and running:
            self._transport.send(AbortRequests(ids))

    def prefill_locally(self, request_ids: Iterable[str]) -> None:
        """Role decode: stop awaiting these requests' KV; the engine prefills them itself."""
        ids = list(request_ids)
        with self._lock:
            running = self._error is None and not self._stopped
        if ids and running:
            self._transport.send(PrefillLocally(ids))

    def shutdown(self, timeout: float | None = 10.0) -> None:
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
        self._transport.shutdown(timeout)
        self._fail_all(EngineDeadError("the engine was shut down"))

    # ---- engine side -> streams (runs on a transport's thread) ---------------------------------

    def _on_emitted(self, output: EngineStepOutput, stats: EngineStats) -> None:
        """Route one step's output to its streams: acceptances and refusals first, then deltas,
        then handoff outcomes."""
        self._stats = stats
        by_loop: dict[asyncio.AbstractEventLoop, list[Callable[[], None]]] = defaultdict(list)
        with self._lock:
            streams = self._streams  # a request missing here was aborted by its consumer
            for request_id in output.accepted:
                if (stream := streams.get(request_id)) is not None:
                    by_loop[stream.loop].append(stream.accept)
            for request_id, error in output.refused.items():
                if (stream := streams.get(request_id)) is not None:
                    by_loop[stream.loop].append(partial(stream.fail, error))
            for delta in output.deltas:
                if (stream := streams.get(delta.request_id)) is not None:
                    by_loop[stream.loop].append(partial(stream.deliver, delta))
            for request_id, outcome in output.handoffs.items():
                if (stream := streams.get(request_id)) is not None:
                    by_loop[stream.loop].append(partial(stream.hand_off, outcome))
            for request_id in output.finished:  # nothing more comes for these
                streams.pop(request_id, None)
        _schedule(by_loop)

    def _on_death(self, error: BaseException) -> None:
        with self._lock:
            if self._error is None and not self._stopped:
                self._error = error
                logger.error("the engine stopped: %s", error)
        self._fail_all(EngineDeadError(f"the engine stopped: {error}"))

    def _fail_all(self, error: BaseException) -> None:
        with self._lock:
            streams, self._streams = list(self._streams.values()), {}
        by_loop: dict[asyncio.AbstractEventLoop, list[Callable[[], None]]] = defaultdict(list)
        for stream in streams:
            by_loop[stream.loop].append(partial(stream.fail, error))
        _schedule(by_loop)


def _schedule(by_loop: dict[asyncio.AbstractEventLoop, list[Callable[[], None]]]) -> None:
    for loop, calls in by_loop.items():
        try:
            loop.call_soon_threadsafe(deliver_all, calls)
        except RuntimeError:
            pass  # that event loop is closed; nobody is listening
