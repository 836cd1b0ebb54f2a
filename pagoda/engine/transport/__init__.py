"""How AsyncLLM reaches an engine that runs beside the event loop: two transports (a thread of
this process, or a spawned process) behind one small interface, the messages they carry to the
engine (each step's EngineStepOutput comes back unchanged), and the engine loop both run."""

from pagoda.config import EngineConfig, TransportKind
from pagoda.engine.transport.base import (
    EngineDeadError,
    EngineFactory,
    EngineInfo,
    EngineTransport,
    OnDeath,
    OnEmitted,
)
from pagoda.engine.transport.messages import AbortRequests, AddRequest, Shutdown


def create_transport(
    kind: TransportKind,
    config: EngineConfig,
    factory: EngineFactory | None,
    on_emitted: OnEmitted,
    on_death: OnDeath,
    *,
    startup_timeout: float | None = None,
) -> EngineTransport:
    """Start an engine on a transport of that kind; returns once the engine is ready."""
    if kind == "thread":
        from pagoda.engine.transport.thread import ThreadTransport

        return ThreadTransport(config, factory, on_emitted, on_death, startup_timeout=startup_timeout)
    if kind == "process":
        from pagoda.engine.transport.process import ProcessTransport

        return ProcessTransport(config, factory, on_emitted, on_death, startup_timeout=startup_timeout)
    raise ValueError(f"transport must be 'thread' or 'process', got {kind!r}")


__all__ = [
    "AbortRequests",
    "AddRequest",
    "EngineDeadError",
    "EngineInfo",
    "EngineTransport",
    "Shutdown",
    "TransportKind",
    "create_transport",
]
