"""One engine replica as the router keeps it, and the outstanding tokens a request holds on it."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.engine.async_llm import AsyncLLM
from pagoda.outputs import RequestOutputDelta
from pagoda.replicas.supervisor import EngineSupervisor


@dataclass(eq=False)
class Replica:
    """One engine replica and the router's bookkeeping of it (touched on the event loop)."""

    index: int
    supervisor: EngineSupervisor  # holds the replica's engine, and restarts it when it dies
    pool: str | None = None
    role: str = "both"  # or prefill / decode (--replica-roles)
    outstanding_tokens: int = 0  # charged by routed requests, paid back as they progress
    num_requests: int = 0  # routed and not finished
    num_routed: int = 0  # since start
    num_moved_away: int = 0  # requests sent elsewhere after this replica died under them
    # Being scaled away: takes no new request, is stopped once those it has are done.
    draining: bool = False
    # The engine last seen dead: out of rotation until the supervisor swaps in a restarted one.
    seen_dead: AsyncLLM | None = None

    @property
    def llm(self) -> AsyncLLM:
        """The replica's engine now (a restart replaces it)."""
        return self.supervisor.llm

    @property
    def label(self) -> str:
        return str(self.index)

    @property
    def is_alive(self) -> bool:
        return self.llm.is_alive


class Flight:
    """The outstanding tokens one request holds on its replica."""

    def __init__(self, replica: Replica, prompt_tokens: int, output_tokens: int, *, awaiting_kv: bool = False) -> None:
        """`awaiting_kv`: a decode replica that receives the request's KV from a prefill replica."""
        self.replica = replica
        self.awaiting_kv = awaiting_kv
        self._prompt_tokens = prompt_tokens  # paid back at the first delta
        self._output_tokens = output_tokens  # paid back token by token
        replica.outstanding_tokens += prompt_tokens + output_tokens
        replica.num_requests += 1
        self._open = True

    def progress(self, delta: RequestOutputDelta) -> None:
        paid = self._prompt_tokens + min(self._output_tokens, sum(len(s.token_ids) for s in delta.outputs))
        self._output_tokens -= paid - self._prompt_tokens
        self._prompt_tokens = 0
        self.replica.outstanding_tokens -= paid

    def close(self) -> None:
        if self._open:
            self._open = False
            self.replica.outstanding_tokens -= self._prompt_tokens + self._output_tokens
            self.replica.num_requests -= 1
            self._prompt_tokens = self._output_tokens = 0
