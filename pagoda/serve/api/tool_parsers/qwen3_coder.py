"""qwen3_coder: Qwen3-Coder's XML calls, as vLLM's qwen3_coder parser reads them:

    <tool_call>
    <function=get_weather>
    <parameter=city>
    Oslo
    </parameter>
    </function>
    </tool_call>

A value is text; it becomes the type its parameter's schema names (integer, number, boolean,
object / array as JSON, anything else a string; "null" is null). Calls may stand anywhere in
the text. The grammar writes parameters in the schema's order, the required ones always, a
string value as text up to its closing tag and any other value as JSON under its schema.
"""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from pagoda.serve.api.tool_parsers.base import ParsedOutput, ToolCall, ToolCallParser, ToolSchemas, lark_string
from pagoda.structured.grammar import JSON_OPTIONS

_STRING_TYPES = ("string", "str", "text", "varchar", "char", "enum")
_INTEGER_PREFIXES = ("int", "uint", "long", "short", "unsigned")
# The Lark rule for a string value: any text, ending at the first closing tag.
_TEXT_RULE = "qwen3_coder_text"


class Qwen3CoderParser(ToolCallParser):
    name = "qwen3_coder"
    start_marker = "<tool_call>"
    start_markers = ("<tool_call>", "<function=")
    _call = re.compile(r"<tool_call>(.*?)</tool_call>|<tool_call>(.*?)$", re.DOTALL)
    _function = re.compile(r"<function=(.*?)</function>|<function=(.*)$", re.DOTALL)
    _parameter = re.compile(r"<parameter=(.*?)(?:</parameter>|(?=<parameter=)|(?=</function>)|$)", re.DOTALL)
    rules = f'{_TEXT_RULE}[lazy]: TEXT "\\n</parameter>\\n"'

    def parse(self, text: str) -> ParsedOutput:
        if "<function=" not in text:
            return ParsedOutput(text, [])
        raw_calls = [closed or open_ for closed, open_ in self._call.findall(text)] or [text]
        functions = [closed or open_ for raw in raw_calls for closed, open_ in self._function.findall(raw)]
        calls = []
        for function in functions:
            name, bracket, body = function.partition(">")
            if not bracket or not name:
                return ParsedOutput(text, [])
            arguments = {}
            for parameter in self._parameter.findall(body):
                key, bracket, value = parameter.partition(">")
                if not bracket:
                    return ParsedOutput(text, [])
                value = value[1:] if value.startswith("\n") else value
                value = value[:-1] if value.endswith("\n") else value
                arguments[key] = self._value(name, key, value)
            calls.append(ToolCall(name, json.dumps(arguments, ensure_ascii=False)))
        if not calls:
            return ParsedOutput(text, [])
        start = text.find(self.start_marker)
        start = start if start >= 0 else text.find("<function=")
        return ParsedOutput(text[:start].strip() or None, calls)

    def _value(self, function: str, key: str, value: str) -> Any:
        """The value as its schema's type names it (vLLM's conversions)."""
        if value.lower() == "null":
            return None
        schema = self.tools.parameters.get(function, {}) if self.tools else {}
        properties = schema.get("properties", {}) if isinstance(schema, dict) else {}
        if not isinstance(properties, dict) or key not in properties:
            return value
        kind = _type_name(properties[key])
        if kind in _STRING_TYPES:
            return value
        if kind.startswith(_INTEGER_PREFIXES):
            try:
                return int(value)
            except ValueError:
                return value
        if kind.startswith(("num", "float")):
            try:
                number = float(value)
            except ValueError:
                return value
            return int(number) if number.is_integer() else number
        if kind in ("boolean", "bool", "binary"):
            return value.lower() == "true"
        try:
            return json.loads(value)
        except json.JSONDecodeError:
            pass
        try:
            return ast.literal_eval(value)
        except (ValueError, SyntaxError, MemoryError, RecursionError):
            return value

    def auto_placement(self, parallel: bool) -> str:
        return "anywhere" if parallel else "final"

    def segments(self, tools: ToolSchemas, parallel: bool, repeat: bool) -> list[dict[str, str]]:
        functions = " | ".join(
            f"{lark_string(f'<function={name}>' + chr(10))} {_parameters_lark(schema)}"
            for name, schema in tools.parameters.items()
        )
        call = f'"\\n" ({functions}) "</function>\\n</tool_call>"'
        more = f' ("\\n<tool_call>" {call})*' if parallel and repeat else ""
        return [{"trigger": self.start_marker, "body": call + more}]


def _type_name(schema: Any) -> str:
    """The schema's type as vLLM's parser reads it: the first non-null type, else string."""
    kind = schema.get("type") if isinstance(schema, dict) else None
    if isinstance(kind, list):
        kind = next((k for k in kind if k != "null"), "string")
    return str(kind).strip().lower() if kind else "string"


def _parameters_lark(schema: dict[str, Any]) -> str:
    properties = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(properties, dict) or not properties:
        if isinstance(schema, dict) and schema.get("additionalProperties") is False:
            return '""'
        return f'("<parameter=" /[A-Za-z0-9_.-]+/ ">\\n" {_TEXT_RULE})*'  # free-form parameters
    required = set(schema.get("required") or ())
    items = []
    for key, value_schema in properties.items():
        item = f"{lark_string(f'<parameter={key}>' + chr(10))} {_value_lark(value_schema)}"
        items.append(f"({item})" if key in required else f"({item})?")
    return " ".join(items)


def _value_lark(schema: Any) -> str:
    """A value in its type's syntax, then its closing tag: a string as text (bounded when the
    schema bounds it), anything else as JSON, whose text is what the parser converts back."""
    close = '"\\n</parameter>\\n"'
    schema = schema if isinstance(schema, dict) else {}
    if "type" in schema and _type_name(schema) not in _STRING_TYPES:
        return f"%json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})} {close}"
    enum = schema.get("enum")
    if isinstance(enum, list) and enum and all(isinstance(v, str) for v in enum):
        return "(" + " | ".join(lark_string(v) for v in enum) + f") {close}"
    if isinstance(schema.get("maxLength"), int):  # one lexeme: the text and its closing tag
        low = schema.get("minLength") if isinstance(schema.get("minLength"), int) else 0
        return f"/(.|\\n){{{low},{schema['maxLength']}}}\\n<\\/parameter>\\n/"
    return _TEXT_RULE
