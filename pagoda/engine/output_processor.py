"""From samples that got tokens to user-facing deltas: incremental detokenization, stop
strings, decoded logprob tokens, and the n samples of one request grouped under its id.

Every call to `process` returns one `RequestOutputDelta` per request that changed: the text,
tokens and logprobs each sample gained since the previous call. Nothing cumulative is kept
here beyond the counters of what was already emitted.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

from pagoda.outputs import CompletionDelta, PositionLogprobs, RequestMetrics, RequestOutputDelta
from pagoda.request import Request, RequestStatus
from pagoda.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class _SampleState:
    request: Request
    detokenizer: IncrementalDetokenizer
    num_tokens_emitted: int = 0
    finish_reason: str | None = None
    stop_reason: int | str | None = None


@dataclass
class _RequestState:
    request_id: str
    prompt: str | None
    samples: list[_SampleState] = field(default_factory=list)
    num_prompt_logprobs_emitted: int = 0
    sent_first: bool = False

    @property
    def finished(self) -> bool:
        return all(s.finish_reason is not None for s in self.samples)


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, samples: list[Request]) -> None:
        lead = samples[0]
        params = lead.sampling_params
        state = _RequestState(request_id, prompt)
        for sample in samples:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer,
                lead.prompt_token_ids,
                skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens,
                stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output,
            )
            state.samples.append(_SampleState(sample, detokenizer))
        self._states[request_id] = state

    def process(self, progressed: list[Request]) -> tuple[list[RequestOutputDelta], list[Request]]:
        """Returns one delta per request that changed, and the samples a stop string ended
        (the engine must stop them)."""
        changed: dict[str, list[CompletionDelta]] = {}
        stopped: list[Request] = []
        for sample in progressed:
            state = self._states.get(sample.parent_id)
            if state is None:
                continue
            delta, stopped_by_string = self._sample_delta(state.samples[sample.sample_index])
            if stopped_by_string:
                stopped.append(sample)
            changed.setdefault(sample.parent_id, []).append(delta)
        return [
            self._request_delta(self._states[request_id], samples) for request_id, samples in changed.items()
        ], stopped

    def finish_aborted(self, request_id: str) -> RequestOutputDelta | None:
        """The delta that ends an aborted request: every unfinished sample gets "abort"."""
        state = self._states.get(request_id)
        if state is None:
            return None
        samples = []
        for sample_state in state.samples:
            if sample_state.finish_reason is None:
                sample_state.finish_reason = RequestStatus.FINISHED_ABORTED.finish_reason
                samples.append(
                    CompletionDelta(index=sample_state.request.sample_index, finish_reason=sample_state.finish_reason)
                )
        return self._request_delta(state, samples)

    def remove(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _sample_delta(self, state: _SampleState) -> tuple[CompletionDelta, bool]:
        """Feed new tokens to the detokenizer; also True if a stop string ended the sample."""
        request = state.request
        start = state.num_tokens_emitted
        new_tokens = request.output_token_ids[start:]
        state.num_tokens_emitted = request.num_output_tokens
        text = ""
        stopped_by_string = False
        if new_tokens and state.detokenizer.stop_string is None:
            text = state.detokenizer.add_tokens(new_tokens)
            if state.detokenizer.stop_string is not None:
                stopped_by_string = True
                state.finish_reason = RequestStatus.FINISHED_STOPPED.finish_reason
                state.stop_reason = state.detokenizer.stop_string
        if state.finish_reason is None and request.is_finished:
            text += state.detokenizer.finish()
            state.finish_reason = request.status.finish_reason
            state.stop_reason = request.stop_reason
        delta = CompletionDelta(
            index=request.sample_index,
            text=text,
            token_ids=new_tokens,
            finish_reason=state.finish_reason,
            stop_reason=state.stop_reason,
        )
        if request.sampling_params.logprobs is not None:
            entries = request.output_logprobs[start : state.num_tokens_emitted]
            for entry in entries:
                self._decode_entry(entry)
            delta.logprobs = entries
            delta.cumulative_logprob = request.cumulative_logprob
        return delta, stopped_by_string and not request.is_finished

    def _decode_entry(self, entry: PositionLogprobs | None) -> None:
        if entry is None:
            return
        for token_id, logprob in entry.items():
            if logprob.decoded_token is None:
                logprob.decoded_token = self.tokenizer.decode_token(token_id)

    def _request_delta(self, state: _RequestState, samples: list[CompletionDelta]) -> RequestOutputDelta:
        lead = state.samples[0].request
        delta = RequestOutputDelta(
            request_id=state.request_id,
            outputs=samples,
            num_samples=len(state.samples),
            finished=state.finished,
            num_cached_tokens=max(lead.num_cached_tokens, 0),
        )
        if len(state.samples) > 1:
            delta.metrics = _merged_metrics([s.request.metrics for s in state.samples])
        else:
            delta.metrics = copy.copy(lead.metrics)  # the engine keeps updating the original
        if lead.sampling_params.prompt_logprobs is not None and lead.prompt_logprobs:
            entries = lead.prompt_logprobs[state.num_prompt_logprobs_emitted :]
            for entry in entries:
                self._decode_entry(entry)
            state.num_prompt_logprobs_emitted = len(lead.prompt_logprobs)
            if entries:
                delta.prompt_logprobs = entries
        if state.finished and lead.embedding is not None:
            delta.embedding = lead.embedding
        if not state.sent_first:
            state.sent_first = True
            delta.prompt, delta.prompt_token_ids = state.prompt, lead.prompt_token_ids
        return delta


def _merged_metrics(metrics: list[RequestMetrics]) -> RequestMetrics:
    def earliest(values):
        present = [v for v in values if v is not None]
        return min(present) if present else None

    def latest(values):
        present = [v for v in values if v is not None]
        return max(present) if present else None

    finished = [m.finished_time for m in metrics]
    return RequestMetrics(
        arrival_time=metrics[0].arrival_time,
        first_scheduled_time=earliest(m.first_scheduled_time for m in metrics),
        first_token_time=earliest(m.first_token_time for m in metrics),
        last_token_time=latest(m.last_token_time for m in metrics),
        finished_time=latest(finished) if all(f is not None for f in finished) else None,
        num_preemptions=sum(m.num_preemptions for m in metrics),
        handoff_start_time=earliest(m.handoff_start_time for m in metrics),
        handoff_end_time=latest(m.handoff_end_time for m in metrics),
    )
