"""Request and response bodies of the OpenAI-compatible API (plus vLLM's tokenize endpoints).

Requests accept unknown fields and ignore them, as OpenAI does; fields that would change the
meaning of a request but are not supported are declared here so the handlers can refuse them
with a 400 instead of silently ignoring them. Streamed chunks are formatted as JSON text by
each endpoint's ChunkFormatter for speed; these models describe the non-streamed bodies.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

PromptInput = str | list[str] | list[int] | list[list[int]]


class OpenAIRequest(BaseModel):
    model_config = ConfigDict(extra="allow")


class StreamOptions(OpenAIRequest):
    include_usage: bool = False


class SamplingFields(OpenAIRequest):
    """Generation knobs shared by completions and chat (OpenAI's plus the engine's own)."""

    model: str | None = None
    n: int = 1
    temperature: float | None = None
    top_p: float | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    stream: bool = False
    stream_options: StreamOptions | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # Engine extensions, named as in vLLM.
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    min_tokens: int = 0
    ignore_eos: bool = False
    stop_token_ids: list[int] | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    prompt_logprobs: int | None = None  # top-k logprobs of every prompt token
    allowed_token_ids: list[int] | None = None
    bad_words: list[str] | None = None
    truncate_prompt_tokens: int | None = None  # keep this many prompt tokens (-1: the context length)
    truncation_side: Literal["left", "right"] = "left"  # "left" drops the oldest tokens
    return_token_ids: bool = False  # answer with prompt_token_ids and each choice's token_ids
    # Beam search (vLLM's fields): n beams, the best first; scored as transformers' num_beams.
    use_beam_search: bool = False
    length_penalty: float = 1.0
    early_stopping: bool | Literal["never"] = False

    @property
    def sequences_per_prompt(self) -> int:
        """What each prompt runs at once, as admission charges it: n."""
        return max(self.n, 1)

    priority: int | None = None  # --scheduling-policy priority: checked against the key's tenant


class CompletionRequest(SamplingFields):
    prompt: PromptInput
    max_tokens: int | None = 16
    echo: bool = False
    logprobs: int | None = None
    best_of: int | None = None  # the beam width with use_beam_search (n best returned)
    suffix: str | None = None

    @property
    def sequences_per_prompt(self) -> int:
        """n, or a beam search's width (best_of)."""
        if self.use_beam_search and self.best_of is not None:
            return max(self.best_of, self.n, 1)
        return max(self.n, 1)


class ContentPart(OpenAIRequest):
    type: str
    text: str | None = None


class ChatMessage(OpenAIRequest):
    role: str
    content: str | list[ContentPart] | None = None
    name: str | None = None


class ResponseFormat(OpenAIRequest):
    type: str


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessage]
    max_tokens: int | None = None
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None
    response_format: ResponseFormat | None = None
    tools: list[Any] | None = None
    tool_choice: Any = None
    functions: list[Any] | None = None
    function_call: Any = None
    add_generation_prompt: bool = True
    chat_template_kwargs: dict[str, Any] | None = None
    chat_template: str | None = None  # pagoda/serve/api/chat_template.py
    continue_final_message: bool = False


class TokenizeRequest(OpenAIRequest):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template: str | None = None
    return_token_strs: bool = False


class DetokenizeRequest(OpenAIRequest):
    model: str | None = None
    tokens: list[int]


# ---- responses -------------------------------------------------------------------------------


class PromptTokensDetails(BaseModel):
    cached_tokens: int = 0


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int
    prompt_tokens_details: PromptTokensDetails = Field(default_factory=PromptTokensDetails)


class CompletionLogprobs(BaseModel):
    """The legacy completions shape: parallel lists, one entry per token."""

    tokens: list[str] = Field(default_factory=list)
    token_logprobs: list[float | None] = Field(default_factory=list)
    top_logprobs: list[dict[str, float] | None] = Field(default_factory=list)
    text_offset: list[int] = Field(default_factory=list)


class PromptLogprob(BaseModel):
    """vLLM's shape of one token's entry in `prompt_logprobs`."""

    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


# One entry per prompt token (None for the first, which has no context): token id (as JSON
# text) -> its logprob, for the prompt's own token and the top-k.
PromptLogprobs = list[dict[str, PromptLogprob] | None]


class CompletionChoice(BaseModel):
    index: int
    text: str
    logprobs: CompletionLogprobs | None = None
    finish_reason: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids
    token_ids: list[int] | None = None  # with return_token_ids


class CompletionResponse(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage
    system_fingerprint: str | None = None


class TopLogprob(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None = None


class ChatTokenLogprob(TopLogprob):
    top_logprobs: list[TopLogprob] = Field(default_factory=list)


class ChatChoiceLogprobs(BaseModel):
    content: list[ChatTokenLogprob] | None = None
    refusal: list[ChatTokenLogprob] | None = None


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None = None
    refusal: str | None = None
    reasoning_content: str | None = None  # pagoda/serve/api/reasoning.py
    tool_calls: list[dict[str, Any]] | None = None  # pagoda/serve/api/tool_calls.py
    function_call: dict[str, Any] | None = None  # the deprecated functions API's one call


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    logprobs: ChatChoiceLogprobs | None = None
    finish_reason: str | None = None
    token_ids: list[int] | None = None  # with return_token_ids


class ChatCompletionResponse(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    prompt_logprobs: PromptLogprobs | None = None
    prompt_token_ids: list[int] | None = None  # with return_token_ids


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "pagoda"
    root: str | None = None
    parent: str | None = None  # a LoRA adapter's base model
    max_model_len: int | None = None
    max_num_seqs: int | None = None  # sequences the engine runs at once (--max-num-seqs or its measured default)


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


class TokenizeResponse(BaseModel):
    count: int
    max_model_len: int
    tokens: list[int]
    token_strs: list[str] | None = None


class DetokenizeResponse(BaseModel):
    prompt: str
