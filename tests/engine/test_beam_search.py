"""Beam search (`use_beam_search`, `LLM.beam_search`): the same beams and scores as
transformers' `num_beams` generation, nothing held once done or aborted, beams sharing their
prefix through the prefix cache, and the requests it refuses."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_helpers import assert_idle
from model_factory import build_model, load_hf_model
from pagoda import LLM, SamplingParams
from pagoda.engine.beam_search import BeamSearch, BeamSearchParams, beam_score
from pagoda.engine.engine_request import EngineRequest
from pagoda.errors import InvalidRequest
from pagoda.outputs import Logprob
from pagoda.sampling_params import MAX_BEAM_WIDTH

# A token these random weights pick often, made the model's end-of-sequence token (beside the
# tokenizer's, token 0), so beams end at different lengths.
FREQUENT_TOKEN = 31
EOS_TOKEN_IDS = [FREQUENT_TOKEN, 0]
TOLERANCE = 2e-4


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return build_model(tmp_path_factory.mktemp("beam-model") / "llama", "llama", eos_token_id=FREQUENT_TOKEN)


@pytest.fixture(scope="module")
def hf_model(model_dir: Path):
    return load_hf_model(model_dir)


@pytest.fixture(scope="module")
def llm(model_dir: Path) -> LLM:
    return LLM(model=str(model_dir), dtype="float32", block_size=8)


def prompts_for(vocab_size: int) -> list[list[int]]:
    generator = torch.Generator().manual_seed(3)
    return [torch.randint(5, vocab_size, (n,), generator=generator).tolist() for n in (7, 20, 33)]


def hf_beams(
    model, prompt: list[int], width: int, max_tokens: int, length_penalty: float, early_stopping
) -> tuple[list[list[int]], list[float]]:
    with torch.no_grad():
        out = model.generate(
            torch.tensor([prompt]),
            num_beams=width,
            num_return_sequences=width,
            length_penalty=length_penalty,
            early_stopping=early_stopping,
            max_new_tokens=max_tokens,
            do_sample=False,
            eos_token_id=EOS_TOKEN_IDS,
            pad_token_id=0,
            output_scores=True,
            return_dict_in_generate=True,
        )
    return [s[len(prompt) :].tolist() for s in out.sequences], out.sequences_scores.tolist()


@pytest.mark.parametrize(
    "width, max_tokens, length_penalty, early_stopping",
    [
        (2, 10, 1.0, False),
        (4, 12, 0.5, True),
        (3, 9, -1.0, "never"),
        (4, 8, 2.0, "never"),
    ],
)
def test_beams_and_scores_equal_transformers(
    llm: LLM, hf_model, width: int, max_tokens: int, length_penalty: float, early_stopping
) -> None:
    prompts = prompts_for(hf_model.config.vocab_size)
    params = BeamSearchParams(
        beam_width=width, max_tokens=max_tokens, length_penalty=length_penalty, early_stopping=early_stopping
    )
    outputs = llm.beam_search([{"prompt_token_ids": p} for p in prompts], params)
    ended_by_eos = 0
    for prompt, output in zip(prompts, outputs, strict=True):
        sequences, scores = hf_beams(hf_model, prompt, width, max_tokens, length_penalty, early_stopping)
        assert len(output.sequences) == width
        for beam, reference, reference_score in zip(output.sequences, sequences, scores, strict=True):
            generated = beam.tokens[len(prompt) :]
            assert beam.tokens[: len(prompt)] == prompt
            # transformers pads the shorter beams (with the first EOS token here: the pad id is 0)
            assert generated == reference[: len(generated)] and set(reference[len(generated) :]) <= {FREQUENT_TOKEN}
            assert beam.score == pytest.approx(reference_score, abs=TOLERANCE)
            assert beam.score == pytest.approx(beam_score(beam.cum_logprob, len(generated), length_penalty))
            assert beam.cum_logprob == pytest.approx(
                sum(entry[t].logprob for entry, t in zip(beam.logprobs, generated)), abs=1e-4
            )
            if generated[-1] in EOS_TOKEN_IDS:
                ended_by_eos += 1
                assert beam.finish_reason == "stop"
            else:
                assert beam.finish_reason == "length" and len(generated) == max_tokens
        assert [b.score for b in output.sequences] == sorted((b.score for b in output.sequences), reverse=True)
    assert ended_by_eos  # the end-of-sequence path was exercised
    assert_idle(llm)


def test_n_best_of_a_wider_search_and_the_prefix_cache_shares_the_beams(llm: LLM, hf_model) -> None:
    prompt = prompts_for(hf_model.config.vocab_size)[2]
    hits_before = llm.engine.get_stats().prefix_cache_hits
    wide = llm.generate([prompt], SamplingParams(use_beam_search=True, n=4, max_tokens=10))[0]
    assert llm.engine.get_stats().prefix_cache_hits > hits_before  # later steps reuse the earlier blocks
    best_two = llm.generate([prompt], SamplingParams(use_beam_search=True, n=2, best_of=4, max_tokens=10, logprobs=2))[
        0
    ]
    assert [c.token_ids for c in best_two.outputs] == [c.token_ids for c in wide.outputs[:2]]
    for completion in best_two.outputs:
        for entry, token_id in zip(completion.logprobs, completion.token_ids):
            assert token_id in entry and len(entry) <= 3
            assert entry[token_id].decoded_token is not None
    assert_idle(llm)


def test_abort_mid_search_frees_every_beam(llm: LLM, hf_model) -> None:
    prompt = prompts_for(hf_model.config.vocab_size)[1]
    engine = llm.engine
    engine.add_request(EngineRequest("beams", prompt, SamplingParams(use_beam_search=True, n=3, max_tokens=20)))
    for _ in range(3):
        engine.step()
    assert len(engine.core.requests) == 3  # the next step's beams, one request each
    engine.abort_request(["beams"])
    output = engine.step()
    [delta] = [d for d in output.deltas if d.request_id == "beams"]
    assert delta.finished and [s.finish_reason for s in delta.outputs] == ["abort"] * 3
    assert_idle(llm)


def test_refused_requests(llm: LLM, hf_model) -> None:
    prompt = prompts_for(hf_model.config.vocab_size)[0]
    with pytest.raises(InvalidRequest, match="at most") as too_wide:
        SamplingParams(use_beam_search=True, n=MAX_BEAM_WIDTH + 1)
    assert too_wide.value.param == "n"
    for fields, param in [
        ({"stop": ["x"]}, "stop"),
        ({"repetition_penalty": 1.2}, "repetition_penalty"),
        ({"best_of": 1, "n": 2}, "best_of"),
        ({"early_stopping": "sometimes"}, "early_stopping"),
        ({"length_penalty": 1e308}, "length_penalty"),
    ]:
        with pytest.raises(InvalidRequest) as refused:
            SamplingParams(use_beam_search=True, **fields)
        assert refused.value.param == param
    with pytest.raises(InvalidRequest, match="needs use_beam_search"):
        SamplingParams(n=1, best_of=2)
    # The width plus the model's EOS tokens must fit the logprobs the engine reports (a model
    # with six EOS tokens, here).
    runner = llm.engine.beam_searches
    eos_token_ids, runner.eos_token_ids = runner.eos_token_ids, frozenset(range(6))
    try:
        with pytest.raises(InvalidRequest, match="at most 14 beams"):
            llm.generate([prompt], SamplingParams(use_beam_search=True, n=MAX_BEAM_WIDTH, max_tokens=4))
    finally:
        runner.eos_token_ids = eos_token_ids
    with pytest.raises(InvalidRequest, match="context length"):
        llm.generate([prompt], SamplingParams(use_beam_search=True, n=2, max_tokens=10**6))
    assert_idle(llm)


def test_search_stops_once_the_best_beam_cannot_win() -> None:
    """early_stopping False: stop as soon as the best running beam, at its current length, scores
    below the worst of `width` hypotheses; True: as soon as `width` hypotheses exist."""

    def entry(**logprobs: float) -> dict[int, Logprob]:
        ids = {"eos": 0, "a": 1, "b": 2, "c": 3}
        ranked = sorted(logprobs.items(), key=lambda item: -item[1])
        return {ids[name]: Logprob(value, rank) for rank, (name, value) in enumerate(ranked, 1)}

    for early_stopping, steps in ((True, 2), (False, 2)):
        search = BeamSearch(2, 10, [0], early_stopping=early_stopping)
        search.advance([entry(eos=-0.1, a=-1.0, b=-3.0, c=-4.0)])
        assert not search.done and len(search.finished) == 1
        search.advance([entry(eos=-0.2, a=-2.0, b=-3.0, c=-5.0), entry(eos=-4.0, a=-5.0, b=-6.0, c=-7.0)])
        assert search.done == (steps == 2)
        assert [h.beam.token_ids for h in search.finished] == [[0], [1, 0]]
