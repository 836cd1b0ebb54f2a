"""pythonic: Llama 3.2 / 4 calls as a Python list, the whole output, as vLLM's pythonic parser
reads them: `[get_weather(city="Oslo", days=2), get_time(zone=1)]` (Llama 4 may wrap it in
`<|python_start|>` ... `<|python_end|>`). Arguments are keyword literals. The grammar writes
them in the schema's order, the required ones always: booleans as True / False, every other
value as JSON (a JSON string or number is the same Python literal)."""

from __future__ import annotations

import ast
import json
from typing import Any

from pagoda.serve.api.tool_parsers.base import ParsedOutput, ToolCall, ToolCallParser, ToolSchemas, lark_string
from pagoda.structured.grammar import JSON_OPTIONS

_OPEN, _CLOSE = "<|python_start|>", "<|python_end|>"
# JSON's names for constants, accepted beside Python's in arguments written as JSON.
_NAMES = {"True": True, "False": False, "None": None, "true": True, "false": False, "null": None}


class PythonicParser(ToolCallParser):
    name = "pythonic"
    start_marker = "["
    start_markers = ("[", _OPEN)
    keeps_special_tokens = True  # <|python_start|> is a special token in Llama 4's vocabulary

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip()
        if body.startswith(_OPEN):
            body = body[len(_OPEN) :].removesuffix(_CLOSE).strip()
        if not (body.startswith("[") and body.endswith("]")):
            return ParsedOutput(text, [])
        try:
            tree = ast.parse(body, mode="eval").body
            calls = [self._call(node) for node in tree.elts] if isinstance(tree, ast.List) else []
        except (SyntaxError, ValueError, MemoryError, RecursionError):
            return ParsedOutput(text, [])
        return ParsedOutput(None, calls) if calls else ParsedOutput(text, [])

    @staticmethod
    def _call(node: ast.expr) -> ToolCall:
        if not isinstance(node, ast.Call) or not isinstance(node.func, ast.Name) or node.args:
            raise ValueError("not a call with keyword arguments")
        arguments = {}
        for keyword in node.keywords:
            if keyword.arg is None:
                raise ValueError("**kwargs")
            arguments[keyword.arg] = _literal(keyword.value)
        return ToolCall(node.func.id, json.dumps(arguments, ensure_ascii=False))

    def auto_placement(self, parallel: bool) -> str:
        return "start"  # as vLLM's parser: the list is the whole output

    def segments(self, tools: ToolSchemas, parallel: bool, repeat: bool) -> list[dict[str, str]]:
        call = (
            "("
            + " | ".join(
                f'{lark_string(name + "(")} {_arguments_lark(schema)} ")"' for name, schema in tools.parameters.items()
            )
            + ")"
        )
        more = f' (", " {call})*' if parallel else ""
        return [{"trigger": "[", "body": f'{call}{more} "]"'}]


def _literal(node: ast.expr) -> Any:
    if isinstance(node, ast.Constant):
        return node.value
    if isinstance(node, ast.Name) and node.id in _NAMES:
        return _NAMES[node.id]
    if isinstance(node, (ast.List, ast.Tuple)):
        return [_literal(item) for item in node.elts]
    if isinstance(node, ast.Dict):
        keys = [_literal(key) if key is not None else None for key in node.keys]
        if not all(isinstance(key, str) for key in keys):
            raise ValueError("dict keys must be strings")
        return dict(zip(keys, (_literal(value) for value in node.values)))
    if (
        isinstance(node, ast.UnaryOp)
        and isinstance(node.op, ast.USub)
        and isinstance(node.operand, ast.Constant)
        and isinstance(node.operand.value, (int, float))
    ):
        return -node.operand.value
    raise ValueError("not a literal")


def _arguments_lark(schema: dict[str, Any]) -> str:
    """Keyword arguments separated by ", ": the required ones in order, each optional one
    present or not (an expression per choice of the first argument written)."""
    properties = schema.get("properties") if isinstance(schema, dict) else None
    if not isinstance(properties, dict) or not properties:
        return '""'
    required = set(schema.get("required") or ())
    items = [(f"{lark_string(key + '=')} {_value_lark(value)}", key in required) for key, value in properties.items()]
    tail = lambda rest: " ".join(f'(", " {item})' + ("" if needed else "?") for item, needed in rest)  # noqa: E731
    choices = []
    for first, (item, needed) in enumerate(items):
        choices.append(f"{item} {tail(items[first + 1 :])}".strip())
        if needed:
            break
    else:
        choices.append('""')  # every argument optional: none at all
    return "(" + " | ".join(f"({choice})" for choice in choices) + ")"


def _value_lark(schema: Any) -> str:
    if isinstance(schema, dict) and schema.get("type") == "boolean":
        return '("True" | "False")'
    return f"%json {json.dumps({**(schema if isinstance(schema, dict) else {}), 'x-guidance': JSON_OPTIONS})}"
