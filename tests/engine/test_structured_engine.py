"""Structured output in the engine: constrained outputs are valid whatever the (random)
model prefers, masking is exact, and unconstrained requests are untouched."""

from __future__ import annotations

import json
import random
import re
import time

import llguidance
import pytest

from model_factory import build_model
from pagoda import LLM, SamplingParams
from pagoda.config import EngineConfig
from pagoda.engine.engine_request import EngineRequest
from pagoda.engine.llm_engine import LLMEngine
from pagoda.structured import StructuredOutputsParams
from pagoda.structured.grammar import build_grammar
from structured_schemas import random_object_schema

jsonschema = pytest.importorskip("jsonschema", reason="jsonschema is in the test extra")

SCHEMA = {
    "type": "object",
    "additionalProperties": False,
    "required": ["name", "age", "tags"],
    "properties": {
        "name": {"type": "string", "maxLength": 6},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "tags": {"type": "array", "items": {"enum": ["a", "b", "c"]}, "maxItems": 3},
    },
}


@pytest.fixture(scope="module")
def llm(llama_dir) -> LLM:
    return LLM(model=str(llama_dir))


def constrained(temperature: float = 0.0, max_tokens: int = 200, **kind) -> SamplingParams:
    return SamplingParams(
        temperature=temperature,
        max_tokens=max_tokens,
        seed=7 if temperature else None,
        structured_outputs=StructuredOutputsParams(**kind),
    )


def test_fifty_random_json_schemas_parse_and_validate(llm):
    rng = random.Random(0)
    schemas = [random_object_schema(rng) for _ in range(50)]
    params = [constrained(temperature=rng.choice([0.0, 1.0]), max_tokens=300, json=s) for s in schemas]
    outputs = llm.generate(["{"] * 25 + ["def f(x):"] * 25, params)
    for schema, output in zip(schemas, outputs):
        completion = output.outputs[0]
        assert completion.finish_reason == "stop", (schema, completion.text)
        jsonschema.validate(json.loads(completion.text), schema)
    stats = llm.engine.get_stats().structured_output
    assert stats.requests_by_kind["json"] >= 50 and stats.num_compiles >= 1


def test_regex_choice_grammar_and_json_object(llm):
    regex = r"[0-9]{3}-[a-z]{2,4}(\.[a-z]+)?"
    choices = ["yes", "no", "maybe so"]
    outputs = llm.generate(
        ["a b c"] * 5,
        [
            SamplingParams(
                temperature=1.0, seed=3, n=4, max_tokens=50, structured_outputs=StructuredOutputsParams(regex=regex)
            ),
            SamplingParams(
                temperature=1.0, seed=4, n=4, max_tokens=50, structured_outputs=StructuredOutputsParams(choice=choices)
            ),
            constrained(grammar='root ::= "(" num ("+" num)* ")"\nnum ::= [1-9] [0-9]?', max_tokens=60),
            constrained(json_object=True, max_tokens=300),
            constrained(json={"type": "array", "items": {"type": "boolean"}, "minItems": 2, "maxItems": 2}),
        ],
    )
    assert all(re.fullmatch(regex, c.text) for c in outputs[0].outputs)
    assert all(c.text in choices for c in outputs[1].outputs)
    grammar_text = outputs[2].outputs[0].text
    assert (
        re.fullmatch(r"\([1-9][0-9]?(\+[1-9][0-9]?)*\)", grammar_text)
        or outputs[2].outputs[0].finish_reason == "length"
    )
    assert isinstance(json.loads(outputs[3].outputs[0].text), dict)
    value = json.loads(outputs[4].outputs[0].text)
    assert len(value) == 2 and all(isinstance(v, bool) for v in value)


def test_masked_sampling_never_emits_a_rejected_token(llm):
    """Property: replaying every emitted token through a fresh matcher accepts all of them,
    for random schemas and sampled (not greedy) decoding with top-k/p and penalties."""
    rng = random.Random(1)
    tokenizer = llm.engine.core.structured.compiler.tokenizer
    for _ in range(3):
        schemas = [random_object_schema(rng) for _ in range(6)]
        params = [
            SamplingParams(
                temperature=1.3,
                top_p=0.9,
                top_k=50,
                presence_penalty=1.0,
                seed=rng.randint(0, 99),
                max_tokens=120,
                structured_outputs=StructuredOutputsParams(json=s),
            )
            for s in schemas
        ]
        for schema, output in zip(schemas, llm.generate(["x = "] * 6, params)):
            tokens = output.outputs[0].token_ids
            matcher = llguidance.LLMatcher(tokenizer, build_grammar(StructuredOutputsParams(json=schema)))
            for token in tokens:
                assert matcher.consume_token(token), matcher.get_error()
            if output.outputs[0].finish_reason == "stop":
                assert matcher.is_accepting()


def test_unconstrained_rows_are_bit_identical_in_a_mixed_batch(llama_dir):
    """The same batch shapes step by step (the stand-ins run exactly as long as the constrained
    requests did; no prefix cache), so any difference could only come from the mask."""
    llm = LLM(model=str(llama_dir), enable_prefix_caching=False)
    prompts = ["def main():", "import os", "class A:", "x = [1, 2"]
    plain = [
        SamplingParams(temperature=0.0, max_tokens=24, logprobs=3, ignore_eos=True),
        SamplingParams(temperature=0.9, seed=11, max_tokens=24, logprobs=2, ignore_eos=True),
    ]
    mixed_params = plain + [
        constrained(json=SCHEMA, max_tokens=24),
        constrained(temperature=1.0, regex="[a-z]{5,30}", max_tokens=24),
    ]
    llm.generate(prompts, mixed_params)  # compiled grammars are cached: next time none waits a step
    mixed = llm.generate(prompts, mixed_params)
    stand_ins = [
        SamplingParams(temperature=0.0, ignore_eos=True, max_tokens=len(o.outputs[0].token_ids)) for o in mixed[2:]
    ]
    alone = llm.generate(prompts, plain + stand_ins)
    for a, b in zip(alone[:2], mixed[:2]):
        assert a.outputs[0].token_ids == b.outputs[0].token_ids
        assert a.outputs[0].logprobs == b.outputs[0].logprobs  # exact floats, not approximately


def test_logprobs_are_those_of_the_masked_distribution(llm):
    output = llm.generate(["hi"], constrained(choice=["yes", "no"], max_tokens=5).clone(logprobs=5))[0]
    first = output.outputs[0].logprobs[0]
    finite = {t: lp.logprob for t, lp in first.items() if lp.logprob != float("-inf")}
    assert output.outputs[0].token_ids[0] in finite
    assert abs(sum(2.718281828459045**lp for lp in finite.values()) - 1.0) < 1e-3 or len(finite) <= 5


@pytest.fixture(scope="module")
def draft_dir(tmp_path_factory, llama_dir):
    return build_model(tmp_path_factory.mktemp("so-draft") / "draft", "llama", seed=5, num_hidden_layers=1)


def test_same_constrained_output_with_engine_features(llama_dir, draft_dir):
    """Greedy constrained outputs do not change with prefix caching, chunked prefill,
    preemption, n > 1 or speculative decoding (drafts checked against the matcher)."""
    prompt = "def handler(event, context):\n    return " * 3
    params = [
        constrained(json=SCHEMA, max_tokens=80),
        constrained(regex=r"(ab|cd|[0-9]){4,12}", max_tokens=40),
        SamplingParams(temperature=0.0, max_tokens=40, ignore_eos=True),
    ]
    prompts = [prompt, prompt + "x", "y" + prompt]
    baseline = [
        o.outputs[0].token_ids for o in LLM(model=str(llama_dir), enable_prefix_caching=False).generate(prompts, params)
    ]
    json.loads(LLM(model=str(llama_dir)).engine.tokenizer.decode(baseline[0]))
    runs = {
        "prefix cache": dict(),
        "chunked": dict(max_num_batched_tokens=16),
        "preempted": dict(num_kv_blocks=14, max_num_batched_tokens=32),
        "ngram": dict(speculative="ngram"),
        "draft": dict(speculative="draft", draft_model=str(draft_dir), num_speculative_tokens=3),
    }
    for name, engine_args in runs.items():
        llm = LLM(model=str(llama_dir), **engine_args)
        llm.generate(prompts, params)  # warm the prefix cache
        outputs = [o.outputs[0].token_ids for o in llm.generate(prompts, params)]
        assert outputs == baseline, name
        stats = llm.engine.get_stats()
        if name == "preempted":
            assert stats.num_preemptions > 0
        if name in ("ngram", "draft"):
            assert stats.spec_decode.num_drafts > 0
        assert stats.structured_output.cache_hits > 0
    n_out = LLM(model=str(llama_dir)).generate([prompt], params[0].clone(n=3))[0]
    assert [c.token_ids for c in n_out.outputs] == [baseline[0]] * 3


def test_grammar_end_stops_the_request(llm):
    output = llm.generate(["z"], constrained(choice=["done"], max_tokens=50))[0].outputs[0]
    assert output.text == "done" and output.finish_reason == "stop"


def test_bad_grammar_and_compile_timeout_fail_only_their_request(llama_dir, monkeypatch):
    engine = LLMEngine(
        EngineConfig(model=str(llama_dir), structured_output_timeout=0.2, structured_output_compile_threads=2)
    )
    compiler = engine.core.structured.compiler
    original = compiler._compile

    def slow_compile(params):
        if params.regex == "slow":
            time.sleep(1.0)
        return original(params)

    monkeypatch.setattr(compiler, "_compile", slow_compile)
    engine.add_request(EngineRequest("slow", "a", constrained(regex="slow")))
    engine.add_request(EngineRequest("bad", "a", constrained(regex="[a-")))
    engine.add_request(EngineRequest("plain", "a", SamplingParams(temperature=0.0, max_tokens=5)))
    assert engine.is_waiting_for_grammar("slow") and not engine.is_waiting_for_grammar("plain")
    outcomes, finished = {}, {}
    deadline = time.time() + 30
    while engine.has_unfinished_requests() and time.time() < deadline:
        step = engine.step()
        for output in step.deltas:
            if output.finished:
                finished[output.request_id] = output
        outcomes.update((request_id, str(error)) for request_id, error in step.refused.items())
    assert "structured_outputs.regex" in outcomes["bad"]
    assert "--structured-output-timeout" in outcomes["slow"]
    assert finished["plain"].outputs[0].finish_reason == "length"
    assert not engine.core.requests and engine.core.kv_cache.num_held_blocks() == 0
    stats = engine.get_stats().structured_output
    assert stats.num_timeouts == 1 and stats.num_failures == 1
    with pytest.raises(ValueError, match="structured_outputs.json"):
        LLM(model=str(llama_dir)).generate(["a"], constrained(json={"type": "no such type"}))


def test_params_need_exactly_one_constraint():
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams()
    with pytest.raises(ValueError, match="exactly one"):
        StructuredOutputsParams(regex="a", choice=["a"])
    with pytest.raises(ValueError, match="choice"):
        StructuredOutputsParams(choice=[])
    params = SamplingParams(structured_outputs={"json": {"type": "object"}})
    assert params.structured_outputs.kind == "json"
    assert (
        StructuredOutputsParams(json={"b": 1, "a": 2}).cache_key()
        == StructuredOutputsParams(json={"a": 2, "b": 1}).cache_key()
    )


def test_abort_while_waiting_for_the_grammar(llama_dir, monkeypatch):
    engine = LLMEngine(EngineConfig(model=str(llama_dir)))
    compiler = engine.core.structured.compiler
    original = compiler._compile
    monkeypatch.setattr(compiler, "_compile", lambda params: (time.sleep(0.3), original(params))[1])
    engine.add_request(EngineRequest("waiting", "a", constrained(regex="[a-z]{3}")))
    first = engine.step()
    grammar_outcomes = [*first.accepted, *first.refused]
    engine.abort_request(["waiting"])
    outputs = []
    while engine.has_unfinished_requests():
        step = engine.step()
        outputs.extend(step.deltas)
        grammar_outcomes += [*step.accepted, *step.refused]
    assert [o.outputs[0].finish_reason for o in outputs] == ["abort"]
    assert not engine.core.requests and grammar_outcomes == []


def test_a_matcher_error_stops_only_its_request(llm):
    """A grammar that errs mid-generation (here: forced by consuming a token it rejects) ends
    that request; the batch samples on."""
    from pagoda.structured.matcher import RequestMatcher

    original = RequestMatcher.fill_mask

    def failing(self, bitmask, row):
        original(self, bitmask, row)
        if self.num_accepted == 2 and self.kind == "regex":
            self.matcher.consume_token(0)  # EOS where the regex needs letters: error state
            original(self, bitmask, row)

    RequestMatcher.fill_mask = failing
    try:
        outputs = llm.generate(
            ["q", "r"],
            [
                constrained(regex="[a-z]{20}", max_tokens=30),
                SamplingParams(temperature=0.0, max_tokens=10, ignore_eos=True),
            ],
        )
    finally:
        RequestMatcher.fill_mask = original
    failed = outputs[0].outputs[0]  # the token sampled after the error is not emitted
    assert failed.finish_reason == "stop" and len(failed.token_ids) == 2 and re.fullmatch("[a-z]+", failed.text)
    assert len(outputs[1].outputs[0].token_ids) == 10


def test_process_transport_defers_acceptance_until_the_grammar_compiles(llama_dir):
    """Across the engine process: a constrained request is accepted once compiled, a grammar
    the engine cannot compile fails its add_request with ValueError, and stats carry the
    structured-output counters."""
    import asyncio

    from pagoda.engine.async_llm import AsyncLLM

    engine = AsyncLLM(EngineConfig(model=str(llama_dir), num_threads=1, num_kv_blocks=64), transport="process")
    try:

        async def main() -> tuple:
            outputs = [
                o async for o in engine.generate(EngineRequest("ok", [5, 6, 7], constrained(choice=["alpha", "beta"])))
            ]
            with pytest.raises(ValueError, match="structured_outputs.regex"):
                await engine.add_request(EngineRequest("bad", [5, 6], constrained(regex="(unclosed")))
            plain = [o async for o in engine.generate(EngineRequest("plain", [5, 6], SamplingParams(max_tokens=3)))]
            return outputs[-1], plain[-1]

        constrained_output, plain_output = asyncio.run(main())
        assert constrained_output.outputs[0].text in ("alpha", "beta")
        assert plain_output.finished
        stats = engine.get_stats().structured_output
        assert stats.requests_by_kind["choice"] == 1 and stats.num_failures == 1
    finally:
        engine.shutdown()


def test_a_failure_while_filling_masks_stops_those_requests_not_the_engine(llm, monkeypatch):
    from pagoda.structured.manager import GrammarMasks

    def broken(self):
        raise RuntimeError("simulated bug")

    monkeypatch.setattr(GrammarMasks, "_fill_rows", broken)
    outputs = llm.generate(
        ["q", "r"],
        [constrained(regex="[a-z]{20}", max_tokens=30), SamplingParams(temperature=0.0, max_tokens=5, ignore_eos=True)],
    )
    assert outputs[0].outputs[0].finish_reason == "stop" and outputs[0].outputs[0].token_ids == []
    assert len(outputs[1].outputs[0].token_ids) == 5
    monkeypatch.undo()
    assert re.fullmatch(
        "[a-z]{20}", llm.generate(["q"], constrained(regex="[a-z]{20}", max_tokens=30))[0].outputs[0].text
    )


def test_llm_chat_with_a_schema_and_tools(llama_dir, tmp_path):
    """LLM.chat passes tools to the template and honours structured_outputs."""
    import shutil

    model = tmp_path / "model"
    shutil.copytree(llama_dir, model)
    config_path = model / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config["chat_template"] = (
        "{% for tool in tools or [] %}{{ tool.function.name }};{% endfor %}"
        "{% for m in messages %}{{ m.content }}{% endfor %}"
    )
    config_path.write_text(json.dumps(config))
    llm = LLM(model=str(model))
    tool = {"type": "function", "function": {"name": "lookup", "parameters": {"type": "object"}}}
    messages = [{"role": "user", "content": "hi"}]
    with_tools = llm.chat(messages, constrained(choice=["A", "B"]), tools=[tool])[0]
    without = llm.chat(messages, constrained(choice=["A", "B"]))[0]
    assert with_tools.outputs[0].text in ("A", "B")
    assert llm.tokenizer.decode(with_tools.prompt_token_ids).startswith("lookup;")
    assert len(with_tools.prompt_token_ids) > len(without.prompt_token_ids)
