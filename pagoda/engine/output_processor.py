"""From samples that got tokens to user-facing RequestOutputs: incremental detokenization,
stop strings, decoded logprob tokens, and merging the n samples of one request."""

from __future__ import annotations

from dataclasses import dataclass, field

from pagoda.outputs import CompletionOutput, PositionLogprobs, RequestMetrics, RequestOutput
from pagoda.request import Request, RequestStatus
from pagoda.tokenizer import IncrementalDetokenizer, Tokenizer


@dataclass
class _SampleState:
    request: Request
    detokenizer: IncrementalDetokenizer
    completion: CompletionOutput
    num_tokens_seen: int = 0
    num_logprobs_decoded: int = 0


@dataclass
class _RequestState:
    output: RequestOutput
    samples: list[_SampleState] = field(default_factory=list)
    num_prompt_logprobs_decoded: int = 0


class OutputProcessor:
    def __init__(self, tokenizer: Tokenizer) -> None:
        self.tokenizer = tokenizer
        self._states: dict[str, _RequestState] = {}

    def add_request(self, request_id: str, prompt: str | None, samples: list[Request]) -> None:
        lead = samples[0]
        params = lead.sampling_params
        states = []
        for sample in samples:
            detokenizer = IncrementalDetokenizer(
                self.tokenizer, lead.prompt_token_ids, skip_special_tokens=params.skip_special_tokens,
                spaces_between_special_tokens=params.spaces_between_special_tokens, stop=params.stop,
                include_stop_str_in_output=params.include_stop_str_in_output)
            completion = CompletionOutput(
                index=sample.sample_index, token_ids=sample.output_token_ids,
                logprobs=sample.output_logprobs if params.logprobs is not None else None)
            states.append(_SampleState(sample, detokenizer, completion))
        output = RequestOutput(
            request_id=request_id, prompt=prompt, prompt_token_ids=lead.prompt_token_ids,
            outputs=[s.completion for s in states], metrics=lead.metrics)
        self._states[request_id] = _RequestState(output, states)

    def process(self, progressed: list[Request]) -> tuple[list[RequestOutput], list[Request]]:
        """Returns the outputs that changed, and the samples a stop string ended (the engine
        must stop them)."""
        changed: dict[str, _RequestState] = {}
        stopped: list[Request] = []
        for sample in progressed:
            state = self._states.get(sample.parent_id)
            if state is None:
                continue
            sample_state = state.samples[sample.sample_index]
            if self._update_sample(sample_state):
                stopped.append(sample)
            changed[sample.parent_id] = state
        return [self._refresh(state) for state in changed.values()], stopped

    def finish_aborted(self, request_id: str) -> RequestOutput | None:
        state = self._states.get(request_id)
        if state is None:
            return None
        for sample_state in state.samples:
            if sample_state.completion.finish_reason is None:
                sample_state.completion.finish_reason = RequestStatus.FINISHED_ABORTED.finish_reason
        return self._refresh(state)

    def remove(self, request_id: str) -> None:
        self._states.pop(request_id, None)

    def _update_sample(self, state: _SampleState) -> bool:
        """Feed new tokens to the detokenizer; True if a stop string ended the sample."""
        request = state.request
        completion = state.completion
        new_tokens = request.output_token_ids[state.num_tokens_seen:]
        state.num_tokens_seen = request.num_output_tokens
        stopped_by_string = False
        if new_tokens and state.detokenizer.stop_string is None:
            state.detokenizer.add_tokens(new_tokens)
            if state.detokenizer.stop_string is not None:
                stopped_by_string = True
                completion.finish_reason = RequestStatus.FINISHED_STOPPED.finish_reason
                completion.stop_reason = state.detokenizer.stop_string
        if completion.finish_reason is None and request.is_finished:
            state.detokenizer.finish()
            completion.finish_reason = request.status.finish_reason
            completion.stop_reason = request.stop_reason
        completion.text = state.detokenizer.text
        if completion.logprobs is not None:
            self._decode_logprobs(state)
            completion.cumulative_logprob = request.cumulative_logprob
        return stopped_by_string and not request.is_finished

    def _decode_logprobs(self, state: _SampleState) -> None:
        entries = state.request.output_logprobs
        for entry in entries[state.num_logprobs_decoded:]:
            self._decode_entry(entry)
        state.num_logprobs_decoded = len(entries)

    def _decode_entry(self, entry: PositionLogprobs | None) -> None:
        if entry is None:
            return
        for token_id, logprob in entry.items():
            if logprob.decoded_token is None:
                logprob.decoded_token = self.tokenizer.decode_token(token_id)

    def _refresh(self, state: _RequestState) -> RequestOutput:
        output = state.output
        lead = state.samples[0].request
        output.num_cached_tokens = max(lead.num_cached_tokens, 0)
        if lead.sampling_params.prompt_logprobs is not None and lead.prompt_logprobs:
            for entry in lead.prompt_logprobs[state.num_prompt_logprobs_decoded:]:
                self._decode_entry(entry)
            state.num_prompt_logprobs_decoded = len(lead.prompt_logprobs)
            output.prompt_logprobs = lead.prompt_logprobs
        output.finished = all(s.completion.finish_reason is not None for s in state.samples)
        if len(state.samples) > 1:
            output.metrics = _merged_metrics([s.request.metrics for s in state.samples])
        return output


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
    )
