"""The output processor on its own, no model: token ids in, text out. Requests are fed tokens by
hand through the public methods add_request / process / finish_aborted. The processor emits
deltas; `Collected` builds the whole outputs from them, as LLM.generate does."""

from __future__ import annotations

from pathlib import Path

import pytest

from model_factory import build_tokenizer
from pagoda.engine.output_processor import OutputProcessor
from pagoda.outputs import RequestOutput, RequestOutputDelta
from pagoda.request import Request, RequestStatus
from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer import Tokenizer

TEXT = "def fibonacci(n):\n    return fibonacci(n - 1) + fibonacci(n - 2)\n"


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    directory: Path = tmp_path_factory.mktemp("tokenizer")
    build_tokenizer(directory)
    return Tokenizer.from_pretrained(directory)


class Collected:
    """The processor's calls, answering with each request's whole output so far."""

    def __init__(self, processor: OutputProcessor) -> None:
        self.processor = processor
        self.outputs: dict[str, RequestOutput] = {}

    def process(self, samples: list[Request]) -> tuple[list[RequestOutput], list[Request]]:
        deltas, stopped = self.processor.process(samples)
        return [self._add(delta) for delta in deltas], stopped

    def finish_aborted(self, request_id: str) -> RequestOutput | None:
        delta = self.processor.finish_aborted(request_id)
        return None if delta is None else self._add(delta)

    def _add(self, delta: RequestOutputDelta) -> RequestOutput:
        output = self.outputs.get(delta.request_id)
        if output is None:
            output = self.outputs[delta.request_id] = RequestOutput.from_delta(delta)
        else:
            output.add(delta)
        return output


def make_samples(tokenizer: Tokenizer, request_id: str = "r", **params: object) -> list[Request]:
    sampling = SamplingParams(max_tokens=64, temperature=0.0, **params)
    lead = Request(
        request_id=request_id,
        prompt_token_ids=tokenizer.encode("# prompt\n"),
        sampling_params=sampling,
        eos_token_ids=frozenset(),
        max_output_tokens=64,
    )
    lead.pending_forks = [lead.new_sample(i) for i in range(1, sampling.n)]
    return [lead, *lead.pending_forks]


def test_text_grows_token_by_token_and_ends_as_the_full_decode(tokenizer: Tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    collected = Collected(processor)
    (sample,) = make_samples(tokenizer)
    processor.add_request("r", "# prompt\n", [sample])
    token_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    texts = []
    for token_id in token_ids:
        sample.append_output_token(token_id)
        outputs, stopped = collected.process([sample])
        assert stopped == [] and len(outputs) == 1 and not outputs[0].finished
        texts.append(outputs[0].outputs[0].text)
    assert all(later.startswith(earlier) for earlier, later in zip(texts, texts[1:]))  # never rewritten
    sample.status = RequestStatus.FINISHED_LENGTH
    (output,), _ = collected.process([sample])
    assert output.finished and output.outputs[0].finish_reason == "length"
    assert output.outputs[0].text == TEXT == tokenizer.decode(token_ids)


def test_stop_string_split_across_tokens_ends_the_sample(tokenizer: Tokenizer) -> None:
    token_ids = tokenizer.encode(TEXT, add_special_tokens=False)
    stop = "acci(n - 1"
    assert not any(stop in tokenizer.decode([t]) for t in token_ids)  # no one token holds it
    processor = OutputProcessor(tokenizer)
    collected = Collected(processor)
    (sample,) = make_samples(tokenizer, stop=[stop])
    processor.add_request("r", None, [sample])
    stopped: list[Request] = []
    fed = 0
    for token_id in token_ids:
        sample.append_output_token(token_id)
        fed += 1
        outputs, stopped = collected.process([sample])
        if stopped:
            break
    assert stopped == [sample]  # the engine must now finish it
    completion = outputs[0].outputs[0]
    assert completion.finish_reason == "stop" and completion.stop_reason == stop
    assert completion.text == TEXT[: TEXT.index(stop)]  # the stop string is not shown
    assert fed < len(token_ids)
    # More tokens that were already in flight change nothing.
    sample.append_output_token(token_ids[fed])
    outputs, stopped = collected.process([sample])
    assert stopped == [] and outputs[0].outputs[0].text == TEXT[: TEXT.index(stop)]


def test_include_stop_str_in_output(tokenizer: Tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    collected = Collected(processor)
    (sample,) = make_samples(tokenizer, stop=["return"], include_stop_str_in_output=True)
    processor.add_request("r", None, [sample])
    for token_id in tokenizer.encode(TEXT, add_special_tokens=False):
        sample.append_output_token(token_id)
        outputs, stopped = collected.process([sample])
        if stopped:
            break
    assert outputs[0].outputs[0].text == TEXT[: TEXT.index("return") + len("return")]


def test_n_samples_merge_into_one_output(tokenizer: Tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    collected = Collected(processor)
    samples = make_samples(tokenizer, n=2)
    processor.add_request("r", "# prompt\n", samples)
    first, second = samples
    first.append_output_token(tokenizer.encode("def", add_special_tokens=False)[0])
    first.metrics.first_token_time = 20.0
    (output,), _ = collected.process([first])
    assert output.request_id == "r" and [c.index for c in output.outputs] == [0, 1]
    assert output.outputs[1].text == "" and not output.finished

    for token_id in tokenizer.encode("import", add_special_tokens=False):
        second.append_output_token(token_id)
    second.metrics.first_token_time = 10.0
    first.status = RequestStatus.FINISHED_LENGTH
    outputs, _ = collected.process([first, second])
    assert len(outputs) == 1  # one output per user request, however many samples moved
    output = outputs[0]
    assert output.outputs[1].text == "import" and not output.finished  # second still running
    assert output.metrics.first_token_time == 10.0  # the earliest sample's

    second.status = RequestStatus.FINISHED_STOPPED
    (output,), _ = collected.process([second])
    assert output.finished and [c.finish_reason for c in output.outputs] == ["length", "stop"]


def test_finish_aborted_marks_unfinished_samples(tokenizer: Tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    collected = Collected(processor)
    samples = make_samples(tokenizer, n=2)
    processor.add_request("r", None, samples)
    samples[0].status = RequestStatus.FINISHED_LENGTH
    collected.process([samples[0]])
    output = collected.finish_aborted("r")
    assert output is not None and output.finished
    assert [c.finish_reason for c in output.outputs] == ["length", "abort"]
    assert collected.finish_aborted("unknown") is None


def test_progress_of_unknown_requests_is_ignored(tokenizer: Tokenizer) -> None:
    processor = OutputProcessor(tokenizer)
    collected = Collected(processor)
    (sample,) = make_samples(tokenizer, request_id="never-added")
    sample.append_output_token(1)
    assert collected.process([sample]) == ([], [])
