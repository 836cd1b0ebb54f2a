"""Tool-call parsers, streaming deltas and the grammars behind tool_choice (no model needed)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import llguidance
import llguidance.hf
import pytest
from transformers import AutoTokenizer

from pagoda.config import DEFAULT_MODEL_DIR
from pagoda.serve.api.tool_calls import ToolCallStream, get_parser, plan_tools
from pagoda.serve.api.tool_parsers import ToolSchemas
from pagoda.serve.errors import APIError
from pagoda.structured.grammar import build_grammar

TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "parameters": {
            "type": "object",
            "required": ["city"],
            "additionalProperties": False,
            "properties": {"city": {"type": "string"}, "days": {"type": "integer", "minimum": 1, "maximum": 7}},
        },
    },
}
TEMPLATE_WITH_TOOLS = "{% for tool in tools %}{{ tool | tojson }}{% endfor %}{{ messages[0].content }}"


def request(**fields) -> SimpleNamespace:
    extra = {k: fields.pop(k) for k in list(fields) if k == "parallel_tool_calls"}
    defaults = dict(tools=[TOOL], tool_choice=None, functions=None, function_call=None)
    return SimpleNamespace(**{**defaults, **fields}, model_extra=extra)


@pytest.fixture(scope="module")
def lltokenizer():
    return llguidance.hf.from_tokenizer(AutoTokenizer.from_pretrained(DEFAULT_MODEL_DIR))


def accepts(lltokenizer, grammar: str, text: str) -> bool:
    matcher = llguidance.LLMatcher(lltokenizer, grammar)
    return matcher.consume_tokens(lltokenizer.tokenize_str(text)) and not matcher.is_error()


def test_parsers_split_content_and_calls() -> None:
    hermes = get_parser("hermes").parse(
        'Let me check. <tool_call>\n{"name": "get_weather", "arguments": '
        '{"city": "Oslo"}}\n</tool_call>\n<tool_call>\n{"name": "f", '
        '"arguments": {}}\n</tool_call>'
    )
    assert hermes.content == "Let me check."
    assert [(c.name, json.loads(c.arguments)) for c in hermes.tool_calls] == [
        ("get_weather", {"city": "Oslo"}),
        ("f", {}),
    ]
    llama = get_parser("llama3_json").parse(
        '<|python_tag|>{"name": "a", "parameters": {"x": "1;2"}}; {"name": "b", "parameters": {}}'
    )
    assert [(c.name, json.loads(c.arguments)) for c in llama.tool_calls] == [("a", {"x": "1;2"}), ("b", {})]
    mistral = get_parser("mistral").parse('[TOOL_CALLS][{"name": "a", "arguments": {"k": [1]}}]')
    assert mistral.content is None and json.loads(mistral.tool_calls[0].arguments) == {"k": [1]}
    for name, text in (
        ("hermes", "no call here"),
        ("hermes", "<tool_call>{broken"),
        ("llama3_json", "plain text"),
        ("mistral", "[TOOL_CALLS] nope"),
    ):
        parsed = get_parser(name).parse(text)
        assert parsed.content == text and parsed.tool_calls == []


def test_stream_holds_back_a_possible_call_start_and_streams_arguments() -> None:
    text = 'Sure <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 2}}\n</tool_call>'
    stream = ToolCallStream(get_parser("hermes"), forced=False)
    content, deltas = "", []
    for end in range(1, len(text) + 1):  # one character per step: the worst case for partial markers
        new_content, new_deltas = stream.step(text[:end], finished=end == len(text))
        content += new_content
        deltas.extend(new_deltas)
    assert content == "Sure "
    assert deltas[0]["function"] == {"name": "get_weather", "arguments": ""}
    assert deltas[0]["id"].startswith("call_") and deltas[0]["type"] == "function"
    assert all(d["index"] == 0 for d in deltas) and len(deltas) > 3  # arguments came in fragments
    arguments = "".join(d["function"]["arguments"] for d in deltas)
    assert arguments == get_parser("hermes").parse(text).tool_calls[0].arguments == '{"city": "Oslo", "days": 2}'
    plain = ToolCallStream(get_parser("hermes"), forced=False)
    assert plain.content_delta("a < b") == "a < b"
    assert plain.finish("a < b <") == (" <", [])
    mistral = ToolCallStream(get_parser("mistral"), forced=True)
    assert mistral.step("[TOOL_CALLS][{", False) == ("", [])
    _, deltas = mistral.step('[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}]', True)
    assert [d["function"] for d in deltas] == [{"name": "f", "arguments": ""}, {"arguments": '{"a": 1}'}]


def test_required_and_named_grammars_accept_only_valid_calls(lltokenizer) -> None:
    plan = plan_tools(request(tool_choice="required", parallel_tool_calls=False), "hermes", TEMPLATE_WITH_TOOLS)
    grammar = build_grammar(plan.structured_outputs)
    good = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo", "days": 3}}\n</tool_call>'
    assert accepts(lltokenizer, grammar, good)
    assert not accepts(lltokenizer, grammar, '<tool_call>\n{"name": "other", "arguments": {}}\n</tool_call>')
    assert not accepts(lltokenizer, grammar, good.replace('"days": 3', '"days": 9'))
    assert not accepts(lltokenizer, grammar, "Hello")
    for parser in ("llama3_json", "mistral", "qwen3_coder", "pythonic", "deepseek_v3"):
        plan = plan_tools(
            request(tool_choice={"type": "function", "function": {"name": "get_weather"}}), parser, TEMPLATE_WITH_TOOLS
        )
        assert build_grammar(plan.structured_outputs)


def test_auto_constrains_arguments_once_a_call_starts(lltokenizer) -> None:
    plan = plan_tools(request(tool_choice="auto"), "hermes", TEMPLATE_WITH_TOOLS)
    grammar = build_grammar(plan.structured_outputs)
    assert accepts(lltokenizer, grammar, "Just text, no call.")
    assert accepts(
        lltokenizer,
        grammar,
        'I will look. <tool_call>\n{"name": "get_weather", "arguments": {"city": "Oslo"}}\n</tool_call>',
    )
    assert not accepts(lltokenizer, grammar, '<tool_call>\n{"name": "get_weather", "arguments": {"town": 1')


CALL = '{"name": "get_weather", "ARGS": {"city": "Oslo", "days": 2}}'


@pytest.mark.parametrize(
    "parser, calls, bad",
    [
        (
            "mistral",
            ["Looking. [TOOL_CALLS][" + CALL.replace("ARGS", "arguments") + "]"],
            [
                '[TOOL_CALLS][{"name": "get_weather", "arguments": {"town"',
                "[TOOL_CALLS][" + CALL.replace("ARGS", "arguments") + "] and more text",
            ],
        ),
        (
            "llama3_json",
            [
                CALL.replace("ARGS", "parameters"),
                " " + CALL.replace("ARGS", "parameters"),
                "<|python_tag|>" + CALL.replace("ARGS", "parameters"),
            ],
            ['{"name": "get_weather", "parameters": {"days": 9', '{"answer": 42}', "<|python_tag|>print(1)"],
        ),
        (
            "qwen3_coder",
            [
                "Looking.\n<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
                "<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>"
            ],
            [
                "<tool_call>\n<function=get_weather>\n<parameter=days>\n2\n</parameter>\n</function>\n</tool_call>",
                "<tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n<parameter=days>\n9\n"
                "</parameter>\n</function>\n</tool_call>",
                "<tool_call>\n<function=get_time>\n</function>\n</tool_call>",
            ],
        ),
        (
            "pythonic",
            ['[get_weather(city="Oslo", days=2)]', ' [get_weather(city="Oslo", days=2)]'],
            [
                "[get_weather(days=2)]",
                '[get_weather(city="Oslo", days=9)]',
                "[print(1)]",
                '[get_weather(city="Oslo", days=2)] and text',
            ],
        ),
        (
            "deepseek_v3",
            [
                "Looking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
                '{"city": "Oslo", "days": 2}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>'
            ],
            [
                '<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n{"town": 1',
                "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>other\n",
            ],
        ),
    ],
)
def test_auto_constrains_every_parsers_calls(lltokenizer, parser, calls, bad) -> None:
    plan = plan_tools(request(tool_choice="auto", parallel_tool_calls=False), parser, TEMPLATE_WITH_TOOLS)
    grammar = build_grammar(plan.structured_outputs)
    assert accepts(lltokenizer, grammar, "Just text, no call.")
    for text in calls:
        assert accepts(lltokenizer, grammar, text), text
        parsed = plan.parser.parse(text)
        assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
            ("get_weather", {"city": "Oslo", "days": 2})
        ]
    for text in bad:
        assert not accepts(lltokenizer, grammar, text), text


@pytest.mark.parametrize(
    "fields, template, param",
    [
        (dict(tool_choice={"type": "function", "function": {"name": "nope"}}), TEMPLATE_WITH_TOOLS, "tool_choice"),
        (dict(tool_choice="sometimes"), TEMPLATE_WITH_TOOLS, "tool_choice"),
        (dict(tools=None, tool_choice="required"), TEMPLATE_WITH_TOOLS, "tool_choice"),
        (dict(tools=[{"type": "function", "function": {}}]), TEMPLATE_WITH_TOOLS, "tools"),
        (dict(), "{{ messages[0].content }}", "tools"),
        (dict(functions=[{"name": "f"}], tools=[TOOL]), TEMPLATE_WITH_TOOLS, "functions"),
        (dict(tools=None, function_call="auto"), TEMPLATE_WITH_TOOLS, "function_call"),
    ],
)
def test_bad_tool_requests(fields, template, param) -> None:
    with pytest.raises(APIError) as caught:
        plan_tools(request(**fields), "hermes", template)
    assert caught.value.status == 400 and caught.value.param == param


def test_parsers_whose_marker_is_a_special_token_keep_special_tokens() -> None:
    from pagoda.sampling_params import SamplingParams
    from pagoda.serve.api.tool_calls import with_tool_constraint

    for parser, keeps in (
        ("hermes", True),
        ("mistral", False),
        ("llama3_json", False),
        ("qwen3_coder", True),
        ("pythonic", False),
        ("deepseek_v3", False),
    ):
        plan = plan_tools(request(tool_choice="auto"), parser, TEMPLATE_WITH_TOOLS)
        params = with_tool_constraint(SamplingParams(), plan)
        assert params.skip_special_tokens is keeps


def test_qwen3_coder_reads_values_as_their_schema_types() -> None:
    schema = {
        "type": "object",
        "properties": {
            "n": {"type": "integer"},
            "x": {"type": "number"},
            "on": {"type": "boolean"},
            "tags": {"type": "array"},
            "code": {"type": "string"},
            "opt": {"type": ["integer", "null"]},
        },
    }
    parser = get_parser("qwen3_coder", ToolSchemas({"f": schema}))
    text = (
        "<tool_call>\n<function=f>\n<parameter=n>\n3\n</parameter>\n<parameter=x>\n2.5\n</parameter>\n"
        '<parameter=on>\nTrue\n</parameter>\n<parameter=tags>\n["a", 1]\n</parameter>\n'
        "<parameter=code>\nif a < b:\n    return 1\n</parameter>\n<parameter=opt>\nnull\n</parameter>\n"
        "<parameter=extra>\n7\n</parameter>\n</function>\n</tool_call>"
    )
    (call,) = parser.parse(text).tool_calls
    assert json.loads(call.arguments) == {
        "n": 3,
        "x": 2.5,
        "on": True,
        "tags": ["a", 1],
        "code": "if a < b:\n    return 1",
        "opt": None,
        "extra": "7",
    }
    unclosed = parser.parse("Sure. <function=f>\n<parameter=n>\nx\n")  # as vLLM: the open call counts
    assert unclosed.content == "Sure." and json.loads(unclosed.tool_calls[0].arguments) == {"n": "x"}
    assert parser.parse("no call <tool_call>").tool_calls == []


def test_pythonic_and_deepseek_parse_as_vllm_does() -> None:
    pythonic = get_parser("pythonic")
    parsed = pythonic.parse('[get_weather(city="Oslo", days=-2, at={"x": [1, None]}), f(flag=true)]')
    assert parsed.content is None
    assert [(c.name, json.loads(c.arguments)) for c in parsed.tool_calls] == [
        ("get_weather", {"city": "Oslo", "days": -2, "at": {"x": [1, None]}}),
        ("f", {"flag": True}),
    ]
    llama4 = pythonic.parse("<|python_start|>[f(a=1)]<|python_end|>")
    assert [(c.name, c.arguments) for c in llama4.tool_calls] == [("f", '{"a": 1}')]
    for text in ("[f(1)]", "[f(a=g())]", "[1, 2]", "call f(a=1)", "[f(**x)]", "[f(a=1)"):
        assert pythonic.parse(text).tool_calls == [] and pythonic.parse(text).content == text
    deepseek = get_parser("deepseek_v3").parse(
        'Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>a\n```json\n{"x": 1}\n```'
        "<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>b\n```json\n{}\n```<｜tool▁call▁end｜>"
        "<｜tool▁calls▁end｜>"
    )
    assert deepseek.content == "Checking." and [(c.name, c.arguments) for c in deepseek.tool_calls] == [
        ("a", '{"x": 1}'),
        ("b", "{}"),
    ]


def test_every_parser_streams_its_calls() -> None:
    texts = {
        "qwen3_coder": "Sure <tool_call>\n<function=get_weather>\n<parameter=city>\nOslo\n</parameter>\n"
        "</function>\n</tool_call>",
        "pythonic": '[get_weather(city="Oslo")]',
        "deepseek_v3": "Sure <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n"
        '```json\n{"city": "Oslo"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>',
    }
    for name, text in texts.items():
        stream = ToolCallStream(get_parser(name), forced=False)
        content, deltas = "", []
        for end in range(1, len(text) + 1):
            new_content, new_deltas = stream.step(text[:end], finished=end == len(text))
            content += new_content
            deltas.extend(new_deltas)
        assert content == ("" if name == "pythonic" else "Sure "), name
        assert deltas[0]["function"]["name"] == "get_weather"
        assert json.loads("".join(d["function"]["arguments"] for d in deltas)) == {"city": "Oslo"}


def test_segment_tokens_that_are_special_become_those_tokens() -> None:
    from pagoda.structured.triggered import triggered_lark

    spec = plan_tools(
        request(tool_choice="required"), "deepseek_v3", TEMPLATE_WITH_TOOLS
    ).structured_outputs.structural_tag
    lark = triggered_lark(spec, {"<｜tool▁calls▁begin｜>": 7, "<｜tool▁sep｜>": 9})
    assert "<[7]>" in lark and "<[9]>" in lark and "tool\\u2581sep" not in lark and "call\\u2581begin" in lark
