"""EngineStepOutput: everything one `LLMEngine.step()` reports, in one typed value.

The engine records what happened to each request since the previous step (adds accepted or
refused, grammars compiled or failed, aborts, KV handoffs ended) in the output it is building,
and `step()` returns it with the step's deltas. It is the only channel from the engine to its
driver: the offline `LLM` reads it directly, and every transport carries it unchanged to
`AsyncLLM`, which routes each field to the request's stream. The process transport sends it
through its pipe as typed msgpack (engine/transport/encoding.py): its fields stay plain values.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.outputs import RequestOutputDelta


@dataclass
class HandoffOutcome:
    """How a prefill engine's request left it: handed off to its decode engine (sent), or why
    not. Either way the request and its blocks are gone from that engine."""

    sent: bool
    reason: str | None = None


@dataclass
class EngineStepOutput:
    """What the engine reports after one step, per request id. A request's acceptance (or
    refusal) comes before its first delta; a refused request gets nothing else."""

    deltas: list[RequestOutputDelta] = field(default_factory=list)
    # Adds accepted: at once, or (structured output) once the request's grammar compiled. Also
    # control requests (a LoRA load or unload) answered under their control id.
    accepted: list[str] = field(default_factory=list)
    # Adds (or control requests) refused, and structured-output requests whose grammar failed:
    # the error the caller sees. The engine holds nothing of them.
    refused: dict[str, BaseException] = field(default_factory=dict)
    # Role prefill: requests handed off (or not) to their decode engine since the last step.
    handoffs: dict[str, HandoffOutcome] = field(default_factory=dict)

    @property
    def finished(self) -> set[str]:
        """The requests this output ends: finished by a delta, refused, or handed off."""
        ended = {delta.request_id for delta in self.deltas if delta.finished}
        return ended | self.refused.keys() | self.handoffs.keys()
