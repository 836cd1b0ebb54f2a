"""Triggered grammars: free text until a trigger, then a constrained segment.

One mechanism behind vLLM's structural tags and every tool-call format (`tool_choice` auto,
required and named, for each `--tool-call-parser`). A spec is

    {"placement": "anywhere" | "final" | "start" | "only",
     "segments": [{"trigger": "<tool_call>", "body": '"\\n" %json {...} "\\n</tool_call>"'}, ...]}

where `body` is a Lark expression for what follows its trigger (an optional `rules` string
holds further Lark rules the bodies use). Placement says where segments
may occur in the output:

- anywhere: free text with any number of segments in it (structural tags; hermes calls);
- final:    free text, then at most one segment, which ends the output (mistral's
            `[TOOL_CALLS][...]`, or any format when parallel calls are off);
- start:    either text that does not begin with a trigger, or a segment from the output's
            first character (leading whitespace aside): llama3_json's `{"name": ...}`;
- only:     exactly one segment, nothing else (tool_choice required / named).

A trigger that is a single special token of the tokenizer ([TOOL_CALLS] in Mistral's,
<|python_tag|> in Llama 3.1's) is matched as that token, since a special token never appears
inside grammar text; otherwise it is matched as text (a lazy lexeme: the segment begins at the
first occurrence). A segment's optional `tokens` names further markers its body writes as
quoted strings (DeepSeek's `<｜tool▁sep｜>`): each that is one special token is matched as that
token too. The API server validates specs without a tokenizer (markers as text); the engine
compiles them with its tokenizer, resolving special tokens.
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from typing import Any

PLACEMENTS = ("anywhere", "final", "start", "only")


def is_triggered_spec(spec: Mapping[str, Any]) -> bool:
    return "segments" in spec and "placement" in spec


def check_triggered_spec(spec: Mapping[str, Any]) -> str | None:
    """What is wrong with a spec's shape, or None."""
    if spec.get("placement") not in PLACEMENTS:
        return f"placement must be one of {', '.join(PLACEMENTS)}"
    segments = spec.get("segments")
    if not isinstance(segments, list) or not segments:
        return "needs a non-empty list `segments` of {trigger, body}"
    for i, segment in enumerate(segments):
        if (
            not isinstance(segment, dict)
            or not isinstance(segment.get("trigger"), str)
            or not segment["trigger"]
            or not isinstance(segment.get("body"), str)
        ):
            return f"segments[{i}] needs a non-empty string `trigger` and a Lark string `body`"
        tokens = segment.get("tokens", [])
        if not isinstance(tokens, list) or not all(isinstance(t, str) and t for t in tokens):
            return f"segments[{i}].tokens must be a list of non-empty strings"
    if not isinstance(spec.get("rules", ""), str):
        return "rules must be a string of Lark rules"
    return None


def triggered_lark(spec: Mapping[str, Any], special_tokens: Mapping[str, int] | None = None) -> str:
    """The Lark grammar of a (checked) spec. `special_tokens`: trigger -> token id for the
    triggers that are single special tokens of the tokenizer the grammar is compiled for."""
    special_tokens = special_tokens or {}
    placement = spec["placement"]
    segments = [(s["trigger"], _resolve_tokens(s, special_tokens)) for s in spec["segments"]]
    lines = ["%llguidance {}", "TEXT: /(.|\\n)*/"]
    names = []
    for i, (trigger, body) in enumerate(segments):
        name = f"segment_{i}"
        names.append(name)
        token = f"<[{special_tokens[trigger]}]>" if trigger in special_tokens else None
        if placement in ("anywhere", "final"):
            if token is not None:  # special tokens never occur inside TEXT: no laziness needed
                lines.append(f"{name}: TEXT {token} {body}")
            else:  # the lazy lexeme ends at the trigger's first occurrence: the segment starts there
                lines.append(f"{name}_trigger[lazy]: TEXT {json.dumps(trigger)}")
                lines.append(f"{name}: {name}_trigger {body}")
        elif placement == "start":
            lines.append(f"{name}: /[ \\t\\n]*/ {token or json.dumps(trigger)} {body}")
        else:
            lines.append(f"{name}: {token or json.dumps(trigger)} {body}")
    if spec.get("rules"):
        lines.append(spec["rules"])
    choice = " | ".join(names)
    if placement == "anywhere":
        lines.append(f"start: ({choice})* TEXT")
    elif placement == "final":
        lines.append(f"start: TEXT | {choice}")
    elif placement == "start":
        text_triggers = [t for t, _ in segments if t not in special_tokens]
        if text_triggers:
            # Plain text is anything that does not open with a trigger: once one is written,
            # only the segment can go on.
            opening = "|".join(re.escape(t) for t in text_triggers)
            lines.append(f"PLAIN: /(.|\\n)*/ & ~/[ \\t\\n]*({opening})(.|\\n)*/")
            lines.append(f"start: PLAIN | {choice}")
        else:
            lines.append(f"start: TEXT | {choice}")
    else:
        lines.append(f"start: {choice}")
    return "\n".join(lines) + "\n"


def _resolve_tokens(segment: Mapping[str, Any], special_tokens: Mapping[str, int]) -> str:
    """The segment's body with its special-token markers as those tokens."""
    body = segment["body"]
    for marker in segment.get("tokens", ()):
        if marker in special_tokens:
            body = body.replace(json.dumps(marker), f"<[{special_tokens[marker]}]>")
    return body


def special_trigger_ids(spec: Mapping[str, Any], tokenizer: Any) -> dict[str, int]:
    """marker -> token id for each trigger or segment token that is one special token of
    `tokenizer` (an llguidance LLTokenizer)."""
    found = {}
    for segment in spec["segments"]:
        for marker in (segment["trigger"], *segment.get("tokens", ())):
            ids = tokenizer.tokenize_str(marker)
            if len(ids) == 1 and tokenizer.is_special_token(ids[0]):
                found[marker] = ids[0]
    return found


__all__ = ["PLACEMENTS", "check_triggered_spec", "is_triggered_spec", "special_trigger_ids", "triggered_lark"]
