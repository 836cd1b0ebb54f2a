"""The skeleton every generation endpoint shares: prepare, admit and submit, then answer as
server-sent events or as one JSON body, with usage, finish handling and client disconnects.

An endpoint (completions.py, chat.py) subclasses `GenerationEndpoint` and keeps only what is
its own: turning its request body into prompts and SamplingParams, the chunk of one streamed
delta, and the final response body. Everything it formats comes from one RequestOutputDelta
stream (`Generation.deltas`); non-streamed answers read the outputs built from that stream.

Where the next features plug in:
- structured output / tool calling: `prepare` carries response_format / tools into the params;
  a chat `ChunkFormatter` parses tool calls out of each delta's text, `response` out of the
  final text.
- guardrails (serve/guardrails.py): the input check runs in `handle` after `prepare` (before
  `Generation.start`); the output filter rewrites each delta inside `Generation.deltas` (hold
  back or redact its text, or end a sample with finish_reason "content_filter" and abort it),
  which both answer shapes read.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Iterable, Iterator, Mapping
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

import pydantic
from fastapi import Request
from fastapi.responses import JSONResponse, Response

from pagoda.outputs import CompletionDelta, RequestOutputDelta
from pagoda.sampling_params import SamplingParams
from pagoda.serve.admission.queue import end_arrival
from pagoda.serve.admission.tenants import Tenant
from pagoda.serve.admission.work import RequestWork
from pagoda.serve.api.json_body import json_text, model_json
from pagoda.serve.api.lora import resolve_model
from pagoda.serve.api.protocol import SamplingFields
from pagoda.serve.api.request_fields import Field, check_fields
from pagoda.serve.api.sse import (
    SSE_DONE,
    ChoiceChunks,
    ClientDisconnected,
    EventStreamResponse,
    cancel_on_disconnect,
    sse_error,
    sse_event,
)
from pagoda.serve.errors import APIError, bad_request
from pagoda.serve.guardrails import guard_input
from pagoda.serve.observability.provenance import HEADER as PROVENANCE_HEADER
from pagoda.serve.observability.tracing import trace_headers
from pagoda.serve.serving import (
    CLIENT_CLOSED_REQUEST,
    EnginePrompt,
    Generation,
    ServeContext,
    new_request_id,
    rejection_reason,
)

Body = TypeVar("Body", bound=SamplingFields)

# Above this many answer cells (`answer_cells`), a non-streamed answer is built and written on a
# worker thread: smaller ones cost less on the event loop than the hop to a thread.
LARGE_ANSWER_CELLS = 2048


@dataclass
class PreparedRequest:
    """An endpoint's request in engine terms."""

    prompts: list[EnginePrompt]
    params: SamplingParams
    # The engine's parameter names -> this endpoint's, for error messages.
    param_names: dict[str, str] = field(default_factory=dict)
    # Chat: the templated messages behind the one prompt, and how to render a prompt from
    # messages again (an input guardrail that redacts a message re-renders the prompt).
    messages: list[dict[str, Any]] | None = None
    render_messages: Callable[[list[dict[str, Any]]], EnginePrompt] | None = None


class ChunkFormatter(ABC):
    """Formats one streamed response's chunks; may keep per-choice state (offsets, parsers)."""

    def opening(self) -> Iterable[str]:
        """Events sent before the first delta (chat: each choice's role)."""
        return ()

    @abstractmethod
    def chunk(self, prompt_index: int, sample: CompletionDelta, delta: RequestOutputDelta) -> str | None:
        """The event for what one sample gained, or None when there is nothing to send."""


class GenerationEndpoint(ABC, Generic[Body]):
    name: str  # in metrics and log lines
    fields: Mapping[str, Field]  # its request-field table (request_fields.py)
    id_prefix: str  # of response ids
    chunk_object: str  # "object" of streamed chunks

    def num_prompts(self, request: Body) -> int:
        """How many prompts the body holds, read without tokenizing (each runs `n` sequences)."""
        return 1

    @abstractmethod
    def prepare(self, ctx: ServeContext, request: Body, tenant: Tenant) -> PreparedRequest:
        """Check the body and build prompts and params; raises APIError."""

    @abstractmethod
    def formatter(
        self, ctx: ServeContext, generation: Generation, request: Body, chunks: ChoiceChunks
    ) -> ChunkFormatter:
        """The formatter of this request's stream."""

    @abstractmethod
    def choices(self, ctx: ServeContext, generation: Generation, request: Body) -> Iterator[pydantic.BaseModel]:
        """The non-streamed body's choices in order, one at a time, once every prompt is
        finished (`generation.finals`)."""

    @abstractmethod
    def response(
        self, ctx: ServeContext, generation: Generation, request: Body, created: int, choices: list[Any]
    ) -> pydantic.BaseModel:
        """The non-streamed body around `choices`."""

    async def begin(
        self,
        ctx: ServeContext,
        raw: Request,
        request: Body,
        tenant: Tenant,
        *,
        route: str | None = None,
        await_first_token: bool = False,
    ) -> Generation | Response:
        """Admit and submit `request` (its refusal timed and raised); the 499 to return when the
        client left meanwhile. `route`: how it got there (logged). `await_first_token`: wait for
        the first token too, so that a failure before it raises its APIError (the request may go
        to a fallback) instead of ending a started answer."""
        started = time.perf_counter()
        try:
            generation = await self._start(ctx, raw, request, tenant, route=route)
        except APIError as exc:
            ctx.metrics.record_refusal_time(rejection_reason(exc), time.perf_counter() - started)
            raise
        except ClientDisconnected:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        if await_first_token:
            try:
                await cancel_on_disconnect(raw, generation.first_delta())
            except APIError as exc:
                generation.close(exc.status, exc)
                raise
            except ClientDisconnected:
                generation.close(CLIENT_CLOSED_REQUEST)
                return Response(status_code=CLIENT_CLOSED_REQUEST)
        return generation

    async def handle(
        self,
        ctx: ServeContext,
        raw: Request,
        request: Body,
        tenant: Tenant,
        *,
        route: str | None = None,
        await_first_token: bool = False,
    ) -> Response:
        """Answer `request` with `ctx`'s model (`route`, `await_first_token`: as `begin`)."""
        generation = await self.begin(ctx, raw, request, tenant, route=route, await_first_token=await_first_token)
        if isinstance(generation, Response):
            return generation
        created = int(time.time())
        stream_body = None
        if request.stream:
            include_usage = bool(request.stream_options and request.stream_options.include_usage)
            base = {
                "id": generation.request_id,
                "object": self.chunk_object,
                "created": created,
                "model": generation.model_name,
            }
            chunks = ChoiceChunks(base, include_usage)
            stream_body = _events(generation, self.formatter(ctx, generation, request, chunks), chunks)
        return await respond(
            raw,
            generation,
            stream_body,
            WholeAnswer(
                choices=lambda: self.choices(ctx, generation, request),
                body=lambda choices: self.response(ctx, generation, request, created, choices),
            ),
        )

    async def _start(
        self, ctx: ServeContext, raw: Request, request: Body, tenant: Tenant, route: str | None = None
    ) -> Generation:
        """Check, admit, prepare and submit the request; raises the APIError refusing it."""
        lora_request = resolve_model(ctx, request.model, tenant)
        check_fields(request, self.fields)
        priority = tenant.resolve_priority(getattr(request, "priority", None))
        if request.stream_options is not None and not request.stream:
            raise bad_request("stream_options is only allowed when stream is true.", param="stream_options")
        max_num_seqs = ctx.llm.config.max_num_seqs
        assert max_num_seqs is not None, "an engine client's config holds --max-num-seqs as the engine resolved it"
        ctx.settings.request_limits.check(request, max_num_seqs=max_num_seqs)
        # Refusals by sequence count (full queue, tenant cap, latency targets) come first, on
        # the loop and without waiting on anything: an overloaded server answers them at once
        # instead of after the tokenizing threads.
        # No await between the two: the fast refusal never sees this request counted twice.
        end_arrival(raw.scope)
        admission = ctx.admit(tenant, RequestWork(self.num_prompts(request), request.sequences_per_prompt))
        try:
            # Tokenizing and templating take seconds for a multi-megabyte prompt: a worker
            # thread keeps the event loop (every other request, /health) answering meanwhile.
            prepared = await asyncio.to_thread(self.prepare, ctx, request, tenant)
            prepared, input_decision = await guard_input(  # guardrails hook
                ctx.guard, ctx.llm.tokenizer, tenant, prepared
            )
        except BaseException:
            admission.release()
            raise
        generation = Generation(
            ctx,
            new_request_id(self.id_prefix),
            self.name,
            tenant,
            prepared.prompts,
            prepared.params,
            stream=request.stream,
            admission=admission,
            input_decision=input_decision,  # guardrails hook
            lora_request=lora_request,
            route=route,
            priority=priority,
            trace_headers=trace_headers(raw.headers),
        )
        # Submitting a batch of prompts takes engine round trips: a client that leaves
        # meanwhile must not leave its prompts running (start closes and aborts on cancel).
        await cancel_on_disconnect(raw, generation.start(prepared.param_names))
        return generation


async def _events(generation: Generation, formatter: ChunkFormatter, chunks: ChoiceChunks) -> AsyncIterator[str]:
    try:
        for event in formatter.opening():
            yield event
        async for i, delta in generation.deltas():
            for sample in delta.outputs:
                chunk = formatter.chunk(i, sample, delta)
                if chunk is not None:
                    yield chunk
        if chunks.include_usage:
            yield sse_event({**chunks.base, "choices": [], "usage": generation.usage().model_dump()})
    except APIError as exc:
        # Closed here with the error's status and reason: the stream itself still ends as a 200.
        generation.close(exc.status, exc)
        yield sse_error(exc)
    yield SSE_DONE


@dataclass
class WholeAnswer:
    """How a non-streamed body is built: its choices, one at a time, and the body around them;
    a body without a `choices` member (Anthropic's Messages) gives no `choices`."""

    body: Callable[[list[Any]], pydantic.BaseModel]
    choices: Callable[[], Iterator[pydantic.BaseModel]] | None = None

    def response(self) -> Response:
        return JSONResponse(self.body(list(self.choices()) if self.choices else []).model_dump())

    def large_response(self) -> Response:
        """The same bytes as `response`, built in steps (json_body.py) for a worker thread:
        each choice is written to text as soon as it is built, so its objects are freed at once
        and never pile up (a full garbage collection walks every live object, and while it runs
        no thread moves, the event loop's included)."""
        if self.choices is None:
            return Response(model_json(self.body([])).encode("utf-8"), media_type=JSONResponse.media_type)
        choices = ",".join(model_json(choice) for choice in self.choices())
        body = json_text(self.body([]).model_dump(), ready_members={"choices": f"[{choices}]"})
        return Response(body.encode("utf-8"), media_type=JSONResponse.media_type)


def answer_cells(generation: Generation) -> int:
    """The tokens a non-streamed answer lists, each counted with its top logprobs: what building
    and writing the answer costs."""
    params = generation.params
    per_token = 1 if params.logprobs is None else 2 + params.logprobs
    cells = per_token * sum(
        len(sample.token_ids) for final in generation.finals if final is not None for sample in final.outputs
    )
    if params.prompt_logprobs is not None:  # echoed into every sample of its prompt
        cells += (2 + params.prompt_logprobs) * params.n * generation.num_prompt_tokens
    return cells


async def respond(
    raw: Request, generation: Generation, stream_body: AsyncIterator[str] | None, answer: WholeAnswer
) -> Response:
    """Send a started generation: as server-sent events when `stream_body` is given, else wait
    for it to finish (aborting it if the client leaves) and send `answer` as JSON: a large
    answer is built and written on a worker thread, so the event loop keeps answering.
    The generation is closed with the status the client saw. Either answer carries the
    provenance id (serve/observability/provenance.py) in its headers."""
    if stream_body is not None:
        return _with_provenance(
            generation,
            EventStreamResponse(
                stream_body,
                on_close=lambda: generation.close(
                    200 if generation.finals and all(generation.finals) else CLIENT_CLOSED_REQUEST
                ),
            ),
        )
    try:
        await cancel_on_disconnect(raw, _drain(generation))
        if answer_cells(generation) > LARGE_ANSWER_CELLS:
            response = await asyncio.to_thread(answer.large_response)
        else:
            response = answer.response()
    except ClientDisconnected:
        generation.close(CLIENT_CLOSED_REQUEST)
        return Response(status_code=CLIENT_CLOSED_REQUEST)
    except APIError as exc:
        generation.close(exc.status, exc)
        raise
    except Exception:  # a fault of the server's, answered as a 500: logged as one
        generation.close(500)
        raise
    except BaseException:  # cancelled: the client went away
        generation.close(CLIENT_CLOSED_REQUEST)
        raise
    generation.close(200)
    return _with_provenance(generation, response)


def _with_provenance(generation: Generation, response: Response) -> Response:
    if generation.provenance is not None:
        response.headers[PROVENANCE_HEADER] = generation.provenance.id
    return response


async def _drain(generation: Generation) -> None:
    async for _ in generation.deltas():
        pass
