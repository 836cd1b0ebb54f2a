"""mistral: `[TOOL_CALLS][{"name": ..., "arguments": {...}}, ...]` ending the output."""

from __future__ import annotations

import json

from pagoda.serve.api.tool_parsers.base import ParsedOutput, ToolCallParser, ToolSchemas
from pagoda.structured.grammar import JSON_OPTIONS


class MistralParser(ToolCallParser):
    name = "mistral"
    start_marker = "[TOOL_CALLS]"
    keeps_special_tokens = True

    def parse(self, text: str) -> ParsedOutput:
        start = text.find(self.start_marker)
        if start < 0:
            return ParsedOutput(text, [])
        try:
            objects = json.loads(text[start + len(self.start_marker) :].strip())
        except json.JSONDecodeError:
            return ParsedOutput(text, [])
        calls = self._calls(objects if isinstance(objects, list) else [objects])
        if not calls:
            return ParsedOutput(text, [])
        return ParsedOutput(text[:start].strip() or None, calls)

    def segments(self, tools: ToolSchemas, parallel: bool, repeat: bool) -> list[dict[str, str]]:
        array = {
            "type": "array",
            "items": tools.call_schema(self.arguments_key),
            "minItems": 1,
            "x-guidance": JSON_OPTIONS,
        }
        if not parallel:
            array["maxItems"] = 1
        return [{"trigger": self.start_marker, "body": f"%json {json.dumps(array)}"}]
