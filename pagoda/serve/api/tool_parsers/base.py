"""What every tool-call parser is: the calls it finds in a finished output, where a call may
begin (streaming holds content back from there), and the triggered grammar its calls follow
(pagoda.structured.triggered); plus the tools' schemas the grammars and parsers read."""

from __future__ import annotations

import json
import uuid
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any

from pagoda.sampling_params import StructuredOutputsParams
from pagoda.structured.grammar import JSON_OPTIONS


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: "call_" + uuid.uuid4().hex[:24])

    def to_dict(self) -> dict[str, Any]:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


@dataclass
class ParsedOutput:
    content: str | None
    tool_calls: list[ToolCall]


class ToolCallParser:
    """Splits a completed output into content and tool calls. `start_marker` is where a call
    begins: streamed content is held back from there on."""

    name = ""
    start_marker = ""
    arguments_key = "arguments"
    # The call marker may be a special token ([TOOL_CALLS], <|python_tag|>): keep it in the text.
    keeps_special_tokens = False

    @property
    def start_markers(self) -> tuple[str, ...]:
        """Every text that may begin a call (streaming holds content back from the first)."""
        return (self.start_marker,)

    def __init__(self, tools: ToolSchemas | None = None) -> None:
        self.tools = tools  # the request's functions, for formats whose values need the schema

    def parse(self, text: str) -> ParsedOutput:
        raise NotImplementedError

    def parse_cut(self, text: str) -> ParsedOutput:
        """`text` cut short by max_tokens: the calls it completed, and as content the unfinished
        call's text (never a call: a client would run it with half its arguments). Formats that
        cannot tell their calls apart mid-way answer as `parse` does."""
        return self.parse(text)

    def partial_calls(self, text: str) -> list[tuple[str, str]]:
        """(name, argument text so far) of each call begun in `text`, for formats that stream
        arguments as they are generated (the others send each call once the output is done)."""
        return []

    def _calls(self, objects: list[Any]) -> list[ToolCall] | None:
        calls = []
        for obj in objects:
            if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
                return None
            arguments = obj.get(self.arguments_key, obj.get("arguments", obj.get("parameters", {})))
            calls.append(ToolCall(obj["name"], json.dumps(arguments, ensure_ascii=False)))
        return calls

    # ---- grammar: what starts a call and what follows, as triggered segments ----

    # Where calls may stand under tool_choice "auto" (see pagoda.structured.triggered).
    def auto_placement(self, parallel: bool) -> str:
        return "final"

    def segments(self, tools: ToolSchemas, parallel: bool, repeat: bool) -> Sequence[Mapping[str, str | list[str]]]:
        """[{trigger, body, tokens?}]: the output's calls begin with a trigger, then the body. `repeat`:
        the body itself holds every further call (required / named) rather than the
        placement allowing more segments (auto, anywhere)."""
        raise NotImplementedError

    # Further Lark rules the segments' bodies use (see pagoda.structured.triggered).
    rules = ""

    def constraint(self, tools: ToolSchemas, parallel: bool, forced: bool) -> StructuredOutputsParams:
        placement = "only" if forced else self.auto_placement(parallel)
        segments = self.segments(tools, parallel, repeat=placement != "anywhere")
        spec = {"placement": placement, "segments": segments, **({"rules": self.rules} if self.rules else {})}
        return StructuredOutputsParams(structural_tag=spec)


@dataclass(frozen=True)
class ToolSchemas:
    """The callable functions' parameter schemas, by name, and the JSON of a call to them."""

    parameters: dict[str, dict[str, Any]]

    @property
    def names(self) -> list[str]:
        return list(self.parameters)

    def call_schema(self, arguments_key: str) -> dict[str, Any]:
        calls = [
            {
                "type": "object",
                "additionalProperties": False,
                "required": ["name", arguments_key],
                "properties": {"name": {"const": name}, arguments_key: schema},
            }
            for name, schema in self.parameters.items()
        ]
        return dict(calls[0]) if len(calls) == 1 else {"anyOf": calls}

    def call_json(self, arguments_key: str) -> str:
        """Lark for one call object, compact JSON (a model cannot pad it forever)."""
        return f"%json {json.dumps({**self.call_schema(arguments_key), 'x-guidance': JSON_OPTIONS})}"

    def arguments_json(self, name: str) -> str:
        return f"%json {json.dumps({**self.parameters[name], 'x-guidance': JSON_OPTIONS})}"


def lark_string(text: str) -> str:
    return json.dumps(text)  # JSON string escapes are Lark string escapes


def split_json_sequence(text: str, separator: str) -> list[str]:
    """Top-level JSON values separated by `separator` (not inside strings or brackets)."""
    parts, depth, in_string, escaped, begin = [], 0, False, False, 0
    for i, char in enumerate(text):
        if in_string:
            escaped = not escaped and char == "\\"
            if char == '"' and not escaped:
                in_string = False
            continue
        if char == '"':
            in_string = True
        elif char in "{[":
            depth += 1
        elif char in "}]":
            depth -= 1
        elif char == separator and depth == 0:
            parts.append(text[begin:i].strip())
            begin = i + 1
    parts.append(text[begin:].strip())
    return [p for p in parts if p]
