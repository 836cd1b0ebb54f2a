"""Chat messages of a request body -> the plain dicts the tokenizer's chat template takes.

Shared by /v1/chat/completions and /tokenize. The checks and normalization themselves are the
tokenizer's (`normalize_messages`); this module only adds what the server does not support yet.
"""

from __future__ import annotations

from pagoda.errors import InvalidRequest
from pagoda.serve.protocol import ChatMessage
from pagoda.tokenizer import normalize_messages

ROLES = ("system", "developer", "user", "assistant")


def template_messages(messages: list[ChatMessage]) -> list[dict[str, str]]:
    """Validated messages as the chat template expects them: role + string content.
    Raises InvalidRequest (param "messages")."""
    plain = []
    for i, message in enumerate(messages):
        if (message.model_extra or {}).get("tool_calls"):
            raise InvalidRequest(f"messages[{i}].tool_calls is not supported.", param="messages")
        content = message.content
        if isinstance(content, list):
            content = [part.model_dump() for part in content]
        plain.append({"role": message.role, "content": content})
    return normalize_messages(plain, roles=ROLES)
