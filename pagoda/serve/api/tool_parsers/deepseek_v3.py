"""deepseek_v3: DeepSeek-V3's special-token calls ending the output, as vLLM's deepseek_v3
parser reads them:

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather
    ```json
    {"city": "Oslo"}
    ```<｜tool▁call▁end｜><｜tool▁calls▁end｜>

The markers are special tokens of DeepSeek's vocabulary: the output keeps them, and the
grammar matches them as those tokens where the tokenizer has them."""

from __future__ import annotations

import re

from pagoda.serve.api.tool_parsers.base import ParsedOutput, ToolCall, ToolCallParser, ToolSchemas, lark_string

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEPARATOR = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"


class DeepSeekV3Parser(ToolCallParser):
    name = "deepseek_v3"
    start_marker = CALLS_BEGIN
    keeps_special_tokens = True
    _call = re.compile(
        re.escape(CALL_BEGIN) + r"(?P<type>.*?)" + re.escape(SEPARATOR) + r"(?P<name>.*?)\n```json\n"
        r"(?P<arguments>.*?)\n```" + re.escape(CALL_END),
        re.DOTALL,
    )

    def parse(self, text: str) -> ParsedOutput:
        start = text.find(CALLS_BEGIN)
        if start < 0:
            return ParsedOutput(text, [])
        calls = [ToolCall(match["name"], match["arguments"]) for match in self._call.finditer(text, start)]
        if not calls:
            return ParsedOutput(text, [])
        return ParsedOutput(text[:start].strip() or None, calls)

    def segments(self, tools: ToolSchemas, parallel: bool, repeat: bool) -> list[dict[str, str | list[str]]]:
        functions = " | ".join(
            f"{lark_string(name + chr(10) + '```json' + chr(10))} {tools.arguments_json(name)}" for name in tools.names
        )
        call = (
            f'{lark_string(CALL_BEGIN)} "function" {lark_string(SEPARATOR)} ({functions}) '
            f"{lark_string(chr(10) + '```')} {lark_string(CALL_END)}"
        )
        more = f' ("\\n" {call})*' if parallel else ""
        return [
            {
                "trigger": CALLS_BEGIN,
                "body": f"{call}{more} {lark_string(CALLS_END)}",
                "tokens": [CALL_BEGIN, SEPARATOR, CALL_END, CALLS_END],
            }
        ]
