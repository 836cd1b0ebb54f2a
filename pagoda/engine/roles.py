"""Engine roles (`--role`): both, prefill, decode, and where a prefill engine sends a request's
KV. Torch-free: the server's front reads it."""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.config import EngineConfig


@dataclass(frozen=True)
class HandoffTarget:
    """Where a prefill engine hands one request off: a decode engine's KV listener, and the id
    under which that engine awaits the request (its own id for it, chosen by the router)."""

    transport: str  # tcp or shm (pagoda.kv_transfer.handoff.TRANSPORTS)
    address: str  # the decode engine's listener: host:port, or a Unix socket path for shm
    request_id: str
    timeout: float = 10.0  # seconds any one transfer operation may wait


def require_both_role(config: EngineConfig, front: str) -> None:
    """The offline LLM runs whole requests: a prefill or decode engine only makes sense beside
    its partner, paired by the router of a server started with --replica-roles."""
    if config.role != "both":
        raise ValueError(
            f"role {config.role} is not supported by {front}: prefill and decode engines are "
            f"paired by the router; serve with --replica-roles prefill=P,decode=D (the "
            f"engine-level API is LLMEngine.kv_connector.take_handoffs / send_handoff and "
            f"LLMEngine.add_prefilled_request)"
        )
