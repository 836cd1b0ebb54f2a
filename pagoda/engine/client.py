"""EngineClient: what a server asks of whatever serves one model, and what rides with a request.

`AsyncLLM` (one engine) and `replicas.ReplicaSet` (replicas of one model behind a router) both
are one, so the HTTP layer is written once against this protocol and never learns how many
engines answer it. A request is one `EngineRequest` (engine/engine_request.py), the same object
for every client: a client that has no use for part of it (one engine and the route hints)
ignores that part.

Arguments that only a router gives its own replicas (disaggregation's handoff target,
`awaiting_kv`) stay off the protocol: they are AsyncLLM's keyword arguments.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from pagoda.engine.engine_request import EngineRequest
from pagoda.engine.request_stream import StreamRoute
from pagoda.engine.transport import EngineDeadError
from pagoda.lora_request import LoRARequest
from pagoda.outputs import OutputAccumulator, RequestOutput, RequestOutputDelta

if TYPE_CHECKING:
    from pagoda.config import EngineConfig
    from pagoda.engine.llm_engine import EngineStats
    from pagoda.engine.max_num_seqs import MaxNumSeqsChoice
    from pagoda.model.classifier_config import ClassifierConfig
    from pagoda.sampling_params import SamplingParams
    from pagoda.tokenizer import Tokenizer

__all__ = [
    "EngineAsleepError",
    "EngineClient",
    "EngineDeadError",
    "EngineRequest",
    "EngineStream",
    "StreamRoute",
    "generate_outputs",
]


class EngineAsleepError(RuntimeError):
    """The engine sleeps (POST /sleep): requests are refused until it wakes up."""


class EngineStream(Protocol):
    """One request's deltas as its client reads them (engine/request_stream.py PolledStream)."""

    request_id: str
    finished: bool  # the finishing delta has been read

    # Read-only in the protocol: a router's stream computes it (failover moves the request).
    @property
    def route(self) -> StreamRoute | None:
        """The replica serving the request now; None behind one engine."""
        ...

    def poll(self) -> RequestOutputDelta | None:
        """What the request gained since the last read, or None; raises if it failed."""
        ...

    async def get(self) -> RequestOutputDelta:
        """The next delta, waiting for one if none is pending."""
        ...

    def __aiter__(self) -> AsyncIterator[RequestOutputDelta]: ...


class EngineClient(Protocol):
    """The engine front a server holds: requests in, deltas out, its state and adapters."""

    config: EngineConfig  # with --max-num-seqs as the engine resolved it
    tokenizer: Tokenizer
    max_model_len: int
    weights_digest: str | None  # the weights' verified manifest digest (--verify-manifest), else None
    generation_defaults: dict  # sampling defaults from the model's generation_config.json
    classifier: ClassifierConfig | None  # the model's classifier head (scoring), None for a plain LM
    transport: str  # where the engine runs: "thread", "process", ...
    kv_pool_memory: str  # the KV pool's bytes and where they come from (pagoda.core.kv_memory)

    # Read-only in the protocol, so a client that always resolves it may hold the narrower type.
    @property
    def max_num_seqs_choice(self) -> MaxNumSeqsChoice | None:
        """--max-num-seqs as resolved, and why."""
        ...

    @property
    def is_alive(self) -> bool:
        """Accepting requests."""
        ...

    @property
    def error(self) -> BaseException | None:
        """What stopped the engine, once it is not alive."""
        ...

    def health(self) -> dict[str, Any]:
        """The /health body: "status" ("dead" once not alive, with "error") and what else the
        client reports of itself."""
        ...

    def get_stats(self) -> EngineStats | None:
        """The latest stats of the whole (summed over replicas)."""
        ...

    def replica_stats(self) -> dict[str, EngineStats | None]:
        """Each replica's latest stats by its label; empty when there are no replicas."""
        ...

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        """Raise InvalidRequest if the engine would refuse this request."""
        ...

    async def add_request(self, request: EngineRequest, *, wake: asyncio.Event | None = None) -> EngineStream:
        """Submit a request; returns its stream once it was accepted. Raises InvalidRequest or
        EngineDeadError. `wake` is set whenever the stream has something new (share one across
        streams to wait on several)."""
        ...

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        """The request's whole output so far after each step read (generate_outputs)."""
        ...

    def abort(self, request_ids: Iterable[str]) -> None:
        """Stop requests; their streams get nothing more."""
        ...

    @property
    def lora_names(self) -> list[str]:
        """The adapters loaded."""
        ...

    async def add_lora(self, lora_request: LoRARequest) -> None:
        """Load an adapter; raises InvalidRequest with the reason it was refused."""
        ...

    async def remove_lora(self, name: str) -> None:
        """Unload an adapter; InvalidRequest if it is not loaded."""
        ...

    @property
    def sleep_level(self) -> int:
        """0 awake; 1 (KV pool released) or 2 (weights too) asleep."""
        ...

    async def engine_command(self, command: str, args: dict[str, Any] | None = None) -> None:
        """Run an engine command (engine/commands.py: weight updates, pause and resume, sleep and
        wake_up) on every engine, or on none (a replica set stages a weight update on all before
        committing on any); raises InvalidRequest with the reason it was refused."""
        ...

    def shutdown(self, timeout: float | None = 10.0) -> None: ...


async def generate_outputs(client: EngineClient, request: EngineRequest) -> AsyncIterator[RequestOutput]:
    """Submit a request to `client` and yield its whole output so far after each delta the
    consumer reads (independent copies); the request is aborted if the consumer stops early."""
    stream = await client.add_request(request)
    outputs = OutputAccumulator()
    try:
        async for delta in stream:
            yield outputs.add(delta).snapshot()
    finally:
        if not stream.finished:
            client.abort([request.request_id])
