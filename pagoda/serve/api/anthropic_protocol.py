"""Request bodies of Anthropic's Messages API (POST /v1/messages, /v1/messages/count_tokens).

As with the OpenAI models, unknown fields are accepted and looked up in the table of request
fields (request_fields.py); the blocks keep every member a client may send, checked by the
endpoint where a block type needs them. Responses are built as plain dicts
(anthropic_messages.py).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict


class AnthropicRequest(BaseModel):
    model_config = ConfigDict(extra="allow")


class ContentBlock(AnthropicRequest):
    """text, tool_use (assistant), tool_result (user) or thinking (assistant history)."""

    type: str
    text: str | None = None
    id: str | None = None
    name: str | None = None
    input: dict[str, Any] | None = None
    tool_use_id: str | None = None
    content: str | list[dict[str, Any]] | None = None
    is_error: bool | None = None
    thinking: str | None = None


class AnthropicMessage(AnthropicRequest):
    role: Literal["user", "assistant"]
    content: str | list[ContentBlock]


class AnthropicTool(AnthropicRequest):
    name: str
    description: str | None = None
    input_schema: dict[str, Any] | None = None
    type: str | None = None  # "custom" or absent; Anthropic's server tools are refused


class AnthropicToolChoice(AnthropicRequest):
    type: Literal["auto", "any", "tool", "none"]
    name: str | None = None
    disable_parallel_tool_use: bool | None = None


class ThinkingConfig(AnthropicRequest):
    type: Literal["enabled", "disabled", "adaptive"]
    budget_tokens: int | None = None


class CountTokensRequest(AnthropicRequest):
    model: str
    messages: list[AnthropicMessage]
    system: str | list[ContentBlock] | None = None
    tools: list[AnthropicTool] | None = None
    tool_choice: AnthropicToolChoice | None = None
    thinking: ThinkingConfig | None = None


class MessagesRequest(CountTokensRequest):
    max_tokens: int
    stop_sequences: list[str] | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    stream: bool = False
    metadata: dict[str, Any] | None = None


class MessagesUsage(BaseModel):
    input_tokens: int
    output_tokens: int
    cache_creation_input_tokens: int = 0
    cache_read_input_tokens: int = 0


class MessagesResponse(BaseModel):
    id: str
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    model: str
    content: list[dict[str, Any]]
    stop_reason: str | None = None
    stop_sequence: str | None = None
    usage: MessagesUsage


class CountTokensResponse(BaseModel):
    input_tokens: int
