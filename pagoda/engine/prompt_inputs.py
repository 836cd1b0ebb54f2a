"""The prompt shapes the offline API accepts, as vLLM's: text, token ids, or dicts of either.

`{"prompt": "..."}` is vLLM's TextPrompt and `{"prompt_token_ids": [...]}` its TokensPrompt; a
list may mix all four shapes. Anything else is refused with a message listing the shapes. A dict
may carry `"multi_modal_data": {"image": image or [images]}` (PIL images) for a vision-language
model, its prompt holding one image placeholder per image (`prompt_images`).
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


def prompt_images(prompts: PromptInput | Sequence[PromptInput]) -> list[list[Any]]:
    """Each prompt's images (`multi_modal_data["image"]`), in the order normalize_prompts gives
    the prompts; an empty list for a prompt without."""
    listed: Sequence[object] = [prompts] if _is_single(prompts) else prompts  # type: ignore[assignment]
    images: list[list[Any]] = []
    for index, prompt in enumerate(listed):
        data = prompt.get("multi_modal_data") if isinstance(prompt, Mapping) else None
        if data is None:
            images.append([])
            continue
        if not isinstance(data, Mapping) or set(data) - {"image"}:
            raise TypeError(f'prompt {index}: multi_modal_data takes "image" only (an image or a list of images)')
        value = data.get("image")
        items = list(value) if isinstance(value, (list, tuple)) else [value] if value is not None else []
        if any(not hasattr(item, "convert") for item in items):
            raise TypeError(f"prompt {index}: multi_modal_data images must be PIL images")
        images.append(items)
    return images


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
