"""What the engine hands back.

`RequestOutputDelta` is the one thing that travels: the output processor emits one per request
that changed in a step (the text, tokens and logprobs it gained), both AsyncLLM transports carry
it, a request stream merges the deltas its consumer has not read yet, and the server formats
chunks straight from it. `RequestOutput` (one `CompletionOutput` per sample) is the whole
result, built from deltas by a consumer that wants it (`LLM.generate`, non-streamed answers).
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field


@dataclass
class Logprob:
    """Log-probability of one token under the model's raw (unprocessed) distribution."""

    logprob: float
    rank: int  # 1 = the most likely token
    decoded_token: str | None = None


# One position: token id -> Logprob. Holds the sampled (or prompt) token plus the top-k.
PositionLogprobs = dict[int, Logprob]


@dataclass
class RequestMetrics:
    """Wall-clock timestamps (time.time()) of a request's life, for TTFT / ITL / queue time."""

    arrival_time: float
    first_scheduled_time: float | None = None
    first_token_time: float | None = None
    last_token_time: float | None = None
    finished_time: float | None = None
    num_preemptions: int = 0
    # Disaggregated decode: from the KV handoff's header arriving to its last block written.
    handoff_start_time: float | None = None
    handoff_end_time: float | None = None

    @property
    def queue_time(self) -> float | None:
        if self.first_scheduled_time is None:
            return None
        return self.first_scheduled_time - self.arrival_time

    @property
    def time_to_first_token(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    @property
    def e2e_latency(self) -> float | None:
        if self.finished_time is None:
            return None
        return self.finished_time - self.arrival_time


@dataclass
class CompletionOutput:
    """One sample of a request. Lists grow in place as tokens arrive (cumulative, never rewritten)."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    cumulative_logprob: float | None = None
    logprobs: list[PositionLogprobs] | None = None
    finish_reason: str | None = None  # "stop" | "length" | "abort"
    stop_reason: int | str | None = None  # the stop token id or stop string that ended it

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass
class RequestOutput:
    """The state of one request after an engine step; `finished` once every sample is done."""

    request_id: str
    prompt: str | None
    prompt_token_ids: list[int]
    outputs: list[CompletionOutput]
    finished: bool = False
    prompt_logprobs: list[PositionLogprobs | None] | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None
    # A pooling request's vector (SamplingParams.pooling): its embedding, or the classifier's logits.
    embedding: list[float] | None = None

    @classmethod
    def from_delta(cls, delta: RequestOutputDelta) -> RequestOutput:
        """A request's output so far, starting from its first delta."""
        output = cls(
            request_id=delta.request_id,
            prompt=delta.prompt,
            prompt_token_ids=list(delta.prompt_token_ids or []),
            outputs=[CompletionOutput(index=i) for i in range(delta.num_samples)],
        )
        output.add(delta)
        return output

    def add(self, delta: RequestOutputDelta) -> None:
        """Grow this output by a later delta of the same request (in place)."""
        for sample in delta.outputs:
            completion = self.outputs[sample.index]
            if sample.text:
                completion.text += sample.text
            completion.token_ids.extend(sample.token_ids)
            if sample.logprobs is not None:
                if completion.logprobs is None:
                    completion.logprobs = []
                completion.logprobs.extend(sample.logprobs)
            completion.cumulative_logprob = sample.cumulative_logprob
            completion.finish_reason = sample.finish_reason
            completion.stop_reason = sample.stop_reason
        if delta.prompt_logprobs:
            if self.prompt_logprobs is None:
                self.prompt_logprobs = []
            self.prompt_logprobs.extend(delta.prompt_logprobs)
        self.finished = delta.finished
        self.num_cached_tokens = delta.num_cached_tokens
        self.metrics = delta.metrics
        if delta.embedding is not None:
            self.embedding = delta.embedding

    def snapshot(self) -> RequestOutput:
        """A copy whose lists later `add` calls do not change."""
        return RequestOutput(
            request_id=self.request_id,
            prompt=self.prompt,
            prompt_token_ids=self.prompt_token_ids,
            outputs=[
                CompletionOutput(
                    index=c.index,
                    text=c.text,
                    token_ids=c.token_ids[:],
                    cumulative_logprob=c.cumulative_logprob,
                    logprobs=c.logprobs[:] if c.logprobs is not None else None,
                    finish_reason=c.finish_reason,
                    stop_reason=c.stop_reason,
                )
                for c in self.outputs
            ],
            finished=self.finished,
            prompt_logprobs=self.prompt_logprobs[:] if self.prompt_logprobs is not None else None,
            num_cached_tokens=self.num_cached_tokens,
            metrics=copy.copy(self.metrics),
            embedding=self.embedding,
        )


class OutputAccumulator:
    """Whole RequestOutputs of many requests, built from their deltas as they arrive."""

    def __init__(self) -> None:
        self._outputs: dict[str, RequestOutput] = {}

    def add(self, delta: RequestOutputDelta) -> RequestOutput:
        """The request's output so far, this delta included; forgotten once finished."""
        output = self._outputs.get(delta.request_id)
        if output is None:
            output = self._outputs[delta.request_id] = RequestOutput.from_delta(delta)
        else:
            output.add(delta)
        if output.finished:
            del self._outputs[delta.request_id]
        return output


@dataclass
class CompletionDelta:
    """What one sample gained since its previous delta. Text only ever grows (the detokenizer
    holds back what a stop string may still remove), so a delta is always appended."""

    index: int
    text: str = ""
    token_ids: list[int] = field(default_factory=list)
    logprobs: list[PositionLogprobs] | None = None  # one entry per new token; None: not requested
    cumulative_logprob: float | None = None  # of all the sample's tokens so far
    finish_reason: str | None = None
    stop_reason: int | str | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None

    def merge(self, later: CompletionDelta) -> None:
        """Append a later delta of the same sample (in place)."""
        self.text += later.text
        self.token_ids.extend(later.token_ids)
        if later.logprobs is not None:
            self.logprobs = (self.logprobs or []) + later.logprobs
        self.cumulative_logprob = later.cumulative_logprob
        self.finish_reason = later.finish_reason
        self.stop_reason = later.stop_reason


@dataclass
class RequestOutputDelta:
    """What one request gained in one or more engine steps: only the samples that changed.

    Owned by whoever holds it: the engine side keeps no reference to its lists, so a stream
    may merge a later delta into it.
    """

    request_id: str
    outputs: list[CompletionDelta]
    num_samples: int  # n: the request's samples are indexed 0 .. n-1
    finished: bool = False  # every sample is done
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache
    metrics: RequestMetrics | None = None  # a copy, as of the newest step
    prompt_logprobs: list[PositionLogprobs | None] | None = None  # entries not sent before
    embedding: list[float] | None = None  # a pooling request's, on its last delta
    # Carried by a request's first delta only (they do not change).
    prompt: str | None = None
    prompt_token_ids: list[int] | None = None

    def merge(self, later: RequestOutputDelta) -> RequestOutputDelta:
        """Fold a later delta of the same request into this one (in place); returns self.

        A consumer that lags behind the engine therefore reads one bigger delta instead of a
        backlog of small ones.
        """
        by_index = {sample.index: sample for sample in self.outputs}
        for sample in later.outputs:
            mine = by_index.get(sample.index)
            if mine is None:
                self.outputs.append(sample)
                by_index[sample.index] = sample
            else:
                mine.merge(sample)
        if later.prompt_logprobs:
            self.prompt_logprobs = (self.prompt_logprobs or []) + later.prompt_logprobs
        if later.embedding is not None:
            self.embedding = later.embedding
        if self.prompt_token_ids is None:
            self.prompt, self.prompt_token_ids = later.prompt, later.prompt_token_ids
        self.finished = later.finished
        self.num_cached_tokens = later.num_cached_tokens
        self.metrics = later.metrics
        return self


@dataclass
class ScoringOutput:
    """One pair's score (vLLM's ScoringOutput): the classifier's one logit through its
    activation (sigmoid for a cross-encoder)."""

    score: float


@dataclass
class ScoringRequestOutput:
    """`LLM.score`'s answer for one pair (vLLM's ScoringRequestOutput)."""

    request_id: str
    outputs: ScoringOutput
    prompt_token_ids: list[int]
    finished: bool = True


@dataclass
class ClassificationOutput:
    """One input's class probabilities (vLLM's ClassificationOutput): softmax over the labels,
    or sigmoid of a one-label head's logit."""

    probs: list[float]

    @property
    def num_classes(self) -> int:
        return len(self.probs)


@dataclass
class ClassificationRequestOutput:
    """`LLM.classify`'s answer for one input (vLLM's ClassificationRequestOutput)."""

    request_id: str
    outputs: ClassificationOutput
    prompt_token_ids: list[int]
    finished: bool = True
