"""The server's guardrail hooks: the input check of every generation endpoint, the output
filter inside a Generation, decisions into /metrics and the request log.

Call sites (kept to a line or two each, marked `# guardrails hook`):
- handler.py `GenerationEndpoint.handle`: `guard_input` right after `prepare` (a block is a
  400 with code "content_filter"; redaction rewrites the prepared prompts, so the engine,
  echo and the log only see the redacted text), and `input_decision=` on the Generation.
- serving.py `Generation.start`: `guard_generation_output` (None when no output rule
  applies to the tenant); `Generation.deltas`: `GenerationOutputGuard.filter` rewrites each
  delta's text to what the filter released, before the delta is added to the prompt's
  output, so streamed chunks and non-streamed bodies read the same filtered text;
  `_log_record`: `guard_log_fields`.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, Protocol, TypeVar

from prometheus_client import CollectorRegistry

from pagoda.guard import Decision, GuardMetrics, Guardrails, GuardrailsConfig, OutputFilter
from pagoda.outputs import RequestOutputDelta
from pagoda.sampling_params import SamplingParams
from pagoda.serve.admission.tenants import Tenant
from pagoda.serve.errors import APIError, bad_request

CONTENT_FILTER = "content_filter"

logger = logging.getLogger(__name__)


def content_filtered(rule: str, param: str) -> APIError:
    """OpenAI's shape for a prompt refused by a content filter (Azure: code content_filter)."""
    return APIError(
        400,
        f"The prompt was blocked by the content filter (guardrail rule {rule!r}).",
        param=param,
        code=CONTENT_FILTER,
    )


class ServerGuard:
    """One app's guardrails and their metrics."""

    def __init__(self, config: GuardrailsConfig, registry: CollectorRegistry, model_name: str) -> None:
        self.guardrails = Guardrails(config)
        self.input = self.guardrails.input_guard()
        self.metrics = GuardMetrics(registry, model_name)
        logger.info(
            "guardrails from %s: rules %s; a failing guard model fails %s (%s); "
            "streamed output held back up to %d chars (pattern rules) / one %d-char "
            "window (classifier rules)",
            config.source,
            ", ".join(f"{r.name} ({r.kind}, {r.action})" for r in config.rules),
            config.fail_mode,
            "blocks" if config.fail_mode == "closed" else "allows",
            config.output_hold_chars,
            config.classifier_window_chars,
        )

    def _record_input(self, tenant: Tenant, decision: Decision, started: float, param: str) -> None:
        self.metrics.record_input_seconds(time.perf_counter() - started)
        for hit in decision.hits:
            self.metrics.record_hit(tenant.name, hit)
        if decision.blocked_by is not None:
            raise content_filtered(decision.blocked_by, param)


class GuardedPrompt(Protocol):
    """A prompt as the handlers hold it (serving.EnginePrompt)."""

    token_ids: list[int]
    text: str | None


class GuardedRequest(Protocol):
    """A prepared request as the input check reads it (handler.PreparedRequest)."""

    prompts: list[Any]
    messages: list[dict[str, Any]] | None
    render_messages: Callable[[list[dict[str, Any]]], Any] | None


PromptT = TypeVar("PromptT", bound=GuardedPrompt)
RequestT = TypeVar("RequestT", bound=GuardedRequest)


async def guard_input(
    guard: ServerGuard | None, tokenizer: Any, tenant: Tenant, prepared: RequestT
) -> tuple[RequestT, Decision | None]:
    """A prepared request through the tenant's input rules: chat requests as their messages
    (roles kept, the prompt rendered again when a message is redacted), other endpoints as
    each prompt's text. Raises the content_filter 400 on a block."""
    if guard is None or not guard.guardrails.rules_for(tenant.name, "input"):
        return prepared, None
    if prepared.messages is not None and prepared.render_messages is not None:
        messages, decision = await guard_chat_messages(guard, tenant, prepared.messages)
        if messages != prepared.messages:
            # Templating may take seconds for a huge conversation: off the event loop.
            prompt = await asyncio.to_thread(prepared.render_messages, messages)
            prepared = dataclasses.replace(
                prepared,
                messages=messages,  # type: ignore[type-var]
                prompts=[prompt],
            )
        return prepared, decision
    prompts, decision = await guard_completion_prompts(guard, tenant, prepared.prompts, tokenizer)
    return dataclasses.replace(prepared, prompts=prompts), decision  # type: ignore[type-var]


async def guard_completion_prompts(
    guard: ServerGuard, tenant: Tenant, prompts: list[PromptT], tokenizer: Any
) -> tuple[list[PromptT], Decision]:
    """Each prompt through the input rules; token-id prompts are checked as their text."""
    started = time.perf_counter()
    decision = Decision("")
    checked = []
    for prompt in prompts:
        text = prompt.text if prompt.text is not None else tokenizer.decode(prompt.token_ids)
        one = await guard.input.check(tenant.name, text)
        decision.merge(one)
        if decision.blocked:
            break
        if one.text != text:  # redacted: the engine gets the rewritten text
            prompt = dataclasses.replace(
                prompt,
                text=one.text,  # type: ignore[type-var]
                token_ids=tokenizer.encode(one.text, add_special_tokens=True),
            )
        checked.append(prompt)
    guard._record_input(tenant, decision, started, "prompt")
    return checked, decision


async def guard_chat_messages(
    guard: ServerGuard, tenant: Tenant, messages: list[dict[str, Any]]
) -> tuple[list[dict[str, Any]], Decision]:
    started = time.perf_counter()
    checked, decision = await guard.input.check_messages(tenant.name, messages)
    guard._record_input(tenant, decision, started, "messages")
    return checked, decision


@dataclass
class _SampleState:
    filter: OutputFilter
    first_text_time: float | None = None
    delay_recorded: bool = False
    ended: bool = False  # its finish_reason was released: later deltas are dropped


@dataclass
class GenerationOutputGuard:
    """The output filters of one HTTP request: one per (prompt, sample)."""

    guard: ServerGuard
    tenant: Tenant
    abort: Callable[[list[str]], None]
    _samples: dict[tuple[int, int], _SampleState] = field(default_factory=dict)

    def _state(self, prompt_index: int, sample_index: int) -> _SampleState:
        key = (prompt_index, sample_index)
        state = self._samples.get(key)
        if state is None:
            output_filter = self.guard.guardrails.output_filter(self.tenant.name)
            assert output_filter is not None  # only built when output rules apply
            output_filter.on_hit = lambda hit: self.guard.metrics.record_hit(self.tenant.name, hit)
            state = self._samples[key] = _SampleState(output_filter)
        return state

    async def filter(self, prompt_index: int, delta: RequestOutputDelta) -> RequestOutputDelta:
        """`delta` with each sample's text replaced by what the filter releases now; a blocked
        sample ends with "content_filter" (nothing of it is sent afterwards), and when every
        sample of the prompt has ended its engine request is aborted."""
        started = time.perf_counter()
        samples = []
        for sample in delta.outputs:
            state = self._state(prompt_index, sample.index)
            if state.ended:
                continue
            now = time.perf_counter()
            if sample.text and state.first_text_time is None:
                state.first_text_time = now
            released = await state.filter.feed(sample.text) if sample.text else ""
            if sample.finish_reason is not None:
                released += await state.filter.finish()
            if released and not state.delay_recorded and state.first_text_time is not None:
                state.delay_recorded = True
                self.guard.metrics.record_first_release_delay(time.perf_counter() - state.first_text_time)
            blocked = state.filter.blocked
            finish_reason = CONTENT_FILTER if blocked else sample.finish_reason
            state.ended = finish_reason is not None
            samples.append(
                dataclasses.replace(
                    sample,
                    text=released,
                    finish_reason=finish_reason,
                    stop_reason=None if blocked else sample.stop_reason,
                )
            )
        ended = sum(1 for (i, _), state in self._samples.items() if i == prompt_index and state.ended)
        finished = delta.finished or ended == delta.num_samples
        if finished and not delta.finished:
            self.abort([delta.request_id])  # every sample is blocked: stop generating
        self.guard.metrics.record_output_seconds(time.perf_counter() - started)
        return dataclasses.replace(delta, outputs=samples, finished=finished)

    def decisions(self) -> list[Decision]:
        return [state.filter.decision for state in self._samples.values()]


def guard_generation_output(
    guard: ServerGuard | None, abort: Callable[[list[str]], None], tenant: Tenant, params: SamplingParams
) -> GenerationOutputGuard | None:
    """The request's output guard (`abort` stops engine requests), or None when no output rule
    applies to `tenant`."""
    if guard is None or not guard.guardrails.rules_for(tenant.name, "output"):
        return None
    if params.logprobs is not None:
        raise bad_request(
            "logprobs are not available while output guardrails apply to this "
            "key: they would reveal text the guardrails hold back, redact or "
            "block.",
            param="logprobs",
        )
    return GenerationOutputGuard(guard, tenant, abort)


def guard_log_fields(input_decision: Decision | None, output_guard: GenerationOutputGuard | None) -> dict[str, Any]:
    """The request log's record of the guardrails: which rules fired, never the text."""
    decisions = ([input_decision] if input_decision is not None else []) + (
        output_guard.decisions() if output_guard is not None else []
    )
    counts: dict[tuple[str, str, str, str | None], int] = {}
    for hit in (hit for decision in decisions for hit in decision.hits):
        key = (hit.rule, hit.action, hit.stage, hit.label)
        counts[key] = counts.get(key, 0) + hit.count
    fields: dict[str, Any] = {}
    if counts:
        fields["guardrails"] = [
            {"rule": rule, "action": action, "stage": stage, "count": count, **({"label": label} if label else {})}
            for (rule, action, stage, label), count in counts.items()
        ]
    blocked = [d.blocked_by for d in decisions if d.blocked_by]
    if blocked:
        fields["blocked_by"] = blocked[0]
    return fields
