"""Which chat template renders a request's messages, and how its prompt ends.

The template is the request's own `chat_template` (only when the server runs with
`--trust-request-chat-template`, as vLLM: a template is code run on every request), else the
server's `--chat-template`, else the model's. `add_generation_prompt` opens a new assistant
turn; `continue_final_message` instead leaves the last message open for the model to continue
(a prefilled answer), so the two cannot both be set (setting only `continue_final_message`
turns the generation prompt off).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagoda.serve.errors import bad_request

# Characters a template has and a file name (almost) never does.
_TEMPLATE_CHARS = ("{", "}", "\n")


def load_chat_template(value: str) -> str:
    """--chat-template: the text of FILE when it names one, else the value itself when it reads
    as an inline template; ValueError otherwise."""
    try:
        path = Path(value).expanduser()
        if path.is_file():
            return path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as exc:
        if not any(char in value for char in _TEMPLATE_CHARS):
            raise ValueError(f"--chat-template {value!r}: {exc}") from None
    if any(char in value for char in _TEMPLATE_CHARS):
        return value
    raise ValueError(f"--chat-template {value!r} is neither a file nor an inline Jinja template")


@dataclass(frozen=True)
class ChatTemplateChoice:
    """The template and the prompt ending for one request; `kwargs` go to encode_chat."""

    template: Any  # a template's text, or the tokenizer's own (a string or named templates)
    add_generation_prompt: bool
    continue_final_message: bool

    @property
    def kwargs(self) -> dict[str, Any]:
        return {
            "chat_template": self.template,
            "add_generation_prompt": self.add_generation_prompt,
            "continue_final_message": self.continue_final_message,
        }


def choose_chat_template(
    request: Any, server_template: str | None, trust_request_template: bool, tokenizer: Any
) -> ChatTemplateChoice:
    """The request's template choice; a 400 naming the field for a request template the server
    does not accept or for both prompt endings at once."""
    requested = getattr(request, "chat_template", None)
    if requested is not None:
        if not trust_request_template:
            raise bad_request(
                "chat_template is not accepted by this server (start it with "
                "--trust-request-chat-template to allow templates in requests).",
                param="chat_template",
            )
        if not requested.strip():
            raise bad_request("chat_template must be a non-empty Jinja template.", param="chat_template")
        template = requested
    else:
        template = server_template or getattr(tokenizer.hf, "chat_template", None)
    continue_final = bool(getattr(request, "continue_final_message", False))
    add_generation_prompt = bool(getattr(request, "add_generation_prompt", True))
    if continue_final and "add_generation_prompt" not in getattr(request, "model_fields_set", ()):
        add_generation_prompt = False  # its default gives way; only an explicit true conflicts
    if continue_final and add_generation_prompt:
        raise bad_request(
            "continue_final_message and add_generation_prompt cannot both be true; "
            "set add_generation_prompt to false to continue the final message.",
            param="continue_final_message",
        )
    return ChatTemplateChoice(template, add_generation_prompt, continue_final)
