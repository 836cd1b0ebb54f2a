"""The one output delta: the output processor emits it, a request stream merges what its
consumer has not read, and whole outputs are built from it. Model-free and fast."""

from __future__ import annotations

import asyncio

import pytest

from pagoda.config import DEFAULT_MODEL_DIR
from pagoda.engine.output_processor import OutputProcessor
from pagoda.engine.request_stream import RequestStream
from pagoda.outputs import CompletionDelta, Logprob, RequestOutput, RequestOutputDelta
from pagoda.request import Request, RequestStatus
from pagoda.sampling_params import SamplingParams
from pagoda.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer() -> Tokenizer:
    return Tokenizer.from_pretrained(DEFAULT_MODEL_DIR)


def delta(
    request_id: str = "r", *samples: CompletionDelta, n: int = 1, finished: bool = False, **fields
) -> RequestOutputDelta:
    return RequestOutputDelta(request_id, list(samples), num_samples=n, finished=finished, **fields)


def samples_of(tokenizer: Tokenizer, text: str, params: SamplingParams) -> tuple[list[Request], list[int]]:
    prompt = tokenizer.encode("Say something:")
    lead = Request("r", prompt, params, frozenset(), max_output_tokens=64)
    samples = [lead, *(lead.new_sample(i) for i in range(1, params.n))]
    return samples, tokenizer.encode(text, add_special_tokens=False)


# ---- merging -----------------------------------------------------------------------------------


def test_merge_appends_per_sample_and_keeps_the_newest_state() -> None:
    first = delta(
        "r",
        CompletionDelta(0, "Hel", [1], logprobs=[{1: Logprob(-0.1, 1)}], cumulative_logprob=-0.1),
        n=2,
        prompt="p",
        prompt_token_ids=[7, 8],
        num_cached_tokens=0,
    )
    second = delta("r", CompletionDelta(1, "A", [5]), n=2, num_cached_tokens=16)
    third = delta(
        "r",
        CompletionDelta(
            0,
            "lo",
            [2, 3],
            logprobs=[{2: Logprob(-0.2, 1)}, {3: Logprob(-0.3, 1)}],
            cumulative_logprob=-0.6,
            finish_reason="length",
        ),
        n=2,
        num_cached_tokens=16,
    )
    merged = first.merge(second).merge(third)
    by_index = {s.index: s for s in merged.outputs}
    assert by_index[0].text == "Hello" and by_index[0].token_ids == [1, 2, 3]
    assert [list(p) for p in by_index[0].logprobs] == [[1], [2], [3]]
    assert by_index[0].cumulative_logprob == -0.6 and by_index[0].finish_reason == "length"
    assert by_index[1].text == "A" and by_index[1].finish_reason is None
    # First-delta fields survive; per-step fields are the newest.
    assert merged.prompt_token_ids == [7, 8] and merged.prompt == "p"
    assert merged.num_cached_tokens == 16 and not merged.finished


def test_whole_output_from_deltas_and_snapshots_do_not_change() -> None:
    output = RequestOutput.from_delta(delta("r", CompletionDelta(0, "a", [1]), n=2, prompt_token_ids=[9]))
    snapshot = output.snapshot()
    output.add(
        delta(
            "r", CompletionDelta(1, "b", [2]), CompletionDelta(0, "c", [3], finish_reason="stop"), n=2, finished=False
        )
    )
    assert [c.text for c in output.outputs] == ["ac", "b"]
    assert [c.token_ids for c in output.outputs] == [[1, 3], [2]]
    assert output.outputs[0].finish_reason == "stop" and not output.finished
    assert snapshot.outputs[0].token_ids == [1] and snapshot.outputs[0].text == "a"
    assert output.prompt_token_ids == [9]


def test_stream_merges_while_the_consumer_lags() -> None:
    async def main() -> None:
        stream = RequestStream("r", asyncio.get_running_loop())
        stream.accept()
        await stream.wait_accepted()
        assert stream.poll() is None
        for i, piece in enumerate(["one ", "two ", "three"]):
            stream.deliver(delta("r", CompletionDelta(0, piece, [i]), prompt_token_ids=[5] if i == 0 else None))
        lagged = await stream.get()  # three steps, read once: one delta with all of them
        assert lagged.outputs[0].text == "one two three" and lagged.outputs[0].token_ids == [0, 1, 2]
        assert lagged.prompt_token_ids == [5]
        assert stream.poll() is None and not stream.finished
        stream.deliver(delta("r", CompletionDelta(0, "!", [3], finish_reason="length"), finished=True))
        rest = [d async for d in stream]
        assert [d.outputs[0].text for d in rest] == ["!"] and stream.finished

    asyncio.run(main())


def test_stream_reports_an_error_after_the_deltas_before_it() -> None:
    async def main() -> None:
        stream = RequestStream("r", asyncio.get_running_loop())
        stream.accept()
        stream.deliver(delta("r", CompletionDelta(0, "x", [1])))
        stream.fail(RuntimeError("engine died"))
        assert (await stream.get()).outputs[0].text == "x"
        with pytest.raises(RuntimeError, match="engine died"):
            stream.poll()

    asyncio.run(main())


# ---- the output processor emits deltas ---------------------------------------------------------


def step(request: Request, token_ids: list[int], status: RequestStatus | None = None) -> None:
    for token_id in token_ids:
        request.append_output_token(token_id)
    if status is not None:
        request.status = status


def test_processor_emits_what_each_step_added(tokenizer: Tokenizer) -> None:
    params = SamplingParams(max_tokens=64)
    samples, tokens = samples_of(tokenizer, " hello there, general", params)
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", "Say something:", samples)
    (lead,) = samples
    texts, token_lists = [], []
    for i, token_id in enumerate(tokens):
        last = i == len(tokens) - 1
        step(lead, [token_id], RequestStatus.FINISHED_LENGTH if last else None)
        deltas, stopped = processor.process([lead])
        assert stopped == [] and len(deltas) == 1
        d = deltas[0]
        assert (d.prompt_token_ids is not None) == (i == 0)  # the prompt rides the first only
        texts.append(d.outputs[0].text)
        token_lists.append(d.outputs[0].token_ids)
        assert d.finished == last and (d.outputs[0].finish_reason == "length") == last
    assert "".join(texts) == tokenizer.decode(tokens)
    assert token_lists == [[t] for t in tokens]


def test_processor_stop_string_ends_the_sample_in_its_delta(tokenizer: Tokenizer) -> None:
    params = SamplingParams(max_tokens=64, stop=["general"])
    samples, tokens = samples_of(tokenizer, " hello there, general kenobi", params)
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, samples)
    (lead,) = samples
    emitted = []
    for token_id in tokens:
        step(lead, [token_id])
        deltas, stopped = processor.process([lead])
        emitted.append(deltas[0].outputs[0])
        if stopped:
            break
    assert stopped == [lead]
    final = emitted[-1]
    assert final.finish_reason == "stop" and final.stop_reason == "general"
    assert "".join(d.text for d in emitted) == " hello there, "


def test_processor_groups_samples_and_abort_finishes_the_rest(tokenizer: Tokenizer) -> None:
    params = SamplingParams(n=2, max_tokens=64, logprobs=0)
    samples, tokens = samples_of(tokenizer, " a b", params)
    processor = OutputProcessor(tokenizer)
    processor.add_request("r", None, samples)
    first, second = samples
    step(first, tokens[:1])
    first.output_logprobs.append({tokens[0]: Logprob(-0.5, 1)})
    first.cumulative_logprob = -0.5
    deltas, _ = processor.process([first])
    assert len(deltas) == 1 and deltas[0].num_samples == 2
    assert [s.index for s in deltas[0].outputs] == [0]  # only the sample that changed
    assert deltas[0].outputs[0].logprobs[0][tokens[0]].decoded_token is not None
    aborted = processor.finish_aborted("r")
    assert aborted.finished and {s.index: s.finish_reason for s in aborted.outputs} == {0: "abort", 1: "abort"}
    assert second.output_token_ids == []


def test_accumulator_builds_and_forgets_finished_requests() -> None:
    from pagoda.outputs import OutputAccumulator

    outputs = OutputAccumulator()
    outputs.add(delta("a", CompletionDelta(0, "x", [1]), prompt_token_ids=[4]))
    outputs.add(delta("b", CompletionDelta(0, "y", [2]), prompt_token_ids=[5]))
    done = outputs.add(delta("a", CompletionDelta(0, "z", [3], finish_reason="length"), finished=True))
    assert done.finished and done.outputs[0].text == "xz" and done.prompt_token_ids == [4]
    again = outputs.add(delta("a", CompletionDelta(0, "new", [9]), prompt_token_ids=[6]))
    assert again.outputs[0].text == "new"  # a finished request id starts afresh
