"""Engine logprobs -> the two OpenAI shapes: legacy completions lists and chat entries."""

from __future__ import annotations

from typing import Any

from pagoda.outputs import PositionLogprobs
from pagoda.serve.api.protocol import ChatTokenLogprob, CompletionLogprobs, PromptLogprob, PromptLogprobs, TopLogprob


def token_text(token_id: int, position: PositionLogprobs | None, tokenizer: Any) -> str:
    if position is not None:
        entry = position.get(token_id)
        if entry is not None and entry.decoded_token is not None:
            return entry.decoded_token
    return tokenizer.decode_token(token_id)


def _by_rank(position: PositionLogprobs) -> list[tuple[int, Any]]:
    return sorted(position.items(), key=lambda item: item[1].rank)


def legacy_logprobs(
    token_ids: list[int], positions: list[PositionLogprobs | None], tokenizer: Any, text_offset: int
) -> tuple[CompletionLogprobs, int]:
    """The completions API's parallel lists for `token_ids`; returns the next text offset.

    A position without logprobs (the first prompt token) gets None entries. Special tokens
    (a BOS the tokenizer added) are not in the returned text, so they take no width there.
    """
    result = CompletionLogprobs()
    special_ids = getattr(tokenizer, "all_special_ids", ())
    for token_id, position in zip(token_ids, positions):
        text = token_text(token_id, position, tokenizer)
        result.tokens.append(text)
        result.text_offset.append(text_offset)
        if token_id not in special_ids:
            text_offset += len(text)
        if position is None:
            result.token_logprobs.append(None)
            result.top_logprobs.append(None)
            continue
        sampled = position.get(token_id)
        result.token_logprobs.append(sampled.logprob if sampled is not None else None)
        result.top_logprobs.append({token_text(tid, position, tokenizer): lp.logprob for tid, lp in _by_rank(position)})
    return result, text_offset


def join_legacy(first: CompletionLogprobs | None, second: CompletionLogprobs) -> CompletionLogprobs:
    if first is None:
        return second
    return CompletionLogprobs(
        tokens=first.tokens + second.tokens,
        token_logprobs=first.token_logprobs + second.token_logprobs,
        top_logprobs=first.top_logprobs + second.top_logprobs,
        text_offset=first.text_offset + second.text_offset,
    )


def chat_logprobs(
    token_ids: list[int], positions: list[PositionLogprobs], num_top: int, tokenizer: Any
) -> list[ChatTokenLogprob]:
    entries = []
    for token_id, position in zip(token_ids, positions):
        text = token_text(token_id, position, tokenizer)
        sampled = position.get(token_id)
        top = (
            [
                TopLogprob(
                    token=(t := token_text(tid, position, tokenizer)), logprob=lp.logprob, bytes=list(t.encode("utf-8"))
                )
                for tid, lp in _by_rank(position)[:num_top]
            ]
            if num_top
            else []
        )
        entries.append(
            ChatTokenLogprob(
                token=text,
                logprob=sampled.logprob if sampled is not None else float("-inf"),
                bytes=list(text.encode("utf-8")),
                top_logprobs=top,
            )
        )
    return entries


def prompt_logprobs(
    token_ids: list[int], positions: list[PositionLogprobs | None] | None, tokenizer: Any
) -> PromptLogprobs:
    """vLLM's `prompt_logprobs`: per prompt token, {token id: logprob, rank, decoded token}
    for the prompt's token and the top-k at that position (None for the first token)."""
    positions = list(positions or [])
    positions += [None] * (len(token_ids) - len(positions))
    return [
        None
        if position is None
        else {
            str(tid): PromptLogprob(
                logprob=lp.logprob, rank=lp.rank, decoded_token=token_text(tid, position, tokenizer)
            )
            for tid, lp in position.items()
        }
        for position in positions[: len(token_ids)]
    ]
