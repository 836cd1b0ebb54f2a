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


def template_messages(messages: list[ChatMessage], tokenizer: Any = None) -> list[dict[str, Any]]:
    """Validated messages as the chat template expects them: role + string content, plus
    tool_calls / tool_call_id where the message has them. A role outside ROLES (a custom role,
    which vLLM passes to the template) is accepted when `tokenizer`'s chat template renders it
    differently from a user message; otherwise it would silently read as one, so it is refused.
    Raises InvalidRequest (param "messages")."""
    plain = []
    for message in messages:
        content = message.content
        parts = [part.model_dump() for part in content] if isinstance(content, list) else content
        extra = {k: v for k, v in (message.model_extra or {}).items() if k in ("tool_calls", "tool_call_id")}
        plain.append({"role": message.role, "content": parts, **extra})
    custom = {message.role for message in messages if message.role not in ROLES}
    roles = ROLES + tuple(
        sorted(role for role in custom if tokenizer is not None and template_renders_role(tokenizer, role))
    )
    return [template_message(m) for m in normalize_messages(plain, roles=roles)]


def template_renders_role(tokenizer: Any, role: str) -> bool:
    """Whether the model's chat template shows a message of `role` otherwise than a user's."""
    if not isinstance(role, str) or not role:
        return False

    def render(as_role: str) -> str | None:
        try:
            return tokenizer.apply_chat_template([{"role": as_role, "content": "x"}], add_generation_prompt=False)
        except Exception:  # a template that refuses the role (or the probe) does not take it
            return None

    custom = render(role)
    return custom is not None and custom != render("user")


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
