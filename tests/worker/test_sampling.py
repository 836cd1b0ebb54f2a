"""Sampling knobs: validation, stop conditions, penalties and processors against references."""

from __future__ import annotations

import math

import pytest
import torch

from model_factory import load_hf_model
from pagoda import LLM, SamplingParams
from pagoda.engine.engine_request import EngineRequest
from pagoda.request import Request
from pagoda.worker.sampler import Sampler


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(model=str(llama_dir))


@pytest.mark.parametrize(
    "field, value",
    [
        ("temperature", -0.1),
        ("top_p", 0.0),
        ("top_p", 1.5),
        ("top_k", -2),
        ("min_p", 1.5),
        ("repetition_penalty", 0.0),
        ("presence_penalty", 3.0),
        ("frequency_penalty", -2.5),
        ("max_tokens", 0),
        ("min_tokens", -1),
        ("n", 0),
        ("logprobs", 21),
        ("prompt_logprobs", -1),
        ("stop", [""]),
        ("stop_token_ids", [-1]),
        ("logit_bias", {5: 200.0}),
    ],
)
def test_invalid_values_name_the_parameter(field, value):
    with pytest.raises(ValueError, match=field):
        SamplingParams(**{field: value})


def test_min_tokens_above_max_tokens_is_rejected():
    with pytest.raises(ValueError, match="min_tokens"):
        SamplingParams(min_tokens=5, max_tokens=3)


def test_request_level_errors(llm):
    engine = llm.engine
    params = SamplingParams(max_tokens=4)
    with pytest.raises(ValueError, match="empty"):
        engine.add_request(EngineRequest("a", [], params))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request(EngineRequest("b", [5, 10**6], params))
    with pytest.raises(ValueError, match="outside the vocabulary"):
        engine.add_request(EngineRequest("c", [5, -1], params))
    with pytest.raises(ValueError, match=r"maximum context length is 512.*600.*\(100 in the prompt, 500"):
        engine.add_request(EngineRequest("d", [5] * 100, SamplingParams(max_tokens=500)))
    with pytest.raises(ValueError, match="logit_bias"):
        engine.add_request(EngineRequest("e", [5], SamplingParams(logit_bias={10**6: 1.0})))
    assert not engine.has_unfinished_requests()


def test_request_that_can_never_fit_is_rejected_at_admission(llama_dir):
    small = LLM(model=str(llama_dir), num_kv_blocks=4)
    with pytest.raises(ValueError, match="KV blocks"):
        small.generate([[5] * 60], SamplingParams(max_tokens=10))


def test_max_tokens_none_runs_to_context_length(llama_dir):
    llm = LLM(model=str(llama_dir), max_model_len=40)
    output = llm.generate([[5] * 30], SamplingParams(temperature=0.0, max_tokens=None, ignore_eos=True))[0]
    assert len(output.outputs[0].token_ids) == 10
    assert output.outputs[0].finish_reason == "length"


def greedy_tokens(llm, prompt, **params):
    defaults = dict(temperature=0.0, max_tokens=24, ignore_eos=True)
    return llm.generate([prompt], SamplingParams(**{**defaults, **params}))[0].outputs[0]


def test_stop_token_ids_and_min_tokens(llm):
    prompt = [5, 6, 7, 8]
    free = greedy_tokens(llm, prompt).token_ids
    stop_at = free[5]
    first = free.index(stop_at)
    stopped = greedy_tokens(llm, prompt, stop_token_ids=[stop_at])
    assert stopped.token_ids == free[: first + 1]
    assert stopped.finish_reason == "stop" and stopped.stop_reason == stop_at
    # min_tokens masks the stop token until enough tokens were produced.
    late = greedy_tokens(llm, prompt, stop_token_ids=[stop_at], min_tokens=first + 2)
    assert len(late.token_ids) >= first + 2
    assert stop_at not in late.token_ids[: first + 2]


def test_eos_ends_a_request_unless_ignored(llm):
    prompt = [5, 6, 7, 8]
    free = greedy_tokens(llm, prompt).token_ids
    llm.engine.core.requests.clear()
    # Make token free[3] the model's EOS by biasing nothing: use stop via the eos set instead.
    eos = free[3]
    original = llm.engine.eos_token_ids
    llm.engine.eos_token_ids = frozenset({eos})
    try:
        ended = greedy_tokens(llm, prompt, ignore_eos=False)
        ignored = greedy_tokens(llm, prompt, ignore_eos=True)
    finally:
        llm.engine.eos_token_ids = original
    assert ended.token_ids == free[: free.index(eos) + 1] and ended.finish_reason == "stop"
    assert ended.stop_reason is None
    assert ignored.token_ids == free


def test_stop_strings_trim_text(llm):
    prompt = [5, 6, 7, 8]
    full = greedy_tokens(llm, prompt)
    text = full.text
    assert len(text) > 12
    stop = text[6:9]
    expected = text[: text.index(stop)]
    trimmed = greedy_tokens(llm, prompt, stop=[stop])
    assert trimmed.text == expected and trimmed.finish_reason == "stop" and trimmed.stop_reason == stop
    kept = greedy_tokens(llm, prompt, stop=[stop], include_stop_str_in_output=True)
    assert kept.text == expected + stop
    assert not llm.engine.has_unfinished_requests()
    assert llm.engine.core.kv_cache.num_held_blocks() == 0


def test_repetition_penalty_matches_transformers(llama_dir, llm):
    hf_model = load_hf_model(llama_dir)
    prompt = [5, 6, 7, 8, 5, 6]
    with torch.no_grad():
        expected = hf_model.generate(
            torch.tensor([prompt]),
            do_sample=False,
            max_new_tokens=20,
            min_new_tokens=20,
            repetition_penalty=1.8,
            pad_token_id=0,
        )
    got = greedy_tokens(llm, prompt, max_tokens=20, repetition_penalty=1.8).token_ids
    assert got == expected[0, len(prompt) :].tolist()


def make_request(params: SamplingParams, output_ids=(), prompt=(1, 2)) -> Request:
    request = Request("r", list(prompt), params, frozenset(), 100)
    for token in output_ids:
        request.append_output_token(token)
    return request


def test_presence_and_frequency_penalties_follow_openai_definition():
    sampler = Sampler(vocab_size=6, device=torch.device("cpu"), seed=0)
    logits = torch.tensor([[0.0, 1.0, 2.0, 3.0, 2.9, 0.5]])
    request = make_request(
        SamplingParams(temperature=0.0, presence_penalty=0.5, frequency_penalty=0.3), output_ids=[3, 3, 4]
    )
    processed = sampler.process(logits, [request])
    expected = logits.clone()
    expected[0, 3] -= 0.5 + 2 * 0.3
    expected[0, 4] -= 0.5 + 0.3
    assert torch.allclose(processed, expected)
    assert sampler(logits, [request]).token_ids == [4]  # 2.9 - 0.8 beats 2.0 and 3.0 - 1.1


def test_logit_bias_and_top_k_top_p_min_p_restrict_the_support():
    sampler = Sampler(vocab_size=5, device=torch.device("cpu"), seed=0)
    logits = torch.log(torch.tensor([[0.4, 0.3, 0.15, 0.1, 0.05]]))
    cases = {
        "top_k": (SamplingParams(temperature=1.0, top_k=2), {0, 1}),
        "top_p": (SamplingParams(temperature=1.0, top_p=0.6), {0, 1}),
        "min_p": (SamplingParams(temperature=1.0, min_p=0.3), {0, 1, 2}),
        "bias": (SamplingParams(temperature=1.0, logit_bias={4: 100.0}), {4}),
    }
    for name, (params, support) in cases.items():
        seen = {sampler(logits, [make_request(params)]).token_ids[0] for _ in range(300)}
        assert seen == support, name


def test_temperature_sampling_follows_the_distribution():
    sampler = Sampler(vocab_size=4, device=torch.device("cpu"), seed=0)
    probs = torch.tensor([0.5, 0.25, 0.15, 0.1])
    logits = torch.log(probs).unsqueeze(0).repeat(4000, 1)
    params = SamplingParams(temperature=1.0)
    tokens = sampler(logits, [make_request(params) for _ in range(4000)]).token_ids
    counts = torch.bincount(torch.tensor(tokens), minlength=4).float() / 4000
    assert torch.allclose(counts, probs, atol=0.03)


def test_prompt_logprobs_match_transformers(llama_dir, llm):
    hf_model = load_hf_model(llama_dir)
    prompt = list(range(5, 45))
    output = llm.generate([prompt], SamplingParams(max_tokens=1, prompt_logprobs=2))[0]
    assert output.prompt_logprobs[0] is None and len(output.prompt_logprobs) == len(prompt)
    with torch.no_grad():
        reference = torch.log_softmax(hf_model(torch.tensor([prompt])).logits[0].float(), -1)
    for position in range(1, len(prompt)):
        entry = output.prompt_logprobs[position]
        token = prompt[position]
        assert math.isclose(entry[token].logprob, reference[position - 1, token].item(), abs_tol=1e-4)
        assert len(entry) >= 2


def test_chat_renders_template_and_generates(llm):
    output = llm.chat(
        [{"role": "user", "content": "hello"}], SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)
    )[0]
    expected = llm.tokenizer.encode_chat([{"role": "user", "content": "hello"}])
    assert output.prompt_token_ids == expected
    assert len(output.outputs[0].token_ids) == 5
