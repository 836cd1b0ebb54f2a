"""A request's constraint -> llguidance grammar text, checked before it reaches the engine.

Errors are InvalidRequest whose `param` (and message prefix) is the request field at fault, so
the server can answer 400 naming it. Checking needs no tokenizer, so the API server does it up front and only
well-formed grammars ever wait for compilation in the engine.
"""

from __future__ import annotations

import json
from typing import TYPE_CHECKING, Any

import llguidance
from llguidance.gbnf_to_lark import any_to_lark

from pagoda.errors import InvalidRequest
from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured.triggered import check_triggered_spec, is_triggered_spec, special_trigger_ids, triggered_lark

if TYPE_CHECKING:  # a TypedDict of llguidance's stubs only
    from llguidance._lib import JsonCompileOptions

# JSON as OpenAI and vLLM emit it under a schema: compact separators, no free whitespace (a
# model cannot pad forever), properties in schema order.
JSON_OPTIONS: JsonCompileOptions = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


class GrammarError(InvalidRequest):
    """A constraint that cannot be compiled; `field` names the request field at fault."""

    def __init__(self, field: str, message: str) -> None:
        super().__init__(f"{field}: {message}", param=field)
        self.field = field
        self.reason = message

    def __reduce__(self):  # picklable across the engine process's pipe, as InvalidRequest
        return (GrammarError, (self.field, self.reason))


def grammar_failure(message: str) -> InvalidRequest:
    """The engine's outcome message for a grammar that failed ("structured_outputs.json: ...",
    or a compile timeout) as the request's InvalidRequest, `param` naming that field."""
    field = message.split(":", 1)[0]
    return InvalidRequest(message, param=field if field.startswith("structured_outputs") else "structured_outputs")


def build_grammar(
    params: StructuredOutputsParams, field: str | None = None, tokenizer: llguidance.LLTokenizer | None = None
) -> str:
    """The llguidance grammar for `params`, validated. Raises GrammarError. With `tokenizer`
    (the engine compiling it), a structural tag's triggers that are special tokens of that
    tokenizer are matched as those tokens; without, as text (checking in the API server)."""
    kind = params.kind
    field = field or f"structured_outputs.{kind}"
    try:
        grammar = _translate(params, tokenizer)
    except GrammarError:
        raise
    except Exception as exc:  # llguidance raises ValueError/RuntimeError with its reason
        raise GrammarError(field, _short(exc)) from None
    error = llguidance.LLMatcher.validate_grammar(grammar)
    if error:
        raise GrammarError(field, _short(error))
    return grammar


def _translate(params: StructuredOutputsParams, tokenizer: llguidance.LLTokenizer | None) -> str:
    kind = params.kind
    if kind == "json":
        schema = params.json
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as exc:
                raise GrammarError("structured_outputs.json", f"is not valid JSON: {exc}") from None
        if schema is True:
            schema = {}
        if not isinstance(schema, dict):
            raise GrammarError("structured_outputs.json", "must be a JSON schema object")
        return llguidance.LLMatcher.grammar_from_json_schema(schema, defaults=JSON_OPTIONS)
    if kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"}, defaults=JSON_OPTIONS)
    # `kind` names the one field StructuredOutputsParams holds set, so the reads below are not None.
    if kind == "regex":
        assert params.regex is not None
        return llguidance.LLMatcher.grammar_from_regex(params.regex)
    if kind == "choice":
        assert params.choice is not None
        return llguidance.LLMatcher.grammar_from_lark("start: " + " | ".join(_lark_string(c) for c in params.choice))
    if kind == "grammar":
        # Lark as llguidance reads it, or GBNF/EBNF as llama.cpp writes it (`root ::= ...`).
        assert params.grammar is not None
        return llguidance.LLMatcher.grammar_from_lark(any_to_lark(params.grammar))
    if kind == "structural_tag":
        assert params.structural_tag is not None
        spec = triggered_spec(params.structural_tag)
        special = special_trigger_ids(spec, tokenizer) if tokenizer is not None else None
        return llguidance.LLMatcher.grammar_from_lark(triggered_lark(spec, special))
    raise GrammarError("structured_outputs", f"unknown kind {kind!r}")


def triggered_spec(spec: dict[str, Any] | str) -> dict[str, Any]:
    """A structural tag as a checked triggered spec (pagoda.structured.triggered). vLLM's shape:
    free text in which a segment that starts with one of `triggers` must be `begin`, then JSON
    matching `schema`, then `end`; or a triggered spec itself (what tool calls compile to)."""
    field = "structured_outputs.structural_tag"
    if isinstance(spec, str):
        try:
            spec = json.loads(spec)
        except json.JSONDecodeError as exc:
            raise GrammarError(field, f"is not valid JSON: {exc}") from None
    if not isinstance(spec, dict):
        raise GrammarError(field, "must be an object with structures and triggers")
    if is_triggered_spec(spec):
        problem = check_triggered_spec(spec)
        if problem:
            raise GrammarError(field, problem)
        return spec
    structures = spec.get("structures")
    triggers = spec.get("triggers")
    if not isinstance(structures, list) or not structures:
        raise GrammarError(field, "needs a non-empty list `structures` of {begin, schema, end}")
    if not isinstance(triggers, list) or not triggers or not all(isinstance(t, str) and t for t in triggers):
        raise GrammarError(field, "needs a non-empty list `triggers` of strings")
    bodies: dict[str, list[str]] = {}  # trigger -> the alternatives that may follow it
    for i, structure in enumerate(structures):
        if not isinstance(structure, dict) or not isinstance(structure.get("begin"), str):
            raise GrammarError(field, f"structures[{i}] needs a string `begin`")
        begin = structure["begin"]
        trigger = next((t for t in triggers if begin.startswith(t)), None)
        if trigger is None:
            raise GrammarError(field, f"structures[{i}].begin {begin!r} starts with none of the triggers")
        schema = structure.get("schema", {})
        if not isinstance(schema, dict):
            raise GrammarError(field, f"structures[{i}].schema must be a JSON schema object")
        parts = [
            _lark_string(begin[len(trigger) :]),
            f"%json {json.dumps(schema)}",
            _lark_string(str(structure.get("end", ""))),
        ]
        bodies.setdefault(trigger, []).append(" ".join(p for p in parts if p != '""'))
    segments = [
        {"trigger": trigger, "body": "(" + " | ".join(alternatives) + ")"} for trigger, alternatives in bodies.items()
    ]
    return {"placement": "anywhere", "segments": segments}


def _lark_string(text: str) -> str:
    # JSON string escapes are valid Lark string escapes.
    return json.dumps(text)


def _short(error: object) -> str:
    """llguidance errors can carry a dump of the grammar; the first line says what is wrong."""
    lines = [line.strip() for line in str(error).strip().splitlines() if line.strip()]
    if not lines:
        return "invalid grammar"
    reason = next((line for line in lines[1:] if line.startswith("error:")), None)
    if lines[0].endswith(":") and reason:  # 'regex parse error:', the pattern, a caret, 'error: ...'
        return f"{lines[0]} {reason[len('error:') :].strip()}"[:500]
    return lines[0][:500]
