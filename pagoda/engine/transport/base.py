"""The interface both transports implement, and what the engine reports when it is up."""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from pagoda.config import EngineConfig
from pagoda.engine.step_output import EngineStepOutput
from pagoda.engine.transport.messages import ToEngine
from pagoda.engine.validation import EngineLimits
from pagoda.model.classifier_config import ClassifierConfig

if TYPE_CHECKING:
    from pagoda.engine.llm_engine import EngineStats, LLMEngine
    from pagoda.engine.max_num_seqs import MaxNumSeqsChoice
    from pagoda.tokenizer import Tokenizer

EngineFactory = Callable[[EngineConfig], "LLMEngine"]
# Every step's output, as the engine returned it, with the engine's stats after that step.
OnEmitted = Callable[[EngineStepOutput, "EngineStats"], None]
OnDeath = Callable[[BaseException], None]
# Starts a transport: (config, engine factory, on_emitted, on_death, *, startup_timeout).
TransportStarter = Callable[..., "EngineTransport"]


class EngineDeadError(RuntimeError):
    """The engine has stopped; no request can be served any more."""


@dataclass
class EngineInfo:
    """What the front learns once the engine is built (the process transport's `Ready`)."""

    max_model_len: int
    engine_limits: EngineLimits
    generation_defaults: dict[str, Any]
    classifier: ClassifierConfig | None  # the model's classifier head, for scoring
    stats: EngineStats
    max_num_seqs_choice: MaxNumSeqsChoice  # the value in use and why
    kv_pool_memory: str  # the KV pool's bytes and where they come from (pagoda.core.kv_memory)
    kv_address: str | None  # role decode: where prefill engines send KV handoffs
    weights_digest: str | None  # the verified manifest's digest (--verify-manifest), else None

    @classmethod
    def of(cls, engine: LLMEngine) -> EngineInfo:
        return cls(
            max_model_len=engine.max_model_len,
            engine_limits=engine.engine_limits,
            generation_defaults=engine.generation_defaults,
            classifier=engine.classifier,
            stats=engine.get_stats(),
            max_num_seqs_choice=engine.core.max_num_seqs_choice,
            kv_pool_memory=engine.core.kv_pool_memory,
            kv_address=engine.kv_connector.kv_address,
            weights_digest=engine.core.weights_digest,
        )


class EngineTransport(ABC):
    """Runs an engine away from the event loop and carries messages both ways.

    The constructor starts the engine and returns once it is ready (or raises). Afterwards
    `send` never blocks; every step's results arrive through `on_emitted` and an engine that
    dies is reported once through `on_death`, both called from a thread of the transport.
    """

    info: EngineInfo
    tokenizer: Tokenizer
    kind: str  # "thread", "process", ...: where the engine runs, in words

    def __init__(self, config: EngineConfig, on_emitted: OnEmitted, on_death: OnDeath) -> None:
        self.config = config
        self._on_emitted = on_emitted
        self._on_death = on_death

    @abstractmethod
    def send(self, message: ToEngine) -> None:
        """Queue a message for the engine (returns at once)."""

    @abstractmethod
    def is_alive(self) -> bool:
        """Whether the engine's thread or process is still running."""

    @property
    def engine_pid(self) -> int | None:
        """The process the engine runs in, where it is a local process (None for a Ray actor)."""
        return None

    @abstractmethod
    def shutdown(self, timeout: float | None) -> None:
        """Ask the engine to stop and wait for it (a process is killed after `timeout`)."""
