"""The tool-call formats, one module each; `--tool-call-parser` picks one by name."""

from __future__ import annotations

from typing import get_args

from pagoda.config import ToolCallParserName
from pagoda.serve.api.tool_parsers.base import ParsedOutput, ToolCall, ToolCallParser, ToolSchemas
from pagoda.serve.api.tool_parsers.deepseek_v3 import DeepSeekV3Parser
from pagoda.serve.api.tool_parsers.hermes import HermesParser
from pagoda.serve.api.tool_parsers.llama3_json import Llama3JsonParser
from pagoda.serve.api.tool_parsers.mistral import MistralParser
from pagoda.serve.api.tool_parsers.pythonic import PythonicParser
from pagoda.serve.api.tool_parsers.qwen3_coder import Qwen3CoderParser

PARSERS = get_args(ToolCallParserName)  # --tool-call-parser

# Each --tool-call-parser name's parser (tests/serve/test_tool_calls.py: the names are PARSERS).
PARSER_CLASSES: dict[str, type[ToolCallParser]] = {
    "hermes": HermesParser,
    "llama3_json": Llama3JsonParser,
    "mistral": MistralParser,
    "qwen3_coder": Qwen3CoderParser,
    "pythonic": PythonicParser,
    "deepseek_v3": DeepSeekV3Parser,
}


def get_parser(name: str, tools: ToolSchemas | None = None) -> ToolCallParser:
    """The parser for `name`; `tools`: the request's functions, for formats whose values need
    the schema (qwen3_coder's)."""
    if name not in PARSER_CLASSES:
        raise ValueError(f"tool_call_parser must be one of {', '.join(PARSERS)}, got {name!r}")
    return PARSER_CLASSES[name](tools)


__all__ = ["PARSERS", "PARSER_CLASSES", "ParsedOutput", "ToolCall", "ToolCallParser", "ToolSchemas", "get_parser"]
