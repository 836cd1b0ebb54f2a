"""The path of a generation request from the handler to the engine and back.

`ServeContext` is everything one app owns (engine front, tenants, limits, metrics, logs).
`ServeContext.admit` is the first, cheap half of admission: from the body alone (how many
sequences: prompts x n) it takes the tenant's concurrency and rate limits and the queue's
sequence slots, or refuses at once, before any tokenizing. `Generation` is one HTTP request's
engine requests (one per prompt) from there to the end: it checks them (the engine's own
request checks), charges their tokens (the tenant's token quota, the queue's token limit),
submits them, yields their deltas while building each prompt's whole output (for usage, the
log line and non-streamed answers), and on `close` releases every hold, aborts what is still
running, records metrics and writes the request's log line. `close` is idempotent and must
run on every path. The endpoints drive it through the skeleton in handler.py.
"""

from __future__ import annotations

import asyncio
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass, field

from pagoda.engine.client import EngineAsleepError, EngineClient, EngineDeadError, EngineRequest, EngineStream
from pagoda.errors import InvalidRequest
from pagoda.guard import Decision
from pagoda.lora_request import LoRARequest
from pagoda.media.decode import ImageLimits
from pagoda.media.inputs import MediaInputs
from pagoda.media.sources import FetchPolicy
from pagoda.media_item import MediaItem
from pagoda.outputs import RequestOutput, RequestOutputDelta
from pagoda.sampling_params import SamplingParams
from pagoda.serve.admission.queue import AdmissionController, QueueSlot
from pagoda.serve.admission.tenants import Tenant, TenantLease, TenantLimiter
from pagoda.serve.admission.work import RequestWork
from pagoda.serve.api.protocol import PromptTokensDetails, Usage
from pagoda.serve.errors import APIError, engine_unavailable, invalid_request, model_asleep
from pagoda.serve.guardrails import GenerationOutputGuard, ServerGuard, guard_generation_output, guard_log_fields
from pagoda.serve.metrics.cost import CostCounter
from pagoda.serve.metrics.server import ServerMetrics
from pagoda.serve.observability.prompt_log import PromptLog
from pagoda.serve.observability.provenance import ModelProvenance, Provenance, ProvenanceBook
from pagoda.serve.observability.request_log import RequestLogger, RequestLogRecord
from pagoda.serve.observability.tracing import RequestTrace, RequestTracer
from pagoda.serve.settings import ServerSettings

# HTTP status logged for requests whose client went away (nginx's convention).
CLIENT_CLOSED_REQUEST = 499


@dataclass
class ServerLogs:
    """What every model of one server writes to: the request log, the prompt log
    (--log-prompts, a listener of the request log) and the span exporter (--otlp-traces-endpoint)."""

    request_log: RequestLogger
    prompt_log: PromptLog | None = None
    tracer: RequestTracer | None = None

    @classmethod
    def create(cls, settings: ServerSettings) -> ServerLogs:
        logs = cls(RequestLogger())
        if settings.log_prompts:
            logs.prompt_log = PromptLog.from_settings(
                str(settings.prompt_log_directory),
                1.0 if settings.prompt_log_sample is None else settings.prompt_log_sample,
                settings.prompt_log_retention_s,
                settings.guardrails,
            )
            logs.request_log.add_listener(logs.prompt_log.record)
        if settings.otlp_traces_endpoint is not None:
            logs.tracer = RequestTracer.otlp(settings.otlp_traces_endpoint)
        return logs


@dataclass
class ServeContext:
    llm: EngineClient
    settings: ServerSettings
    limiter: TenantLimiter
    admission: AdmissionController
    metrics: ServerMetrics
    request_log: RequestLogger
    provenance: ProvenanceBook
    guard: ServerGuard | None = None  # --guardrails
    prompt_log: PromptLog | None = None  # --log-prompts
    tracer: RequestTracer | None = None  # --otlp-traces-endpoint
    cost: CostCounter | None = None  # --price-table
    aliases: tuple[str, ...] = ()  # more names clients may call the model by
    media: MediaInputs = field(default_factory=lambda: MediaInputs(None))  # image parts (pagoda.media)

    @classmethod
    def create(
        cls,
        llm: EngineClient,
        settings: ServerSettings,
        *,
        limiter: TenantLimiter | None = None,
        logs: ServerLogs | None = None,
        aliases: tuple[str, ...] = (),
    ) -> ServeContext:
        """One model's context; the models of one server share `limiter` (tenant limits are
        the server's) and `logs`."""
        logs = logs or ServerLogs.create(settings)
        name = settings.served_model_name
        assert name is not None, "launch names the served model before its context is built"
        ctx = cls(
            llm=llm,
            settings=settings,
            aliases=aliases,
            limiter=limiter or TenantLimiter(),
            admission=AdmissionController(
                settings.max_queued_requests,
                settings.max_queued_tokens,
                settings.latency_targets,
                max_model_len=llm.max_model_len,
            ),
            metrics=ServerMetrics(
                name,
                llm.get_stats,
                compat=settings.metrics_compat,
                replica_stats=llm.replica_stats,
                tenant_labels=settings.metrics_tenant_labels,
                health=llm.health,
            ),
            request_log=logs.request_log,
            prompt_log=logs.prompt_log,
            tracer=logs.tracer,
            provenance=ProvenanceBook(
                ModelProvenance.of(
                    llm, name, guardrails=settings.guardrails is not None, guardrails_file=settings.guardrails_file
                )
            ),
        )
        ctx.media = media_inputs(llm, settings)
        for name, path in llm.config.lora_module_paths():  # --lora-modules, loaded with the engine
            ctx.provenance.adapter_loaded(name, path)
        if settings.prices is not None:
            ctx.cost = CostCounter(ctx.metrics.registry)
        if settings.guardrails is not None:  # guardrails hook
            ctx.guard = ServerGuard(settings.guardrails, ctx.metrics.registry, ctx.model_name)
        return ctx

    @property
    def model_name(self) -> str:
        name = self.settings.served_model_name
        assert name is not None, "create() checked the served model's name"
        return name

    def answers_to(self, name: str) -> bool:
        """Whether `name` is this model's served name or one of its aliases."""
        return name == self.model_name or name in self.aliases

    def check_engine(self) -> None:
        if not self.llm.is_alive:
            raise engine_unavailable()

    def admit(self, tenant: Tenant, work: RequestWork) -> Admission:
        """Hold the tenant's and the queue's room for `work`'s sequences, or raise the APIError
        that refuses it. Cheap and lock-free: it runs before the request is tokenized."""
        self.check_engine()
        lease = self.limiter.acquire(tenant, work)
        try:
            slots = self.admission.reserve(work)
        except APIError:
            lease.release()
            raise
        return Admission(self.admission, lease, slots)

    def check_text_fits(self, text: str, param: str) -> None:
        """Refuse, without tokenizing, a text whose token count provably exceeds the context."""
        at_least = self.llm.tokenizer.min_num_tokens(text)
        if at_least > self.llm.max_model_len:
            raise invalid_request(
                InvalidRequest(
                    f"This model's maximum context length is {self.llm.max_model_len} tokens; the "
                    f"{param} ({len(text)} characters) is at least {at_least} tokens.",
                    param=param,
                    code="context_length_exceeded",
                )
            )


@dataclass
class Admission:
    """One HTTP request's holds: its tenant lease and its queue slots (one per prompt)."""

    controller: AdmissionController
    lease: TenantLease
    slots: list[QueueSlot]

    def charge_tokens(self, work: RequestWork, prompt_token_counts: list[int]) -> None:
        """The second half of admission, once the prompts are tokenized: reserve the estimated
        tokens from the tenant's quota and queue the prompt tokens, or raise a 400 / 429 / 503."""
        self.lease.reserve_tokens(work)
        self.controller.charge_tokens(self.slots, prompt_token_counts)

    def release(self, used_tokens: int = 0) -> None:
        """Let go of every hold (idempotent); `used_tokens` settles the token reservation."""
        for slot in self.slots:
            slot.leave()
        self.lease.release(used_tokens)


@dataclass
class EnginePrompt:
    token_ids: list[int]
    text: str | None = None  # as the client sent it, when it was text
    media: tuple[MediaItem, ...] = ()  # its images, placeholders expanded in token_ids (pagoda.media)


def media_inputs(llm: EngineClient, settings: ServerSettings) -> MediaInputs:
    """How this model's requests take images: its image processor when it is a vision-language
    model, the server's image caps and fetch policy."""
    limits = ImageLimits(settings.max_image_bytes, settings.max_image_pixels, settings.max_images_per_request)
    fetch = FetchPolicy(tuple(settings.allowed_media_domains), settings.max_image_bytes, settings.media_fetch_timeout)
    return MediaInputs.for_model(llm.config.model, limits, fetch)


def new_request_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


_REJECT_REASONS = {
    400: "invalid_request",
    401: "unauthorized",
    404: "model_not_found",
    413: "too_large",
    429: "rate_limited",
    503: "overloaded",
}


def rejection_reason(error: APIError) -> str:
    if error.code in ("engine_dead", "content_filter"):
        return error.code
    return _REJECT_REASONS.get(error.status, str(error.status))


@dataclass
class Generation:
    ctx: ServeContext
    request_id: str
    endpoint: str
    tenant: Tenant
    prompts: list[EnginePrompt]
    params: SamplingParams
    stream: bool
    admission: Admission  # from ServeContext.admit; the Generation releases it in close
    arrival_time: float = field(default_factory=time.time)
    input_decision: Decision | None = None  # the input guardrails' decision, if any
    lora_request: LoRARequest | None = None  # the LoRA adapter `model` named (None: the base model)
    trace_headers: dict[str, str] = field(default_factory=dict)  # the client's traceparent / tracestate
    route: str | None = None  # how the request reached this model (x-pagoda-route)
    priority: int | None = None  # the request's scheduling priority (None: the tenant's)
    # One entry per submitted prompt: its stream, its output so far, and its final output.
    streams: list[EngineStream] = field(default_factory=list, init=False)
    latest: list[RequestOutput | None] = field(default_factory=list, init=False)
    finals: list[RequestOutput | None] = field(default_factory=list, init=False)
    _itl_marks: list[tuple[float, int] | None] = field(default_factory=list, init=False)
    _wake: asyncio.Event = field(default_factory=asyncio.Event, init=False)
    _closed: bool = field(default=False, init=False)
    # Recorded once the prompts are submitted (the route is known), again at close.
    provenance: Provenance | None = field(default=None, init=False)
    _output_guard: GenerationOutputGuard | None = field(default=None, init=False)
    # Read ahead by `first_delta`, and the reader it was read from.
    _read_ahead: list[tuple[int, RequestOutputDelta]] = field(default_factory=list, init=False)
    _reader: AsyncIterator[tuple[int, RequestOutputDelta]] | None = field(default=None, init=False)

    @property
    def engine_request_ids(self) -> list[str]:
        return [f"{self.request_id}-{i}" for i in range(len(self.prompts))]

    @property
    def model_name(self) -> str:
        """What the client asked for: the served model or a LoRA adapter's name."""
        return self.lora_request.lora_name if self.lora_request is not None else self.ctx.model_name

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(p.token_ids) for p in self.prompts)

    @property
    def work(self) -> RequestWork:
        """What this request may cost: its sequences, prompt tokens and output limits."""
        max_model_len = self.ctx.llm.max_model_len
        max_output = sum(
            self.params.max_tokens if self.params.max_tokens is not None else max_model_len - len(p.token_ids)
            for p in self.prompts
        )
        return RequestWork(len(self.prompts), self.params.num_sequences, self.num_prompt_tokens, max_output)

    async def start(self, param_names: dict[str, str] | None = None) -> None:
        """Admit and submit every prompt, or raise the APIError that refused it (and close).

        `param_names` renames the engine's parameter names in errors into the endpoint's
        (chat: the prompt is "messages")."""
        ctx = self.ctx
        try:
            ctx.check_engine()
            for prompt in self.prompts:
                self.tenant.check_prompt_tokens(len(prompt.token_ids))
                try:
                    ctx.llm.validate(prompt.token_ids, self.params)
                except InvalidRequest as exc:
                    raise invalid_request(exc, param_names) from None
            self._output_guard = guard_generation_output(  # guardrails hook
                ctx.guard, ctx.llm.abort, self.tenant, self.params
            )
            self.admission.charge_tokens(self.work, [len(p.token_ids) for p in self.prompts])
            priority = self.tenant.limits.priority if self.priority is None else self.priority
            requests = [
                EngineRequest(
                    request_id,
                    prompt.token_ids,
                    self.params,
                    arrival_time=self.arrival_time,
                    cache_salt=self.tenant.cache_salt,
                    priority=priority,
                    lora_request=self.lora_request,
                    tenant=self.tenant.name,
                    model=self.model_name,
                    media=prompt.media,
                )
                for request_id, prompt in zip(self.engine_request_ids, self.prompts)
            ]
            # All prompts are sent at once (in order) and their acceptances awaited together:
            # one engine round trip per batch, not one per prompt (sequential submits of a large
            # batch wait on the busy engine once per prompt).
            submitted = await asyncio.gather(
                *(ctx.llm.add_request(request, wake=self._wake) for request in requests), return_exceptions=True
            )
            for stream in submitted:
                if not isinstance(stream, BaseException):  # accepted: close() aborts it on error
                    self.streams.append(stream)
                    self.latest.append(None)
                    self.finals.append(None)
                    self._itl_marks.append(None)
            self._record_provenance()
            for outcome in submitted:
                if isinstance(outcome, InvalidRequest):
                    raise invalid_request(outcome, param_names) from None
                if isinstance(outcome, EngineDeadError):
                    raise engine_unavailable() from None
                if isinstance(outcome, EngineAsleepError):
                    raise model_asleep(str(outcome)) from None
                if isinstance(outcome, BaseException):
                    raise outcome
        except APIError as exc:
            self.close(exc.status, error=exc)
            raise
        except asyncio.CancelledError:
            # Cancelled inside the gather, prompts already accepted are not in self.streams
            # yet (close() aborts only those): abort every id not recorded there.
            ctx.llm.abort(self.engine_request_ids[len(self.streams) :])
            self.close(CLIENT_CLOSED_REQUEST)
            raise
        except BaseException:
            self.close(500)
            raise

    async def first_delta(self) -> None:
        """Wait until the first delta arrived, without consuming it (`deltas` yields it first):
        raises the APIError that failed the request before its first token, while the request
        can still go elsewhere."""
        self._reader = self._reader or self._read_deltas()
        async for item in self._reader:
            self._read_ahead.append(item)
            return

    async def deltas(self) -> AsyncIterator[tuple[int, RequestOutputDelta]]:
        """(prompt index, what it gained) as they arrive, until every prompt is finished.
        `latest[i]` is prompt i's whole output so far, already including the delta."""
        reader = self._reader or self._read_deltas()
        while self._read_ahead:
            yield self._read_ahead.pop(0)
        async for item in reader:
            yield item

    async def _read_deltas(self) -> AsyncIterator[tuple[int, RequestOutputDelta]]:
        wake = self._wake
        metrics = self.ctx.metrics
        while not all(self.finals):
            wake.clear()
            got_any = False
            for i, stream in enumerate(self.streams):
                if self.finals[i] is not None:
                    continue
                try:
                    delta = stream.poll()
                except EngineDeadError:
                    raise engine_unavailable("The engine stopped while serving the request.") from None
                if delta is None:
                    continue
                got_any = True
                if self._output_guard is not None:  # guardrails hook
                    delta = await self._output_guard.filter(i, delta)
                output = self.latest[i]
                if output is None:
                    self.admission.slots[i].leave()
                    output = self.latest[i] = RequestOutput.from_delta(delta)
                    if output.metrics is not None and output.metrics.time_to_first_token is not None:
                        self.ctx.admission.observe_first_token(output.metrics.time_to_first_token)
                else:
                    output.add(delta)
                self._itl_marks[i] = _record_inter_token(self.ctx, self._itl_marks[i], output)
                if output.finished:
                    self.finals[i] = output
                    reason = _finish_reason(output)
                    metrics.record_finished(
                        reason,
                        output.metrics,
                        num_prompt_tokens=len(self.prompts[i].token_ids),
                        num_generation_tokens=sum(len(c.token_ids) for c in output.outputs),
                    )
                yield i, delta
            if not got_any:
                await wake.wait()

    def usage(self) -> Usage:
        outputs = [o for o in self.latest if o is not None]
        prompt_tokens = self.num_prompt_tokens
        completion_tokens = sum(len(c.token_ids) for o in outputs for c in o.outputs)
        cached = sum(o.num_cached_tokens for o in outputs)
        return Usage(
            prompt_tokens=prompt_tokens,
            completion_tokens=completion_tokens,
            total_tokens=prompt_tokens + completion_tokens,
            prompt_tokens_details=PromptTokensDetails(cached_tokens=cached),
        )

    def close(self, status: int, error: APIError | None = None) -> None:
        if self._closed:
            return
        self._closed = True
        ctx = self.ctx
        unfinished = [s.request_id for s, final in zip(self.streams, self.finals) if final is None]
        if unfinished:
            ctx.llm.abort(unfinished)
            if error is None:  # the client went away; an error is counted under its reason below
                for _ in unfinished:
                    ctx.metrics.record_finished("abort", None)
        usage = self.usage() if self.streams else None
        self.admission.release(usage.total_tokens if usage else 0)
        if self.streams:  # a failover may have moved a prompt since it was submitted
            self._record_provenance()
        if error is not None:
            ctx.metrics.record_rejected(rejection_reason(error))
            error.recorded = True
        record = self._log_record(status, error, usage)
        ctx.request_log.log(record)
        if ctx.tracer is not None:
            ctx.tracer.record(self._trace(record))

    def _trace(self, record: RequestLogRecord) -> RequestTrace:
        outputs = [o for o in self.latest if o is not None]
        return RequestTrace(
            request_id=self.request_id,
            provenance_id=self.provenance.id if self.provenance is not None else self.request_id,
            endpoint=self.endpoint,
            model=self.model_name,
            tenant=self.tenant.name,
            status=record.status,
            params=self.params,
            arrival_time=self.arrival_time,
            end_time=time.time(),
            timings=[o.metrics for o in outputs if o.metrics is not None],
            prompt_tokens=record.prompt_tokens,
            completion_tokens=record.output_tokens,
            cached_tokens=record.cached_tokens,
            num_sequences=sum(len(o.outputs) for o in outputs),
            finish_reasons=record.finish_reason.split(",") if record.finish_reason else [],
            error_code=record.error_code,
            headers=self.trace_headers,
        )

    def _log_record(self, status: int, error: APIError | None, usage: Usage | None) -> RequestLogRecord:
        outputs = [o for o in self.latest if o is not None]
        record = RequestLogRecord(
            request_id=self.request_id,
            endpoint=self.endpoint,
            tenant=self.tenant.name,
            model=self.model_name,
            status=status,
            stream=self.stream,
            prompt_tokens=self.num_prompt_tokens,
            output_tokens=usage.completion_tokens if usage else 0,
            cached_tokens=usage.prompt_tokens_details.cached_tokens if usage else 0,
            e2e_s=time.time() - self.arrival_time,
            error=error.message if error is not None else None,
            error_param=error.param if error is not None else None,
            error_code=error.code if error is not None else None,
        )
        reasons = sorted({c.finish_reason for o in outputs for c in o.outputs if c.finish_reason})
        if error is not None and not all(self.finals):
            # What ended the samples that had not finished (engine_dead: the engine died under them).
            reasons = sorted({*reasons, error.code or "error"})
        elif status == CLIENT_CLOSED_REQUEST:
            reasons = ["abort"]
        record.finish_reason = ",".join(reasons) or None
        timings = [o.metrics for o in outputs if o.metrics is not None]
        queue_times = [m.queue_time for m in timings if m.queue_time is not None]
        ttfts = [m.time_to_first_token for m in timings if m.time_to_first_token is not None]
        record.queue_time_s = max(queue_times) if queue_times else None
        record.ttft_s = min(ttfts) if ttfts else None
        record.prompt = [p.text if p.text is not None else str(p.token_ids) for p in self.prompts]
        record.output = [c.text for o in outputs for c in o.outputs]
        record.extra.update(guard_log_fields(self.input_decision, self._output_guard))  # guardrails hook
        if self.lora_request is not None:
            record.extra["lora_adapter"] = self.lora_request.lora_name
            record.extra["base_model"] = self.ctx.model_name
        if self.route is not None:
            record.extra["route"] = self.route
        if self.provenance is not None:
            record.provenance = self.provenance.as_dict()
        record.cost_usd = self._charge(usage)
        return record

    def _record_provenance(self) -> None:
        adapter = self.lora_request.lora_name if self.lora_request is not None else None
        self.provenance = self.ctx.provenance.record(
            self.request_id, adapter, [stream.route for stream in self.streams], self.route
        )

    def _charge(self, usage: Usage | None) -> float | None:
        """The request's cost by --price-table, counted in the cost metric (None without a
        table, or for a model it does not price). An adapter runs at its base model's price."""
        prices = self.ctx.settings.prices
        if prices is None or usage is None:
            return None
        cost = prices.cost(
            self.ctx.model_name, usage.prompt_tokens, usage.completion_tokens, usage.prompt_tokens_details.cached_tokens
        )
        if cost is not None and self.ctx.cost is not None:
            self.ctx.cost.add(self.ctx.model_name, self.tenant.name, cost)
        return cost


def _finish_reason(output: RequestOutput) -> str:
    reasons = [c.finish_reason for c in output.outputs if c.finish_reason]
    return reasons[0] if reasons else "abort"


def _record_inter_token(
    ctx: ServeContext, mark: tuple[float, int] | None, output: RequestOutput
) -> tuple[float, int] | None:
    """Observe the gaps between the tokens generated since `mark` (time, tokens so far).

    Uses the engine's timestamps, so outputs the consumer never saw separately (collapsed
    while it was busy) still count: k tokens that took t seconds are k gaps of t / k.
    """
    timing = output.metrics
    if timing is None or timing.first_token_time is None or timing.last_token_time is None:
        return mark
    num_tokens = max((len(c.token_ids) for c in output.outputs), default=0)
    since, counted = mark if mark is not None else (timing.first_token_time, 1)
    if num_tokens > counted:
        ctx.metrics.record_inter_token(timing.last_token_time - since, num_tokens - counted)
        ctx.admission.observe_inter_token(timing.last_token_time - since, num_tokens - counted)
        return timing.last_token_time, num_tokens
    return since, counted
