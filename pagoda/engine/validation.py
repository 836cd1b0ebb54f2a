"""What makes a request invalid for this engine: the one place that answers it.

`validate_request` checks a tokenized prompt and its SamplingParams against the engine's
`EngineLimits` and raises `InvalidRequest` naming the field at fault. The engine core runs it
on every add; the server runs the same function (with the limits the engine reported at start)
before it admits a request, so a hopeless request never takes a queue slot. Per-field checks
of the sampling knobs live in SamplingParams itself; chat-message checks in the tokenizer.
"""

from __future__ import annotations

from dataclasses import dataclass

from pagoda.errors import InvalidRequest
from pagoda.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineLimits:
    """The engine's limits a request is checked against (picklable: sent at start-up)."""

    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def validate_request(prompt_token_ids: list[int], params: SamplingParams,
                     limits: EngineLimits) -> int:
    """Raise InvalidRequest if the engine cannot serve this request; else return the most
    output tokens it may generate (max_tokens, or what the context leaves)."""
    vocab_size = limits.vocab_size
    max_model_len = limits.max_model_len
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        raise InvalidRequest("prompt is empty: at least one token is needed", param="prompt")
    bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(f"prompt contains token id {bad!r} outside the vocabulary [0, {vocab_size})",
                             param="prompt")
    if params.logit_bias:
        bad = next((t for t in params.logit_bias if t >= vocab_size), None)
        if bad is not None:
            raise InvalidRequest(f"logit_bias has token id {bad} outside the vocabulary [0, {vocab_size})",
                                 param="logit_bias")
    if num_prompt >= max_model_len:
        # The prompt alone leaves no room for one generated token: max_tokens is not the fix.
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
            f"has {num_prompt} tokens, which leaves no room for the completion. Please reduce the "
            f"length of the prompt.", param="prompt", code="context_length_exceeded")
    max_output = params.max_tokens if params.max_tokens is not None else max_model_len - num_prompt
    if num_prompt + max_output > max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt + max_output} tokens ({num_prompt} in the prompt, {max_output} for the "
            f"completion). Please reduce the length of the prompt or max_tokens.",
            param="max_tokens", code="context_length_exceeded")
    blocks_needed = limits.num_blocks_for(num_prompt + max_output)
    if blocks_needed > limits.num_kv_blocks:
        raise InvalidRequest(
            f"request needs {blocks_needed} KV blocks ({num_prompt} prompt + {max_output} output "
            f"tokens) but the KV pool holds only {limits.num_kv_blocks}; lower max_tokens",
            param="max_tokens")
    if not limits.enable_chunked_prefill and num_prompt > limits.max_num_batched_tokens:
        raise InvalidRequest(f"prompt has {num_prompt} tokens, more than max_num_batched_tokens "
                             f"({limits.max_num_batched_tokens}) with chunked prefill off", param="prompt")
    return max_output
