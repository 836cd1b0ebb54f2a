"""What makes a request invalid for this engine: the one place that answers it.

`validate_request` checks a tokenized prompt and its SamplingParams against the engine's
`EngineLimits` and raises `InvalidRequest` naming the field at fault. The engine core runs it
on every add; the server runs the same function (with the limits the engine reported at start)
before it admits a request, so a hopeless request never takes a queue slot. The other checks
the engine runs on an add (request ids, the engine's role, LoRA being enabled) are the named
`check_*` functions below. Per-field checks of the sampling knobs live in SamplingParams
itself; chat-message checks in the tokenizer.
"""

from __future__ import annotations

from collections.abc import Container
from dataclasses import dataclass
from typing import TYPE_CHECKING

from pagoda.errors import InvalidRequest
from pagoda.media_item import MediaItem
from pagoda.sampling_params import SamplingParams

if TYPE_CHECKING:
    from pagoda.engine.roles import HandoffTarget
    from pagoda.model.classifier_config import ClassifierConfig


@dataclass(frozen=True)
class EngineLimits:
    """The engine's limits a request is checked against (sent to the front at start-up)."""

    max_model_len: int
    vocab_size: int
    num_kv_blocks: int
    block_size: int
    max_num_batched_tokens: int
    enable_chunked_prefill: bool
    image_token_id: int | None = None  # a vision-language model's image placeholder; None: text only

    def num_blocks_for(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)


def validate_request(prompt_token_ids: list[int], params: SamplingParams, limits: EngineLimits) -> int:
    """Raise InvalidRequest if the engine cannot serve this request; else return the most
    output tokens it may generate (max_tokens, or what the context leaves)."""
    vocab_size = limits.vocab_size
    max_model_len = limits.max_model_len
    num_prompt = len(prompt_token_ids)
    if num_prompt == 0:
        raise InvalidRequest("prompt is empty: at least one token is needed", param="prompt")
    bad = next((t for t in prompt_token_ids if not isinstance(t, int) or not 0 <= t < vocab_size), None)
    if bad is not None:
        raise InvalidRequest(
            f"prompt contains token id {bad!r} outside the vocabulary [0, {vocab_size})", param="prompt"
        )
    if params.logit_bias:
        bad = next((t for t in params.logit_bias if t >= vocab_size), None)
        if bad is not None:
            raise InvalidRequest(
                f"logit_bias has token id {bad} outside the vocabulary [0, {vocab_size})", param="logit_bias"
            )
    if params.allowed_token_ids:
        bad = next((t for t in params.allowed_token_ids if t >= vocab_size), None)
        if bad is not None:
            raise InvalidRequest(
                f"allowed_token_ids has token id {bad} outside the vocabulary [0, {vocab_size})",
                param="allowed_token_ids",
            )
    if num_prompt >= max_model_len:
        # The prompt alone leaves no room for one generated token: max_tokens is not the fix.
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, your prompt "
            f"has {num_prompt} tokens, which leaves no room for the completion. Please reduce the "
            f"length of the prompt.",
            param="prompt",
            code="context_length_exceeded",
        )
    max_output = params.max_tokens if params.max_tokens is not None else max_model_len - num_prompt
    if num_prompt + max_output > max_model_len:
        raise InvalidRequest(
            f"This model's maximum context length is {max_model_len} tokens. However, you requested "
            f"{num_prompt + max_output} tokens ({num_prompt} in the prompt, {max_output} for the "
            f"completion). Please reduce the length of the prompt or max_tokens.",
            param="max_tokens",
            code="context_length_exceeded",
        )
    blocks_needed = limits.num_blocks_for(num_prompt + max_output)
    if blocks_needed > limits.num_kv_blocks:
        raise InvalidRequest(
            f"request needs {blocks_needed} KV blocks ({num_prompt} prompt + {max_output} output "
            f"tokens) but the KV pool holds only {limits.num_kv_blocks}; lower max_tokens",
            param="max_tokens",
        )
    if not limits.enable_chunked_prefill and num_prompt > limits.max_num_batched_tokens:
        raise InvalidRequest(
            f"prompt has {num_prompt} tokens, more than max_num_batched_tokens "
            f"({limits.max_num_batched_tokens}) with chunked prefill off",
            param="prompt",
        )
    return max_output


def check_classifier_use(params: SamplingParams, classifier: ClassifierConfig | None) -> None:
    """Scoring needs a classifier head; a sequence-classification checkpoint has no LM head,
    so it only scores and classifies."""
    if params.pooling == "classify" and classifier is None:
        raise InvalidRequest(
            "this model has no classifier head: scoring and classification need a "
            "*ForSequenceClassification checkpoint or --score-tokens (e.g. no,yes)",
            param="model",
        )
    if params.pooling is None and classifier is not None and not classifier.generates:
        raise InvalidRequest(
            "this model is a sequence classifier: it scores and classifies (/v1/score, "
            "/v1/rerank, /classify) and does not generate text",
            param="model",
        )


def check_request_id_free(request_id: str, in_use: Container[str]) -> None:
    if request_id in in_use:
        raise InvalidRequest(f"request id {request_id!r} is already in use")


def check_prompt_text(prompt: str) -> None:
    """A text prompt must have text (a token-id prompt is checked by validate_request)."""
    if not prompt:
        raise InvalidRequest("prompt is empty", param="prompt")


def check_lora_enabled(lora_name: str, enabled: bool) -> None:
    """A request may name an adapter only on an engine started with --enable-lora."""
    if not enabled:
        raise InvalidRequest(
            f"LoRA adapter {lora_name!r} requested but the engine runs without --enable-lora",
            param="model",
            code="model_not_found",
        )


def check_lora_updatable(lora_name: str, enabled: bool) -> None:
    """Adapters are loaded or unloaded at run time only with --enable-lora."""
    if not enabled:
        raise InvalidRequest(
            f"cannot load or unload LoRA adapter {lora_name!r}: the engine runs without --enable-lora",
            param="lora_name",
        )


def check_exportable(params: SamplingParams) -> None:
    """A prefill engine hands off single-sample, unconstrained requests only (for now)."""
    if params.n != 1:
        raise InvalidRequest("n > 1 is not supported by a prefill-role engine yet", param="n")
    if params.structured_outputs is not None:
        raise InvalidRequest(
            "structured output is not supported by a prefill-role engine yet "
            "(the grammar state does not travel with the KV)",
            param="structured_outputs",
        )
    if params.prompt_logprobs is not None:
        raise InvalidRequest("prompt_logprobs are not supported by a prefill-role engine yet", param="prompt_logprobs")


def check_role_accepts(role: str, params: SamplingParams, handoff: HandoffTarget | None, awaiting_kv: bool) -> None:
    """What an engine of `role` (--role) takes: a prefill engine exportable requests, a handoff
    target only a prefill engine, a request awaiting its KV only a decode engine."""
    if role == "prefill":
        check_exportable(params)
    elif handoff is not None:
        raise InvalidRequest(f"a KV handoff target was given to a {role}-role engine")
    if awaiting_kv and role != "decode":
        raise InvalidRequest(f"a {role}-role engine does not receive KV handoffs")


def invalid_handoff(request_id: str, error: Exception) -> InvalidRequest:
    """Why a decode engine cannot continue a handed-off request (its header holds sampling
    params or limits this engine refuses)."""
    return InvalidRequest(f"handed-off request {request_id!r}: {error}")


def check_media(prompt_token_ids: list[int], media: tuple[MediaItem, ...], limits: EngineLimits) -> None:
    """A request's images fit its prompt: a vision-language model, each item's placeholder range
    inside the prompt, in order and apart, made of the image token only, and no image token
    left without its image."""
    image_token = limits.image_token_id
    if image_token is None:
        if media:
            raise InvalidRequest("this model takes no images (it is not a vision-language model)", param="messages")
        return
    end = 0
    for item in media:
        if item.offset < end or item.length < 1 or item.end > len(prompt_token_ids):
            raise InvalidRequest("an image's placeholder range does not fit the prompt", param="messages")
        if any(t != image_token for t in prompt_token_ids[item.offset : item.end]):
            raise InvalidRequest("an image's placeholder range holds other tokens", param="messages")
        end = item.end
    if prompt_token_ids.count(image_token) != sum(item.length for item in media):
        raise InvalidRequest(
            "the prompt holds image placeholder tokens without their image (or an image without its placeholders)",
            param="messages",
        )
