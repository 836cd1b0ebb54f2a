"""How AsyncLLM reaches an engine that runs beside the event loop: two transports (a thread of
this process, or a spawned process) behind one small interface, the messages they carry, and
the engine loop both run."""

from pagoda.engine.transport.base import EngineDeadError, EngineInfo, EngineTransport, TransportKind
from pagoda.engine.transport.messages import ACCEPTED, AbortRequests, AddRequest, Emitted, Shutdown


def create_transport(kind: TransportKind, *args, **kwargs) -> EngineTransport:
    """The transport of that kind (see ThreadTransport / ProcessTransport for the arguments)."""
    if kind == "thread":
        from pagoda.engine.transport.thread import ThreadTransport

        return ThreadTransport(*args, **kwargs)
    if kind == "process":
        from pagoda.engine.transport.process import ProcessTransport

        return ProcessTransport(*args, **kwargs)
    raise ValueError(f"transport must be 'thread' or 'process', got {kind!r}")


__all__ = ["ACCEPTED", "AbortRequests", "AddRequest", "Emitted", "EngineDeadError", "EngineInfo",
           "EngineTransport", "Shutdown", "TransportKind", "create_transport"]
