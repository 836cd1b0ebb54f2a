"""llama3_json: `{"name": ..., "parameters": {...}}` as the whole output, optionally after
`<|python_tag|>`, several separated by `; ` (Llama 3.1/3.2 JSON tool calling)."""

from __future__ import annotations

import json

from pagoda.serve.api.tool_parsers.base import (
    ParsedOutput,
    ToolCallParser,
    ToolSchemas,
    lark_string,
    split_json_sequence,
)


class Llama3JsonParser(ToolCallParser):
    name = "llama3_json"
    start_marker = "{"
    arguments_key = "parameters"
    keeps_special_tokens = True
    start_markers = ("<|python_tag|>", "{")

    def parse(self, text: str) -> ParsedOutput:
        body = text.strip()
        if body.startswith("<|python_tag|>"):
            body = body[len("<|python_tag|>") :]
        if not body.startswith("{"):
            return ParsedOutput(text, [])
        objects = []
        for part in split_json_sequence(body, ";"):
            try:
                objects.append(json.loads(part))
            except json.JSONDecodeError:
                return ParsedOutput(text, [])
        calls = self._calls(objects)
        return ParsedOutput(None, calls) if calls else ParsedOutput(text, [])

    def auto_placement(self, parallel: bool) -> str:
        return "start"  # as vLLM's parser: a call is the whole output, `{` or the tag first

    def segments(self, tools: ToolSchemas, parallel: bool, repeat: bool) -> list[dict[str, str]]:
        call = tools.call_json(self.arguments_key)
        more = f' ("; " {call})*' if parallel else ""
        # After a bare `{` (already written when the trigger fires): the rest of the first call.
        rest = " | ".join(
            f"{lark_string(json.dumps(name) + ', ' + json.dumps(self.arguments_key) + ': ')} "
            f"{tools.arguments_json(name)}"
            for name in tools.names
        )
        return [
            {"trigger": "<|python_tag|>", "body": call + more},
            {"trigger": "{", "body": f'{lark_string(json.dumps("name") + ": ")} ({rest}) "}}"{more}'},
        ]
