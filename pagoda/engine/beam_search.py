"""Beam search: `use_beam_search` requests, run by the engine as a loop of one-token requests.

The search itself (`BeamSearch`) is transformers' `num_beams` generation, step for step: each
step takes the best `(1 + EOS tokens) x width` continuations of the running beams by cumulative
log-probability; those among the best `width` that end (an EOS token, or max_tokens reached)
become hypotheses scored `cumulative_logprob / generated_tokens ** length_penalty` (the EOS
token counted); the best `width` that do not end run on. `early_stopping` decides when to stop
as transformers does: True once `width` hypotheses exist, False once the best running beam
(at its current length) cannot beat the worst hypothesis, "never" the same test at max_tokens
when length_penalty > 0.

The engine side (`BeamSearchRunner`) is vLLM's design: each step of a search is one request
per running beam (its prompt: the prompt plus the beam's tokens) asking for one token and the
beam's top next-token logprobs. The prefix cache is what the beams share: a beam's request
reuses every full block its parent's request computed (the prompt's included), and only the
last partial block is computed again; a beam that drops takes nothing with it, because its
request ended with its step and its blocks went back to the cache. No fork bookkeeping lives
in the scheduler or the KV manager, and every beam is a plain request there, so a beam search
of width W holds W sequences of --max-num-seqs while it runs.
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

from pagoda.engine.engine_core import EngineCore
from pagoda.engine.engine_request import EngineRequest
from pagoda.engine.validation import validate_request
from pagoda.errors import InvalidRequest
from pagoda.outputs import CompletionDelta, Logprob, PositionLogprobs, RequestMetrics, RequestOutputDelta
from pagoda.request import Request
from pagoda.sampling_params import MAX_LOGPROBS, SamplingParams
from pagoda.tokenizer import Tokenizer

# ---- the offline API's values (vLLM's BeamSearchParams / BeamSearchSequence / BeamSearchOutput)


@dataclass
class BeamSearchParams:
    """`LLM.beam_search`'s parameters, as vLLM's; `early_stopping` is transformers'.
    `temperature` is accepted for vLLM's signature and does not apply (beam search is
    deterministic)."""

    beam_width: int
    max_tokens: int
    ignore_eos: bool = False
    temperature: float = 0.0
    length_penalty: float = 1.0
    include_stop_str_in_output: bool = False
    early_stopping: bool | str = False

    def sampling_params(self) -> SamplingParams:
        return SamplingParams(
            use_beam_search=True,
            n=self.beam_width,
            best_of=self.beam_width,
            max_tokens=self.max_tokens,
            ignore_eos=self.ignore_eos,
            temperature=0.0,
            length_penalty=self.length_penalty,
            early_stopping=self.early_stopping,
            include_stop_str_in_output=self.include_stop_str_in_output,
            logprobs=0,
        )


@dataclass
class BeamSearchSequence:
    """One returned beam. `tokens` include the prompt's (as vLLM's); `text` is the generated
    part only; `logprobs` hold each generated token's entry; `score` is what ranked it."""

    tokens: list[int]
    logprobs: list[PositionLogprobs]
    cum_logprob: float = 0.0
    text: str | None = None
    finish_reason: str | None = None
    stop_reason: int | str | None = None
    score: float = 0.0


@dataclass
class BeamSearchOutput:
    """A prompt's beams, best first."""

    sequences: list[BeamSearchSequence]


def beam_score(cumulative_logprob: float, num_generated: int, length_penalty: float) -> float:
    """A finished beam's score, as transformers': the generated length counts its EOS token."""
    return cumulative_logprob / (num_generated**length_penalty)


# ---- the search ------------------------------------------------------------------------------


@dataclass
class Beam:
    token_ids: list[int]  # generated so far
    cumulative_logprob: float
    logprobs: list[PositionLogprobs]  # the entry each token was chosen from

    def extended(self, token_id: int, cumulative_logprob: float, entry: PositionLogprobs) -> Beam:
        return Beam(self.token_ids + [token_id], cumulative_logprob, self.logprobs + [entry])


@dataclass
class Hypothesis:
    beam: Beam
    score: float


class BeamSearch:
    """One prompt's search. `running` are the beams to expand next; `advance` takes each one's
    next-token logprobs (at least its top `logprobs_per_beam`) and makes one step."""

    def __init__(
        self,
        width: int,
        max_tokens: int,
        eos_token_ids: Iterable[int],
        *,
        length_penalty: float = 1.0,
        early_stopping: bool | str = False,
    ) -> None:
        self.width = width
        self.max_tokens = max_tokens
        self.eos_token_ids = frozenset(eos_token_ids)
        self.length_penalty = length_penalty
        self.early_stopping = early_stopping
        self.running: list[Beam] = [Beam([], 0.0, [])]
        self.finished: list[Hypothesis] = []  # the best `width`, best first
        self.num_generated = 0
        self.improvable = True
        self.done = False

    @property
    def logprobs_per_beam(self) -> int:
        """Enough of each beam's top tokens for the step: the best `width` non-ending
        continuations overall are among their beam's top `width + EOS tokens`, and so is every
        continuation among the best `width`."""
        return self.width + len(self.eos_token_ids)

    @property
    def num_candidates(self) -> int:
        return max(2, 1 + len(self.eos_token_ids)) * self.width

    def _full(self) -> bool:
        return len(self.finished) >= self.width

    def advance(self, next_logprobs: list[PositionLogprobs]) -> None:
        """One step; `next_logprobs[i]` belongs to `running[i]`."""
        candidates: list[tuple[float, Beam, int, PositionLogprobs]] = []
        for beam, entry in zip(self.running, next_logprobs, strict=True):
            top = sorted(entry.items(), key=lambda item: -item[1].logprob)[: self.logprobs_per_beam]
            candidates.extend(
                (beam.cumulative_logprob + logprob.logprob, beam, token_id, entry) for token_id, logprob in top
            )
        candidates.sort(key=lambda candidate: -candidate[0])  # stable: ties keep beam, then rank order
        candidates = candidates[: self.num_candidates]
        length = self.num_generated + 1
        last_step = length >= self.max_tokens

        def ends(token_id: int) -> bool:
            return last_step or token_id in self.eos_token_ids

        # Only the best `width` continuations may become hypotheses; the others are there so
        # that `width` beams run on even when the best ones all end.
        if self.improvable and not (self.early_stopping is True and self._full()):
            for cumulative, beam, token_id, entry in candidates[: self.width]:
                if ends(token_id):
                    self.finished.append(
                        Hypothesis(
                            beam.extended(token_id, cumulative, entry),
                            beam_score(cumulative, length, self.length_penalty),
                        )
                    )
            self.finished.sort(key=lambda hypothesis: -hypothesis.score)
            del self.finished[self.width :]
        self.running = [
            beam.extended(token_id, cumulative, entry)
            for cumulative, beam, token_id, entry in candidates
            if not ends(token_id)
        ][: self.width]
        self.num_generated = length
        if self.improvable and self._full() and self.running:
            if self.early_stopping == "never" and self.length_penalty > 0.0:
                best_length = self.max_tokens
            else:
                best_length = length
            best_possible = self.running[0].cumulative_logprob / (best_length**self.length_penalty)
            self.improvable = best_possible > self.finished[-1].score
        self.done = not self.improvable or not self.running or (self.early_stopping is True and self._full())


# ---- the engine side -------------------------------------------------------------------------


@dataclass
class _Search:
    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    params: SamplingParams
    search: BeamSearch
    # The request as the engine received it (its prompt as token ids, arrival time set): each
    # beam request is this one with its own id, prompt and step_params.
    request: EngineRequest
    step_params: SamplingParams  # each beam request's: one token and its top logprobs
    # The step in flight: beam request id -> the beam's index in `search.running`.
    pending: dict[str, int] = field(default_factory=dict)
    next_logprobs: list[PositionLogprobs | None] = field(default_factory=list)
    num_cached_tokens: int = -1  # the first step's prefix-cache hit: the prompt's
    first_scheduled_time: float | None = None
    num_preemptions: int = 0


class BeamSearchRunner:
    """The engine's beam searches. `LLMEngine` hands it `use_beam_search` requests (`add`), the
    samples each step progressed (`take`, which keeps the beam requests' and answers a
    search's one delta when it ends) and aborts."""

    def __init__(self, core: EngineCore, tokenizer: Tokenizer, eos_token_ids: frozenset[int]) -> None:
        self.core = core
        self.tokenizer = tokenizer
        self.eos_token_ids = eos_token_ids
        self._searches: dict[str, _Search] = {}
        self._by_beam_request: dict[str, _Search] = {}

    def owns(self, request_id: str) -> bool:
        return request_id in self._searches

    def add(self, request: EngineRequest, prompt: str | None) -> None:
        """Start a search for `request` (its prompt as token ids; `prompt` the text it was
        tokenized from, if any); raises InvalidRequest (nothing is kept then)."""
        request_id, params, prompt_token_ids = request.request_id, request.params, request.prompt_token_ids
        if request_id in self._searches or request_id in self.core.requests:
            raise InvalidRequest(f"request id {request_id!r} is already in use")
        eos = frozenset() if params.ignore_eos else self.eos_token_ids | frozenset(params.stop_token_ids)
        max_tokens = validate_request(prompt_token_ids, params, self.core.engine_limits)
        search = BeamSearch(
            params.beam_width,
            max_tokens,
            eos,
            length_penalty=params.length_penalty,
            early_stopping=params.early_stopping,
        )
        num_logprobs = max(search.logprobs_per_beam, params.logprobs or 0)
        if num_logprobs > MAX_LOGPROBS:
            raise InvalidRequest(
                f"use_beam_search with a width of {params.beam_width} needs the top {num_logprobs} "
                f"tokens of each step ({len(eos)} end-of-sequence tokens on this model), more than "
                f"{MAX_LOGPROBS}; use at most {MAX_LOGPROBS - len(eos)} beams",
                param="n",
            )
        step_params = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True, logprobs=num_logprobs)
        state = _Search(
            request_id,
            prompt,
            prompt_token_ids,
            params,
            search,
            replace(request, arrival_time=request.arrival_time or time.time()),
            step_params,
        )
        self._searches[request_id] = state
        try:
            self._submit_step(state)
        except BaseException:
            self._drop(state)
            raise

    def take(self, progressed: list[Request]) -> tuple[list[Request], list[RequestOutputDelta]]:
        """Split a step's progressed samples: the others are returned; the beam requests'
        next-token logprobs advance their searches, and each search that ended is answered
        with its delta."""
        others: list[Request] = []
        answers: list[RequestOutputDelta] = []
        for request in progressed:
            state = self._by_beam_request.get(request.request_id)
            if state is None:
                others.append(request)
                continue
            if not request.is_finished:  # one token is all it asked for
                continue
            index = state.pending.pop(request.request_id)
            del self._by_beam_request[request.request_id]
            state.next_logprobs[index] = request.output_logprobs[0]
            metrics = request.metrics
            if state.num_cached_tokens < 0:
                state.num_cached_tokens = max(request.num_cached_tokens, 0)
            if state.first_scheduled_time is None:
                state.first_scheduled_time = metrics.first_scheduled_time
            state.num_preemptions += metrics.num_preemptions
            self.core.release(request.request_id)
            if state.pending:
                continue
            answered = [entry for entry in state.next_logprobs if entry is not None]
            assert len(answered) == len(state.next_logprobs), "no beam is pending: every one answered"
            state.search.advance(answered)
            if state.search.done:
                del self._searches[state.request_id]
                answers.append(self._answer(state))
            else:
                self._submit_step(state)
        return others, answers

    def abort(self, request_id: str) -> RequestOutputDelta | None:
        """End a search now, freeing its beams; the delta that reports it aborted."""
        state = self._searches.get(request_id)
        if state is None:
            return None
        self._drop(state)
        outputs = [CompletionDelta(index=i, finish_reason="abort") for i in range(state.params.n)]
        return RequestOutputDelta(
            request_id=request_id,
            outputs=outputs,
            num_samples=state.params.n,
            finished=True,
            num_cached_tokens=max(state.num_cached_tokens, 0),
            metrics=self._metrics(state),
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
        )

    def _drop(self, state: _Search) -> None:
        self._searches.pop(state.request_id, None)
        beam_requests = list(state.pending)
        self.core.abort_request(beam_requests)
        for beam_request_id in beam_requests:
            self._by_beam_request.pop(beam_request_id, None)
            self.core.release(beam_request_id)
        state.pending.clear()

    def _submit_step(self, state: _Search) -> None:
        running = state.search.running
        state.next_logprobs = [None] * len(running)
        for index, beam in enumerate(running):
            beam_request_id = f"{state.request_id}\x00beam{index}"
            self.core.add_request(
                replace(
                    state.request,
                    request_id=beam_request_id,
                    prompt=state.prompt_token_ids + beam.token_ids,
                    params=state.step_params,
                )
            )
            state.pending[beam_request_id] = index
            self._by_beam_request[beam_request_id] = state

    def _answer(self, state: _Search) -> RequestOutputDelta:
        params = state.params
        outputs = []
        for index, hypothesis in enumerate(state.search.finished[: params.n]):
            beam = hypothesis.beam
            last = beam.token_ids[-1]
            stopped = last in state.search.eos_token_ids
            text_ids = beam.token_ids[:-1] if stopped and not params.include_stop_str_in_output else beam.token_ids
            delta = CompletionDelta(
                index=index,
                text=self.tokenizer.decode(text_ids, skip_special_tokens=params.skip_special_tokens),
                token_ids=list(beam.token_ids),
                cumulative_logprob=beam.cumulative_logprob,
                finish_reason="stop" if stopped else "length",
                stop_reason=last if stopped and last not in self.eos_token_ids else None,
            )
            if params.logprobs is not None:
                delta.logprobs = [
                    self._top(entry, token_id, params.logprobs)
                    for entry, token_id in zip(beam.logprobs, beam.token_ids)
                ]
            outputs.append(delta)
        return RequestOutputDelta(
            request_id=state.request_id,
            outputs=outputs,
            num_samples=params.n,
            finished=True,
            num_cached_tokens=max(state.num_cached_tokens, 0),
            metrics=self._metrics(state),
            prompt=state.prompt,
            prompt_token_ids=state.prompt_token_ids,
        )

    def _top(self, entry: PositionLogprobs, chosen: int, k: int) -> PositionLogprobs:
        """The chosen token's entry and the top k, decoded (each beam's own copy)."""
        top: PositionLogprobs = {}
        for token_id, logprob in entry.items():
            if token_id == chosen or logprob.rank <= k:
                top[token_id] = Logprob(logprob.logprob, logprob.rank, self.tokenizer.decode_token(token_id))
        return top

    def _metrics(self, state: _Search) -> RequestMetrics:
        now = time.time()
        arrival_time = state.request.arrival_time
        assert arrival_time is not None  # add() set it
        # The beams are ranked only at the end: every token is released then.
        return RequestMetrics(
            arrival_time=arrival_time,
            first_scheduled_time=state.first_scheduled_time,
            first_token_time=now,
            last_token_time=now,
            finished_time=now,
            num_preemptions=state.num_preemptions,
        )
