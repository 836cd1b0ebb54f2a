"""Tool calling: OpenAI's `tools` / `tool_choice` / `parallel_tool_calls` on top of the chat
template and the grammar engine, and the parsers that turn model output into `tool_calls`.

- The chat template receives `tools` (transformers' `apply_chat_template(tools=...)`);
  assistant messages with `tool_calls` and `tool` messages render in the history.
- `tool_choice`: "none" (tools not shown, output not parsed), "auto" (free text, but once a
  call has started -- hermes `<tool_call>`, mistral `[TOOL_CALLS]`, llama3_json `{` or
  `<|python_tag|>` opening the output, and so on for each parser -- the rest of it follows the
  tools' schemas), "required"
  and a named function (the grammar forces one call or more, with schema-valid arguments).
  All of them are one triggered grammar (pagoda.structured.triggered): each parser says what
  starts a call, what follows it, and where calls may stand.
- The deprecated `functions` / `function_call` are `tools` / `tool_choice` with one call at
  most, answered in their own shape (`message.function_call`, finish_reason "function_call").
- Parsers (`--tool-call-parser`, one module each in pagoda/serve/api/tool_parsers/): hermes
  (`<tool_call>{json}</tool_call>`, Qwen2.5/3, Hermes), llama3_json (`{"name", "parameters"}`,
  optionally after `<|python_tag|>`), mistral (`[TOOL_CALLS][{"name", "arguments"}, ...]`),
  qwen3_coder (`<tool_call><function=name><parameter=x>...`), pythonic (`[f(a=1), g(b="x")]`,
  Llama 3.2/4) and deepseek_v3 (its special-token calls).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass
from typing import Any

from pagoda.errors import InvalidRequest
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams
from pagoda.serve.api.protocol import AssistantMessage
from pagoda.serve.api.structured_request import check_grammar
from pagoda.serve.api.tool_parsers import PARSER_CLASSES, PARSERS, ToolCallParser, ToolSchemas, get_parser
from pagoda.serve.errors import bad_request

__all__ = [
    "PARSERS",
    "PARSER_CLASSES",
    "ToolCallStream",
    "ToolPlan",
    "get_parser",
    "plan_tools",
    "template_message",
    "with_tool_constraint",
]


# ---- requests --------------------------------------------------------------------------------


@dataclass
class ToolPlan:
    """What a request's tools mean for rendering, decoding and parsing."""

    tools: list[dict[str, Any]]  # OpenAI's tool objects, passed to the chat template
    parser: ToolCallParser
    structured_outputs: StructuredOutputsParams | None
    forced: bool  # required / named: the output is only tool calls
    parse: bool = True  # False for tool_choice "none": tools are shown, the output is content
    # The request used the deprecated functions API: the answer is one `function_call`, as OpenAI's.
    legacy_functions: bool = False

    @property
    def call_finish_reason(self) -> str:
        return "function_call" if self.legacy_functions else "tool_calls"

    def message(self, text: str, finish_reason: str | None) -> tuple[AssistantMessage, str | None]:
        """The assistant message for a finished output, and its finish_reason."""
        parsed = None
        if self.parse:  # cut by max_tokens: the complete calls still count, the cut one is content
            parsed = self.parser.parse_cut(text) if finish_reason == "length" else self.parser.parse(text)
        if parsed is None or not parsed.tool_calls:
            return AssistantMessage(content=text), finish_reason
        if self.legacy_functions:
            call = parsed.tool_calls[0]
            message = AssistantMessage(
                content=parsed.content, function_call={"name": call.name, "arguments": call.arguments}
            )
        else:
            message = AssistantMessage(content=parsed.content, tool_calls=[c.to_dict() for c in parsed.tool_calls])
        return message, self.call_finish_reason if finish_reason == "stop" else finish_reason

    def stream_delta(self, call_delta: dict[str, Any]) -> dict[str, Any] | None:
        """A streamed tool_calls delta in the request's shape: as is, or (functions API) as a
        `function_call` delta of the first call (None for the others)."""
        if not self.legacy_functions:
            return {"tool_calls": [call_delta]}
        if call_delta["index"] != 0:
            return None
        return {"function_call": call_delta["function"]}


def with_tool_constraint(params: SamplingParams, plan: ToolPlan | None) -> SamplingParams:
    """Constrain decoding to the tool calls' grammar (required / named, or auto's trigger);
    a tool whose parameters are not a usable JSON schema is a 400 naming `tools`. The check
    blocks: callers run it off the event loop."""
    if plan is not None and plan.parse and plan.parser.keeps_special_tokens:
        params = params.clone(skip_special_tokens=False)
    if plan is None or plan.structured_outputs is None:
        return params
    if params.structured_outputs is not None:
        if plan.forced:
            raise bad_request(
                "tool_choice 'required' or a named function cannot be combined with "
                "response_format or structured_outputs.",
                param="tool_choice",
            )
        return params  # auto: the requested format wins over the tools' trigger
    check_grammar(plan.structured_outputs, "tools")
    return params.clone(structured_outputs=plan.structured_outputs)


def plan_tools(request: Any, parser_name: str, chat_template: str | None) -> ToolPlan | None:
    """Validate `tools` / `tool_choice` / `parallel_tool_calls`; None when tools play no part.
    Raises a 400 APIError naming the field."""
    extra = request.model_extra or {}
    tools = request.tools
    choice = request.tool_choice
    legacy = bool(request.functions)
    if legacy:
        if tools:
            raise bad_request("Use tools or the deprecated functions, not both.", param="functions")
        tools, choice = legacy_tools(request.functions, request.function_call)
    elif request.function_call not in (None, "none"):
        raise bad_request("function_call needs functions.", param="function_call")
    if not tools:
        if choice not in (None, "none"):
            raise bad_request("tool_choice needs tools.", param="tool_choice")
        return None
    if not isinstance(tools, list):
        raise bad_request("tools must be a list of function tools.", param="tools")
    functions = {}
    for i, tool in enumerate(tools):
        function = tool.get("function") if isinstance(tool, dict) else None
        if (
            not isinstance(tool, dict)
            or tool.get("type") != "function"
            or not isinstance(function, dict)
            or not isinstance(function.get("name"), str)
            or not function["name"]
        ):
            raise bad_request(
                f'tools[{i}] must be {{"type": "function", "function": {{"name", "parameters"}}}}}}.', param="tools"
            )
        parameters = function.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(parameters, dict):
            raise bad_request(f"tools[{i}].function.parameters must be a JSON schema object.", param="tools")
        functions[function["name"]] = parameters
    if choice in (None, "auto"):
        mode, names = "auto", list(functions)
    elif choice == "none":  # as vLLM: the template still shows the tools; nothing is parsed
        mode, names = "none", []
    elif choice == "required":
        mode, names = "required", list(functions)
    elif (
        isinstance(choice, dict)
        and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict)
        and isinstance(choice["function"].get("name"), str)
    ):
        name = choice["function"]["name"]
        if name not in functions:
            field_names = ("function_call", "functions") if legacy else ("tool_choice", "tools")
            raise bad_request(
                f"{field_names[0]} names function {name!r}, which is not in {field_names[1]}.", param=field_names[0]
            )
        mode, names = "named", [name]
    else:
        raise bad_request(
            'tool_choice must be \'none\', \'auto\', \'required\' or {"type": "function", "function": {"name": ...}}.',
            param="tool_choice",
        )
    if not chat_template or "tools" not in chat_template:
        raise bad_request("This model's chat template does not support tools.", param="tools")
    parser = get_parser(parser_name, ToolSchemas(functions))
    if mode == "none":
        return ToolPlan(
            tools=tools, parser=parser, structured_outputs=None, forced=False, parse=False, legacy_functions=legacy
        )
    # The functions API answers with one call at most.
    parallel = extra.get("parallel_tool_calls", True) is not False and mode != "named" and not legacy
    structured = parser.constraint(
        ToolSchemas({name: functions[name] for name in names}), parallel, forced=mode != "auto"
    )
    return ToolPlan(
        tools=tools, parser=parser, structured_outputs=structured, forced=mode != "auto", legacy_functions=legacy
    )


def legacy_tools(functions: Any, function_call: Any) -> tuple[list[dict[str, Any]], Any]:
    """The deprecated `functions` / `function_call` as `tools` / `tool_choice`."""
    if not isinstance(functions, list) or not all(isinstance(f, dict) for f in functions):
        raise bad_request('functions must be a list of {"name", "parameters"} objects.', param="functions")
    tools = [{"type": "function", "function": function} for function in functions]
    if function_call is None or function_call in ("auto", "none"):
        return tools, function_call
    if isinstance(function_call, dict) and isinstance(function_call.get("name"), str) and len(function_call) == 1:
        return tools, {"type": "function", "function": {"name": function_call["name"]}}
    raise bad_request("function_call must be 'none', 'auto' or {\"name\": ...}.", param="function_call")


def template_message(message: dict[str, Any]) -> dict[str, Any]:
    """An assistant message's tool_calls with arguments as objects (the form chat templates
    render with `tojson`); OpenAI sends them as JSON text."""
    calls = message.get("tool_calls")
    if not calls:
        return message
    rendered = []
    for call in calls:
        function = dict(call.get("function") or {}) if isinstance(call, dict) else {}
        arguments = function.get("arguments")
        if isinstance(arguments, str):
            try:
                function["arguments"] = json.loads(arguments) if arguments.strip() else {}
            except json.JSONDecodeError:
                raise InvalidRequest(
                    "an assistant message's tool_calls[].function.arguments is not valid JSON.", param="messages"
                ) from None
        rendered.append({**call, "function": function})
    return {**message, "tool_calls": rendered}


# ---- streaming -------------------------------------------------------------------------------


class ToolCallStream:
    """Streams content until a tool call may be starting, then the calls as OpenAI does: per
    call first a delta with index, id, type and name (arguments ""), then argument fragments.
    Hermes calls stream their arguments as they are generated; the other formats send each
    call once the output is complete. Streamed and non-streamed responses parse the same text."""

    def __init__(self, parser: ToolCallParser, forced: bool) -> None:
        self.parser = parser
        self.forced = forced
        self.sent = 0
        self.holding = forced
        self.sent_arguments: list[int] = []  # per call begun: argument characters sent

    @property
    def has_calls(self) -> bool:
        return bool(self.sent_arguments)

    def step(self, text: str, finished: bool) -> tuple[str, list[dict[str, Any]]]:
        """(new content, new tool_call deltas) for the output so far."""
        content = self.content_delta(text)
        deltas: list[dict[str, Any]] = []
        if not finished:  # formats that stream arguments as they are generated
            for index, (name, arguments) in enumerate(self.parser.partial_calls(text)):
                deltas.extend(self._call_deltas(index, name, arguments))
        if finished:
            rest, final = self.finish(text)
            content += rest
            deltas.extend(final)
        return content, deltas

    def _call_deltas(self, index: int, name: str, arguments: str, call_id: str | None = None) -> list[dict]:
        deltas = []
        if index == len(self.sent_arguments):
            self.sent_arguments.append(0)
            deltas.append(
                {
                    "index": index,
                    "id": call_id or "call_" + uuid.uuid4().hex[:24],
                    "type": "function",
                    "function": {"name": name, "arguments": ""},
                }
            )
        fragment = arguments[self.sent_arguments[index] :]
        if fragment:
            self.sent_arguments[index] = len(arguments)
            deltas.append({"index": index, "function": {"arguments": fragment}})
        return deltas

    def content_delta(self, text: str) -> str:
        """New content that is safe to send (it cannot be part of a tool call)."""
        if self.holding:
            return ""
        markers = self.parser.start_markers
        starts = [found for marker in markers if (found := text.find(marker, max(self.sent - len(marker), 0))) >= 0]
        if starts:
            self.holding = True
            limit = min(starts)
        else:
            limit = len(text) - max(_partial_suffix(text, marker) for marker in markers)
        delta = text[self.sent : limit] if limit > self.sent else ""
        self.sent = max(self.sent, limit)
        return delta

    def finish(self, text: str) -> tuple[str, list[dict[str, Any]]]:
        """(remaining content, remaining tool_call deltas) once the output is complete."""
        parsed = self.parser.parse(text)
        if not parsed.tool_calls:
            rest = text[self.sent :] if not self.has_calls else ""
            self.sent = len(text)
            return rest, []
        content = (parsed.content or "")[self.sent :] if not self.forced else ""
        deltas = []
        for index, call in enumerate(parsed.tool_calls):
            deltas.extend(self._call_deltas(index, call.name, call.arguments, call.id))
        return content, deltas


def _partial_suffix(text: str, marker: str) -> int:
    """Length of the longest end of `text` that begins `marker`."""
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
