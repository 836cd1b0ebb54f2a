"""ServerSettings: the HTTP side's knobs (the engine's are in EngineConfig)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from pagoda.serve.latency_targets import LatencyTargets
from pagoda.serve.request_limits import RequestLimits
from pagoda.serve.tenants import TenantRegistry

if TYPE_CHECKING:
    from pagoda.guard import GuardrailsConfig

DEFAULT_MAX_REQUEST_BYTES = 8 * 2**20
DEFAULT_MAX_QUEUED_REQUESTS = 512
DEFAULT_MAX_QUEUED_TOKENS = 1_000_000


@dataclass
class ServerSettings:
    served_model_name: str
    model_path: str = ""
    tenants: TenantRegistry = field(default_factory=TenantRegistry.open)
    max_request_bytes: int = DEFAULT_MAX_REQUEST_BYTES
    max_queued_requests: int | None = DEFAULT_MAX_QUEUED_REQUESTS
    max_queued_tokens: int | None = DEFAULT_MAX_QUEUED_TOKENS
    log_prompts: bool = False
    latency_targets: LatencyTargets | None = None
    request_limits: RequestLimits = field(default_factory=RequestLimits)
    metrics_compat: str = "none"  # or "vllm": every series also under vllm: names
    tool_call_parser: str = "hermes"  # pagoda/serve/tool_calls.py PARSERS
    guardrails: "GuardrailsConfig | None" = None  # --guardrails FILE, loaded
    allow_runtime_lora: bool = False  # POST /v1/load_lora_adapter and /v1/unload_lora_adapter (admin keys)

    def __post_init__(self) -> None:
        if self.metrics_compat not in ("none", "vllm"):
            raise ValueError(f"metrics_compat must be none or vllm, got {self.metrics_compat!r}")
        if self.max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be >= 1, got {self.max_request_bytes}")
        for name in ("max_queued_requests", "max_queued_tokens"):
            value = getattr(self, name)
            if value is not None and value < 1:
                raise ValueError(f"{name} must be >= 1, got {value}")
