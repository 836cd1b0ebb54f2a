"""vLLM's `truncate_prompt_tokens` / `truncation_side`: a tokenized prompt cut to its last (or
first) k tokens before it reaches the engine, for every endpoint that takes a prompt."""

from __future__ import annotations

from typing import Literal

from pagoda.serve.errors import bad_request
from pagoda.serve.serving import EnginePrompt

TruncationSide = Literal["left", "right"]


def truncation_length(truncate_prompt_tokens: int | None, max_model_len: int) -> int | None:
    """The prompt tokens to keep (-1: the model's context length), or None: no truncation.
    Raises a 400 naming the field when the value is out of range."""
    if truncate_prompt_tokens is None:
        return None
    if truncate_prompt_tokens == -1:
        return max_model_len
    if truncate_prompt_tokens < 1:
        raise bad_request(
            f"truncate_prompt_tokens must be -1 (the context length) or >= 1, got {truncate_prompt_tokens}.",
            param="truncate_prompt_tokens",
        )
    if truncate_prompt_tokens > max_model_len:
        raise bad_request(
            f"truncate_prompt_tokens ({truncate_prompt_tokens}) is greater than the "
            f"model's maximum context length ({max_model_len}).",
            param="truncate_prompt_tokens",
        )
    return truncate_prompt_tokens


def truncate_prompt(prompt: EnginePrompt, keep: int | None, side: TruncationSide) -> EnginePrompt:
    """`prompt` cut to `keep` tokens: "left" drops the oldest tokens, "right" the newest. A cut
    prompt loses its text (echo shows the tokens the model saw)."""
    if keep is None or len(prompt.token_ids) <= keep:
        return prompt
    token_ids = prompt.token_ids[-keep:] if side == "left" else prompt.token_ids[:keep]
    return EnginePrompt(token_ids)
