"""Chat messages of a request body -> the plain dicts the tokenizer's chat template takes.

Shared by /v1/chat/completions and /tokenize. The checks and normalization themselves are the
tokenizer's (`normalize_messages`); this module adds the tool-calling history: "tool" messages
and assistant messages' `tool_calls` (arguments as objects, pagoda/serve/api/tool_calls.py).
"""

from __future__ import annotations

from typing import Any

from pagoda.serve.api.protocol import ChatMessage
from pagoda.serve.api.tool_calls import template_message
from pagoda.tokenizer import normalize_messages

ROLES = ("system", "developer", "user", "assistant", "tool")


def template_messages(messages: list[ChatMessage]) -> list[dict[str, Any]]:
    """Validated messages as the chat template expects them: role + string content, plus
    tool_calls / tool_call_id where the message has them. Raises InvalidRequest (param
    "messages")."""
    plain = []
    for message in messages:
        content = message.content
        if isinstance(content, list):
            content = [part.model_dump() for part in content]
        extra = {k: v for k, v in (message.model_extra or {}).items() if k in ("tool_calls", "tool_call_id")}
        plain.append({"role": message.role, "content": content, **extra})
    return [template_message(m) for m in normalize_messages(plain, roles=ROLES)]


def message_texts(messages: list[ChatMessage]) -> list[str]:
    """The text of every message and content part, for a length check before templating."""
    texts = []
    for message in messages:
        content = message.content
        if isinstance(content, str):
            texts.append(content)
        elif isinstance(content, list):
            texts.extend(part.text for part in content if part.text)
    return texts
