"""The prompt shapes the offline API accepts, as vLLM's: text, token ids, or dicts of either.

`{"prompt": "..."}` is vLLM's TextPrompt and `{"prompt_token_ids": [...]}` its TokensPrompt; a
list may mix all four shapes. Anything else is refused with a message listing the shapes.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

PromptInput = str | list[int] | Mapping[str, Any]

ACCEPTED_SHAPES = 'a string, a list of token ids, {"prompt": str}, {"prompt_token_ids": [int, ...]}, or a list of these'


def normalize_prompts(prompts: PromptInput | Sequence[PromptInput]) -> list[str | list[int]]:
    """One prompt or a list of prompts -> a list of strings and token-id lists."""
    if _is_single(prompts):
        return [_normalize_one(prompts, 0)]
    if not isinstance(prompts, Sequence) or isinstance(prompts, (bytes, bytearray)):
        raise TypeError(f"prompts must be {ACCEPTED_SHAPES}; got {type(prompts).__name__}")
    if not prompts:
        raise ValueError("prompts is empty")
    return [_normalize_one(prompt, i) for i, prompt in enumerate(prompts)]


def _is_single(prompts: object) -> bool:
    if isinstance(prompts, (str, Mapping)):
        return True
    return isinstance(prompts, list) and bool(prompts) and all(_is_token_id(t) for t in prompts)


def _is_token_id(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _normalize_one(prompt: object, index: int) -> str | list[int]:
    where = f"prompt {index}"
    if isinstance(prompt, str):
        return prompt
    if isinstance(prompt, Mapping):
        if "prompt_token_ids" in prompt:
            return _token_ids(prompt["prompt_token_ids"], f"{where}: prompt_token_ids")
        if "prompt" in prompt:
            text = prompt["prompt"]
            if not isinstance(text, str):
                raise TypeError(f'{where}: "prompt" must be a string, got {type(text).__name__}')
            return text
        keys = ", ".join(map(repr, prompt)) or "none"
        raise TypeError(
            f'{where}: a dict prompt needs a "prompt" or "prompt_token_ids" key '
            f"(got keys: {keys}); accepted shapes: {ACCEPTED_SHAPES}"
        )
    if isinstance(prompt, (list, tuple)):
        return _token_ids(prompt, where)
    raise TypeError(f"{where} must be {ACCEPTED_SHAPES}; got {type(prompt).__name__}")


def _token_ids(value: object, where: str) -> list[int]:
    if not isinstance(value, (list, tuple)) or not all(_is_token_id(t) for t in value):
        raise TypeError(f"{where} must be a list of integer token ids")
    return list(value)
