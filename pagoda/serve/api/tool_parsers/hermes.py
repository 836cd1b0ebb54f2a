"""hermes: `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>` (Qwen2.5/3, Hermes);
calls may stand anywhere in the text, and their arguments stream as they are generated."""

from __future__ import annotations

import json
import re

from pagoda.serve.api.tool_parsers.base import ParsedOutput, ToolCall, ToolCallParser, ToolSchemas


class HermesParser(ToolCallParser):
    name = "hermes"
    start_marker = "<tool_call>"
    end_marker = "</tool_call>"
    _head = re.compile(r'\s*\{\s*"name"\s*:\s*"((?:[^"\\]|\\.)*)"\s*,\s*"arguments"\s*:\s*')

    def parse(self, text: str) -> ParsedOutput:
        start = text.find(self.start_marker)
        if start < 0:
            return ParsedOutput(text, [])
        calls = []
        for segment in self._segments(text[start:]):
            raw = self._raw_call(segment)
            if raw is not None and raw[1] is not None and raw[2]:
                calls.append(ToolCall(raw[0], raw[1]))  # the model's own argument text
                continue
            try:  # other key orders or spacing
                obj = json.loads(segment.strip())
            except json.JSONDecodeError:
                return ParsedOutput(text, [])
            parsed = self._calls([obj])
            if not parsed:
                return ParsedOutput(text, [])
            calls.extend(parsed)
        if not calls:
            return ParsedOutput(text, [])
        return ParsedOutput(text[:start].strip() or None, calls)

    def parse_cut(self, text: str) -> ParsedOutput:
        start = text.find(self.start_marker)
        if start < 0:
            return ParsedOutput(text, [])
        whole = self.parse(text)
        if whole.tool_calls:
            return whole
        calls = []
        position = start
        while True:  # complete <tool_call>...</tool_call> segments, in order, up to the cut one
            end = text.find(self.end_marker, position)
            if end < 0:
                break
            parsed = self.parse(text[position : end + len(self.end_marker)])
            if len(parsed.tool_calls) != 1 or parsed.content:
                break
            calls.extend(parsed.tool_calls)
            position = end + len(self.end_marker)
            following = text.find(self.start_marker, position)
            if following < 0 or text[position:following].strip():
                break
            position = following
        if not calls:
            return ParsedOutput(text, [])
        before = text[:start].strip()
        cut = text[position:].strip()
        return ParsedOutput("\n".join(part for part in (before, cut) if part) or None, calls)

    def partial_calls(self, text: str) -> list[tuple[str, str]]:
        """The argument texts only ever grow, and end as `parse` returns them."""
        start = text.find(self.start_marker)
        if start < 0:
            return []
        calls = []
        for segment in self._segments(text[start:]):
            raw = self._raw_call(segment)
            if raw is None:
                break
            name, complete, _ = raw
            if complete is None:  # still generating: everything after the head so far
                head = self._head.match(segment)
                assert head is not None, "_raw_call found a call, so its head matched"
                complete = segment[head.end() :]
            calls.append((name, complete))
        return calls

    def _segments(self, text: str) -> list[str]:
        parts = text.split(self.start_marker)[1:]
        return [part.split(self.end_marker, 1)[0] for part in parts]

    def _raw_call(self, segment: str) -> tuple[str, str | None, bool] | None:
        """(name, complete argument text or None, whether the call's object closes after it)."""
        head = self._head.match(segment)
        if head is None:
            return None
        try:
            name = json.loads(f'"{head.group(1)}"')
        except json.JSONDecodeError:
            return None
        try:
            _, end = json.JSONDecoder().raw_decode(segment, head.end())
        except json.JSONDecodeError:  # the arguments are still being generated
            return name, None, False
        closes = segment[end:].strip() == "}"
        return name, segment[head.end() : end], closes

    def auto_placement(self, parallel: bool) -> str:
        return "anywhere" if parallel else "final"

    def segments(self, tools: ToolSchemas, parallel: bool, repeat: bool) -> list[dict[str, str]]:
        call = f'"\\n" {tools.call_json(self.arguments_key)} "\\n</tool_call>"'
        more = f' ("\\n<tool_call>" {call})*' if parallel and repeat else ""
        return [{"trigger": self.start_marker, "body": call + more}]
