"""SupervisedEngine: a server's single engine, restarted when it dies, as an EngineClient.

It answers through whichever AsyncLLM its supervisor (supervisor.py) holds now, so the server
keeps one client across restarts. While the engine is down requests are refused as by a dead
engine (there is no other replica to move them to); those it was serving fail with
EngineDeadError, as on any engine. A restarted engine loads the weights the latest update
brought (weights_source.py) before it serves.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Iterable
from typing import TYPE_CHECKING, Any

from pagoda.engine.client import EngineStream, generate_outputs
from pagoda.engine.engine_request import EngineRequest
from pagoda.lora_request import LoRARequest
from pagoda.outputs import RequestOutput
from pagoda.replicas.supervisor import EngineSupervisor, ModelFront
from pagoda.replicas.weights_source import WeightsSource
from pagoda.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda.engine.llm_engine import EngineStats


class SupervisedEngine(ModelFront):
    """The EngineClient of one engine that its supervisor restarts."""

    def __init__(self, supervisor: EngineSupervisor) -> None:
        super().__init__(supervisor.llm)
        self.supervisor = supervisor
        self.weights = WeightsSource()
        supervisor.weights = self.weights

    @property
    def is_alive(self) -> bool:
        return self.supervisor.llm.is_alive

    @property
    def error(self) -> BaseException | None:
        return None if self.is_alive else self.supervisor.llm.error

    def health(self) -> dict[str, Any]:
        """The engine's state: status ok, restarting (a restart is pending), failed (out of
        restarts) or dead, with its pid, restarts and error."""
        body = self.supervisor.state().as_dict()
        if body.get("status") == "ok" and self.sleep_level:
            body.update(status="asleep", sleep_level=self.sleep_level)
        return body

    def get_stats(self) -> EngineStats | None:
        return self.supervisor.llm.get_stats()

    def replica_stats(self) -> dict[str, EngineStats | None]:
        """Empty: one engine has no replicas (its metrics carry no replica label)."""
        return {}

    def validate(self, prompt_token_ids: list[int], params: SamplingParams) -> None:
        self.supervisor.llm.validate(prompt_token_ids, params)

    async def add_request(self, request: EngineRequest, *, wake: asyncio.Event | None = None) -> EngineStream:
        return await self.supervisor.llm.add_request(request, wake=wake)

    @property
    def sleep_level(self) -> int:
        return self.supervisor.llm.sleep_level

    async def engine_command(self, command: str, args: dict[str, Any] | None = None) -> None:
        """Run the command; a streamed weight update is also saved where a restart loads it from."""
        args = dict(args or {})
        if command == "update_weights" and self.supervisor.policy.enabled:
            args["snapshot"] = self.weights.next_snapshot()
        await self.supervisor.llm.engine_command(command, args)
        self.weights.record(command, args)

    def generate(self, request: EngineRequest) -> AsyncIterator[RequestOutput]:
        return generate_outputs(self, request)

    def abort(self, request_ids: Iterable[str]) -> None:
        self.supervisor.llm.abort(request_ids)

    @property
    def lora_names(self) -> list[str]:
        return self.supervisor.llm.lora_names

    async def add_lora(self, lora_request: LoRARequest) -> None:
        await self.supervisor.add_lora(lora_request)

    async def remove_lora(self, name: str) -> None:
        await self.supervisor.remove_lora(name)

    def shutdown(self, timeout: float | None = 10.0) -> None:
        self.supervisor.stop(timeout)
        self.weights.close()
