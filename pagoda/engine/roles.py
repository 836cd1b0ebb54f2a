"""Engine roles (`--role`): both, prefill, decode. Torch-free: the server's front checks it."""

from __future__ import annotations

from pagoda.config import EngineConfig

def require_both_role(config: EngineConfig, front: str) -> None:
    """The offline LLM and the server run whole requests: a prefill or decode engine needs a
    router between two engines, which hands requests and KV over (not built yet)."""
    if config.role != "both":
        raise ValueError(f"role {config.role} is not supported by {front} yet: prefill/decode engines are "
                         f"paired by the disaggregated router; use role both (the engine-level API is "
                         f"LLMEngine.take_handoffs / send_handoff / add_prefilled_request)")
