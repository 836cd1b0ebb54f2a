"""Reasoning models: the thinking segment of an output, split from the answer.

`--reasoning-parser` names how the model marks its thinking; both formats wrap it in
`<think>` ... `</think>`:

- qwen3: thinking is what the output opens with `<think>` (or what the prompt left open: a
  template that ends the prompt with `<think>`); `{"enable_thinking": false}` in
  `chat_template_kwargs` makes Qwen3's template close it in the prompt, so the output is all
  answer.
- deepseek_r1: the template opens `<think>` in the prompt (older ones did not write it at
  all), so the output is thinking from its first token until `</think>`.

An output whose thinking never closes (cut by max_tokens) is all reasoning. Chat answers it as
vLLM does (`message.reasoning_content`, streamed `delta.reasoning_content`), the Messages API
as `thinking` blocks. Tool calls and structured output apply to the answer: a constraint
becomes "free thinking, `</think>`, then the constraint" (`after_reasoning`), and the tool-call
parsers read only the text after the thinking.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any, get_args

from pagoda.config import ReasoningParserName
from pagoda.sampling_params import SamplingParams, StructuredOutputsParams
from pagoda.serve.errors import bad_request
from pagoda.structured.grammar import JSON_OPTIONS
from pagoda.structured.triggered import is_triggered_spec

PARSERS = get_args(ReasoningParserName)

# apply_chat_template's own arguments: chat_template_kwargs may not set them (they are the
# request's other fields, or would make the template return something other than text).
RESERVED_TEMPLATE_KWARGS = frozenset(
    {
        "conversation",
        "messages",
        "tools",
        "documents",
        "chat_template",
        "add_generation_prompt",
        "continue_final_message",
        "tokenize",
        "padding",
        "truncation",
        "max_length",
        "return_tensors",
        "return_dict",
        "return_assistant_tokens_mask",
        "tokenizer_kwargs",
    }
)


def check_template_kwargs(value: Any) -> dict[str, Any]:
    """chat_template_kwargs as the template's extra variables; a 400 naming the field when it
    is not an object or sets one of apply_chat_template's own arguments."""
    if value is None:
        return {}
    if not isinstance(value, dict):
        raise bad_request("chat_template_kwargs must be an object of template variables.", param="chat_template_kwargs")
    reserved = sorted(RESERVED_TEMPLATE_KWARGS.intersection(value))
    if reserved:
        raise bad_request(
            f"chat_template_kwargs may not set {', '.join(reserved)}; use the request's own fields.",
            param="chat_template_kwargs",
        )
    return dict(value)


@dataclass(frozen=True)
class ReasoningParser:
    name: str
    start: str = "<think>"
    end: str = "</think>"
    # deepseek_r1: the output is thinking from its first token, whatever the prompt shows.
    always_opens: bool = False

    def opened_by_prompt(self, prompt_text: str) -> bool:
        """Whether the output starts inside the thinking: the prompt's last marker opens it
        (or the format always does)."""
        return self.always_opens or prompt_text.rfind(self.start) > prompt_text.rfind(self.end)

    def closed_by_prompt(self, prompt_text: str) -> bool:
        """Whether the prompt ends the thinking itself (Qwen3's `enable_thinking: false`): the
        output is all answer."""
        return not self.always_opens and prompt_text.rfind(self.end) > prompt_text.rfind(self.start)

    def split(self, text: str, opened: bool) -> tuple[str | None, str]:
        """(reasoning or None, answer) of an output; `opened`: the prompt left thinking open."""
        stripped = text.lstrip()
        if stripped.startswith(self.start):
            body = stripped[len(self.start) :]
        elif opened:
            body = text
        else:
            return None, text
        end = body.find(self.end)
        if end < 0:
            return body.lstrip(), ""
        return body[:end].lstrip(), body[end + len(self.end) :].lstrip()


def get_reasoning_parser(name: str | None) -> ReasoningParser | None:
    if name is None:
        return None
    if name not in PARSERS:
        raise ValueError(f"reasoning_parser must be one of {', '.join(PARSERS)}, got {name!r}")
    return ReasoningParser(name, always_opens=name == "deepseek_r1")


class ReasoningStream:
    """Splits a streamed output as it grows: each step returns the new reasoning and the new
    answer text. A marker's first characters are held back until it is known whether they
    begin it, so streamed and whole answers split the same text the same way."""

    def __init__(self, parser: ReasoningParser, opened: bool) -> None:
        self.parser = parser
        self.opened = opened
        self.sent_reasoning = 0
        self.sent_answer = 0

    def step(self, text: str, finished: bool) -> tuple[str, str]:
        if not finished:
            stripped = text.lstrip()
            if not self.opened and self.parser.start.startswith(stripped):
                return "", ""  # may still open with the start marker
            text = text[: len(text) - _partial_suffix(text, self.parser.end)]
        reasoning, answer = self.parser.split(text, self.opened)
        reasoning = reasoning or ""
        new_reasoning = reasoning[self.sent_reasoning :]
        new_answer = answer[self.sent_answer :]
        self.sent_reasoning = max(self.sent_reasoning, len(reasoning))
        self.sent_answer = max(self.sent_answer, len(answer))
        return new_reasoning, new_answer

    def answer_so_far(self, text: str) -> str:
        """The answer part of an output so far (what the tool-call parsers read)."""
        return self.parser.split(text, self.opened)[1]


def after_reasoning(params: SamplingParams, parser: ReasoningParser | None, prompt_text: str) -> SamplingParams:
    """`params` whose constraint applies to the answer only: free thinking up to `</think>`,
    then the constraint. Unchanged without a parser, when the prompt already closed the
    thinking, or for a triggered grammar that waits for its trigger in free text anyway
    (tool_choice auto, structural tags)."""
    constraint = params.structured_outputs
    if parser is None or constraint is None or parser.closed_by_prompt(prompt_text):
        return params
    body = _answer_lark(constraint)
    if body is None:
        return params
    spec = {"placement": "final", "segments": [{"trigger": parser.end, "body": body}]}
    return params.clone(structured_outputs=StructuredOutputsParams(structural_tag=spec))


def _answer_lark(constraint: StructuredOutputsParams) -> str | None:
    """The constraint as a Lark expression, or None when it is free text until a trigger."""
    kind, spec = constraint.kind, constraint.spec
    # The blank lines models write after `</think>`, bounded (a model could pad forever).
    gap = "/\\n{0,2}/ "
    if kind in ("json", "json_object"):
        schema = {"type": "object"} if kind == "json_object" else json.loads(spec) if isinstance(spec, str) else spec
        return gap + f"%json {json.dumps({**schema, 'x-guidance': JSON_OPTIONS})}"
    if kind == "regex":
        return gap + "/" + spec.replace("/", "\\/") + "/"
    if kind == "choice":
        return gap + "(" + " | ".join(json.dumps(c) for c in spec) + ")"
    if kind == "structural_tag" and isinstance(spec, dict) and is_triggered_spec(spec) and spec["placement"] == "only":
        # tool_choice required / named: one of the calls, right after the thinking
        return gap + "(" + " | ".join(f"{json.dumps(s['trigger'])} {s['body']}" for s in spec["segments"]) + ")"
    if kind == "grammar":
        raise bad_request(
            "A grammar cannot be combined with a reasoning parser (the answer "
            "follows the thinking); use a JSON schema, regex or choice.",
            param="structured_outputs",
        )
    return None


def _partial_suffix(text: str, marker: str) -> int:
    for size in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:size]):
            return size
    return 0
