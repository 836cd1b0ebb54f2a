"""The server's guardrail hooks: input checks in the handlers, the output filter inside a
Generation, decisions into /metrics and the request log.

Call sites (kept to a line or two each, marked `# guardrails hook`):
- chat.py / completions.py: `guard_chat_messages` / `guard_completion_prompts` before
  tokenizing (a block is a 400 with code "content_filter"; redaction rewrites the prompt,
  so the engine, echo and the log only see the redacted text), and `input_decision=` on
  the Generation.
- serving.py `Generation.start`: `guard_generation_output` (None when no output rule
  applies to the tenant); `Generation.outputs`: `GenerationOutputGuard.filter` rewrites
  each output's text to what the filter released; `_log_record`: `guard_log_fields`.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable

from prometheus_client import CollectorRegistry

from pagoda.guard import Decision, GuardMetrics, Guardrails, GuardrailsConfig, OutputFilter
from pagoda.outputs import CompletionOutput, RequestOutput
from pagoda.sampling_params import SamplingParams
from pagoda.serve.errors import APIError, bad_request
from pagoda.serve.tenants import Tenant

if TYPE_CHECKING:
    from pagoda.serve.serving import EnginePrompt, ServeContext

CONTENT_FILTER = "content_filter"

logger = logging.getLogger(__name__)


def content_filtered(rule: str, param: str) -> APIError:
    """OpenAI's shape for a prompt refused by a content filter (Azure: code content_filter)."""
    return APIError(400, f"The prompt was blocked by the content filter (guardrail rule "
                         f"{rule!r}).", param=param, code=CONTENT_FILTER)


class ServerGuard:
    """One app's guardrails and their metrics."""

    def __init__(self, config: GuardrailsConfig, registry: CollectorRegistry,
                 model_name: str) -> None:
        self.guardrails = Guardrails(config)
        self.input = self.guardrails.input_guard()
        self.metrics = GuardMetrics(registry, model_name)
        logger.info("guardrails from %s: rules %s; a failing guard model fails %s (%s); "
                    "streamed output held back up to %d chars (pattern rules) / one %d-char "
                    "window (classifier rules)", config.source,
                    ", ".join(f"{r.name} ({r.kind}, {r.action})" for r in config.rules),
                    config.fail_mode, "blocks" if config.fail_mode == "closed" else "allows",
                    config.output_hold_chars, config.classifier_window_chars)

    def _record_input(self, tenant: Tenant, decision: Decision, started: float,
                      param: str) -> None:
        self.metrics.record_input_seconds(time.perf_counter() - started)
        for hit in decision.hits:
            self.metrics.record_hit(tenant.name, hit)
        if decision.blocked_by is not None:
            raise content_filtered(decision.blocked_by, param)


async def guard_completion_prompts(ctx: "ServeContext", tenant: Tenant,
                                   prompts: list["EnginePrompt"], tokenizer: Any
                                   ) -> tuple[list["EnginePrompt"], Decision | None]:
    """Each prompt through the input rules; token-id prompts are checked as their text."""
    guard: ServerGuard | None = ctx.guard
    if guard is None or not guard.guardrails.rules_for(tenant.name, "input"):
        return prompts, None
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
            prompt = dataclasses.replace(prompt, text=one.text, token_ids=tokenizer.encode(
                one.text, add_special_tokens=True))
        checked.append(prompt)
    guard._record_input(tenant, decision, started, "prompt")
    return checked, decision


async def guard_chat_messages(ctx: "ServeContext", tenant: Tenant,
                              messages: list[dict[str, str]]
                              ) -> tuple[list[dict[str, str]], Decision | None]:
    guard: ServerGuard | None = ctx.guard
    if guard is None or not guard.guardrails.rules_for(tenant.name, "input"):
        return messages, None
    started = time.perf_counter()
    checked, decision = await guard.input.check_messages(tenant.name, messages)
    guard._record_input(tenant, decision, started, "messages")
    return checked, decision


@dataclass
class _SampleState:
    filter: OutputFilter
    raw_chars: int = 0  # characters of the engine's text fed to the filter
    released: str = ""
    first_text_time: float | None = None
    delay_recorded: bool = False
    final: CompletionOutput | None = None


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
            output_filter.on_hit = lambda hit: self.guard.metrics.record_hit(self.tenant.name,
                                                                             hit)
            state = self._samples[key] = _SampleState(output_filter)
        return state

    async def filter(self, prompt_index: int, output: RequestOutput) -> RequestOutput:
        """`output` with each sample's text replaced by what the filter released so far
        (cumulative, like the engine's); a blocked sample ends with "content_filter", and
        when every sample of the request has ended its engine request is aborted."""
        started = time.perf_counter()
        samples = []
        for sample in output.outputs:
            state = self._state(prompt_index, sample.index)
            if state.final is not None:
                samples.append(state.final)
                continue
            delta = sample.text[state.raw_chars:]
            state.raw_chars = len(sample.text)
            now = time.perf_counter()
            if delta and state.first_text_time is None:
                state.first_text_time = now
            released = await state.filter.feed(delta) if delta else ""
            if sample.finish_reason is not None:
                released += await state.filter.finish()
            state.released += released
            if released and not state.delay_recorded and state.first_text_time is not None:
                state.delay_recorded = True
                self.guard.metrics.record_first_release_delay(
                    time.perf_counter() - state.first_text_time)
            finish_reason = CONTENT_FILTER if state.filter.blocked else sample.finish_reason
            rewritten = dataclasses.replace(sample, text=state.released,
                                            finish_reason=finish_reason)
            if finish_reason is not None:
                state.final = rewritten
            samples.append(rewritten)
        finished = output.finished or all(s.finish_reason is not None for s in samples)
        if finished and not output.finished:
            self.abort([output.request_id])  # every sample is blocked: stop generating
        self.guard.metrics.record_output_seconds(time.perf_counter() - started)
        return dataclasses.replace(output, outputs=samples, finished=finished)

    def decisions(self) -> list[Decision]:
        return [state.filter.decision for state in self._samples.values()]


def guard_generation_output(ctx: "ServeContext", tenant: Tenant,
                            params: SamplingParams) -> GenerationOutputGuard | None:
    """The request's output guard, or None when no output rule applies to `tenant`."""
    guard: ServerGuard | None = ctx.guard
    if guard is None or not guard.guardrails.rules_for(tenant.name, "output"):
        return None
    if params.logprobs is not None:
        raise bad_request("logprobs are not available while output guardrails apply to this "
                          "key: they would reveal text the guardrails hold back, redact or "
                          "block.", param="logprobs")
    return GenerationOutputGuard(guard, tenant, ctx.llm.abort)


def guard_log_fields(input_decision: Decision | None,
                     output_guard: GenerationOutputGuard | None) -> dict[str, Any]:
    """The request log's record of the guardrails: which rules fired, never the text."""
    decisions = ([input_decision] if input_decision is not None else []) + \
        (output_guard.decisions() if output_guard is not None else [])
    counts: dict[tuple[str, str, str, str | None], int] = {}
    for hit in (hit for decision in decisions for hit in decision.hits):
        key = (hit.rule, hit.action, hit.stage, hit.label)
        counts[key] = counts.get(key, 0) + hit.count
    fields: dict[str, Any] = {}
    if counts:
        fields["guardrails"] = [
            {"rule": rule, "action": action, "stage": stage, "count": count,
             **({"label": label} if label else {})}
            for (rule, action, stage, label), count in counts.items()]
    blocked = [d.blocked_by for d in decisions if d.blocked_by]
    if blocked:
        fields["blocked_by"] = blocked[0]
    return fields
