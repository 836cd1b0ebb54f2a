"""Speculative drafts of constrained requests are checked against the grammar: n-gram drafts
end at the first token the grammar rejects, a draft model samples under the grammar. Outputs
stay exactly those of decoding without speculation, and acceptance is never below that of
drafts made without the grammar (the behaviour before, reproduced here by switching the
check off)."""

from __future__ import annotations

import json

import pytest

from model_factory import build_model
from pagoda import LLM, SamplingParams
from pagoda.spec_decode.draft_proposer import DraftModelProposer
from pagoda.structured import StructuredOutputsParams
from pagoda.structured.matcher import RequestMatcher

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the test extra")

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["id", "kind", "tags"],
    "properties": {
        "id": {"type": "integer", "minimum": 0, "maximum": 99999},
        "kind": {"enum": ["alpha", "beta", "gamma"]},
        "tags": {"type": "array", "items": {"enum": ["x", "y"]}, "maxItems": 4},
    },
}
# Prompts that repeat JSON fragments, so n-gram lookup finds (partly wrong) continuations.
PROMPTS = [
    '{"id": 12, "kind": "beta", "tags": ["x"]} {"id": 7, "kind": "alpha", "tags": []} ' * 2,
    '{"kind": "gamma", "id": 3} {"tags": ["y", "x"], "kind": "beta"} ' * 2,
    "{ id kind tags alpha beta gamma } " * 3,
]


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, llama_dir):
    return build_model(tmp_path_factory.mktemp("cdraft") / "draft", "llama", seed=5, num_hidden_layers=1)


def params() -> list[SamplingParams]:
    json_params = SamplingParams(
        temperature=0.0, max_tokens=60, structured_outputs=StructuredOutputsParams(json=SCHEMA)
    )
    regex = SamplingParams(
        temperature=0.0,
        max_tokens=30,
        structured_outputs=StructuredOutputsParams(regex=r"(alpha|beta|gamma)( [0-9]{1,3}){2,5}"),
    )
    return [json_params] * len(PROMPTS) + [regex]


def run(llama_dir, **engine_args):
    llm = LLM(model=str(llama_dir), max_num_seqs=8, **engine_args)
    outputs = llm.generate(PROMPTS + [PROMPTS[0]], params())
    stats = llm.engine.get_stats().spec_decode
    assert not llm.engine.has_unfinished_requests() and llm.engine.core.kv_cache.num_held_blocks() == 0
    return [o.outputs[0] for o in outputs], stats


def unchecked_drafts(monkeypatch) -> None:
    """The behaviour before: drafts proposed without looking at the grammar."""
    monkeypatch.setattr(RequestMatcher, "grammar_prefix", lambda self, drafts: len(drafts))
    monkeypatch.setattr(RequestMatcher, "advance_draft", lambda self, token_id: False)
    monkeypatch.setattr(DraftModelProposer, "mask_to_grammar", staticmethod(lambda logits, requests: None))


@pytest.mark.parametrize("method", ["ngram", "draft"])
def test_grammar_checked_drafts_keep_outputs_and_never_lower_acceptance(
    llama_dir, draft_dir, method, monkeypatch
) -> None:
    engine_args = {"speculative": method, "num_speculative_tokens": 4}
    if method == "draft":
        engine_args["draft_model"] = str(draft_dir)
    plain, _ = run(llama_dir)
    checked, checked_stats = run(llama_dir, **engine_args)
    with monkeypatch.context() as patch:
        unchecked_drafts(patch)
        unchecked, unchecked_stats = run(llama_dir, **engine_args)

    for completions in (checked, unchecked):
        assert [c.token_ids for c in completions] == [c.token_ids for c in plain]
    for completion in checked[: len(PROMPTS)]:
        assert completion.finish_reason == "stop", completion.text
        jsonschema.validate(json.loads(completion.text), SCHEMA)
    assert checked_stats.num_drafts > 0 and unchecked_stats.num_drafts > 0
    assert checked_stats.acceptance_rate >= unchecked_stats.acceptance_rate
    assert checked_stats.mean_accepted_length >= unchecked_stats.mean_accepted_length
    print(
        method,
        "acceptance checked",
        round(checked_stats.acceptance_rate, 3),
        "unchecked",
        round(unchecked_stats.acceptance_rate, 3),
        "mean accepted length",
        round(checked_stats.mean_accepted_length, 2),
        round(unchecked_stats.mean_accepted_length, 2),
    )


def test_grammar_prefix_and_tentative_drafts_roll_back(llama_dir) -> None:
    import llguidance
    import llguidance.hf
    from transformers import AutoTokenizer

    tokenizer = llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(str(llama_dir)))
    grammar = llguidance.LLMatcher.grammar_from_lark('start: "ab" "cd"')
    matcher = RequestMatcher(llguidance.LLMatcher(tokenizer, grammar), "grammar")
    good, bad = tokenizer.tokenize_str("abcd"), tokenizer.tokenize_str("x")
    assert matcher.grammar_prefix(good + bad + good) == len(good)
    assert matcher.grammar_prefix(bad + good) == 0
    assert all(matcher.advance_draft(t) for t in good) and matcher.is_terminated
    assert not matcher.advance_draft(good[0])  # the grammar has ended: drafting under it stops
    matcher.rollback_drafts()
    assert not matcher.is_terminated and matcher.num_drafted == 0 and matcher.num_accepted == 0
    assert matcher.accept(good) == len(good) and matcher.is_terminated
