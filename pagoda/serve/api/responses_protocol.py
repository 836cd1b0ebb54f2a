"""Request and response bodies of OpenAI's Responses API (POST /v1/responses).

As with the chat models, unknown fields are accepted and looked up in the table of request
fields (request_fields.py). Input items and tools are kept loose (every member a client may
send, `type` as text): responses.py checks each one where its type needs it, so a wrong item
is a 400 naming `input[i]` instead of a union's unreadable validation error. Output items and
streamed events are built as plain dicts (responses.py); `ResponseObject` describes the
non-streamed body.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field


class ResponsesInput(BaseModel):
    model_config = ConfigDict(extra="allow")


class InputItem(ResponsesInput):
    """A message (`type` "message" or absent, with `role`), a `function_call` the model made
    earlier, a `function_call_output` answering it, or an earlier `reasoning` item."""

    type: str | None = None
    role: str | None = None
    content: str | list[dict[str, Any]] | None = None
    call_id: str | None = None
    name: str | None = None
    arguments: str | None = None
    output: str | list[dict[str, Any]] | None = None
    id: str | None = None
    status: str | None = None


class TextFormat(ResponsesInput):
    type: str
    name: str | None = None
    schema_: dict[str, Any] | None = Field(default=None, alias="schema")
    strict: bool | None = None
    description: str | None = None


class TextConfig(ResponsesInput):
    format: TextFormat | None = None
    verbosity: str | None = None


class ResponsesRequest(ResponsesInput):
    model: str | None = None
    input: str | list[InputItem]
    instructions: str | None = None
    max_output_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    text: TextConfig | None = None
    stream: bool = False
    store: bool | None = None
    previous_response_id: str | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None


class InputTokensDetails(BaseModel):
    cached_tokens: int = 0


class OutputTokensDetails(BaseModel):
    reasoning_tokens: int = 0


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: InputTokensDetails = Field(default_factory=InputTokensDetails)
    output_tokens: int
    output_tokens_details: OutputTokensDetails = Field(default_factory=OutputTokensDetails)
    total_tokens: int


ResponseStatus = Literal["completed", "incomplete", "in_progress", "failed"]


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    status: ResponseStatus
    incomplete_details: dict[str, Any] | None = None
    error: dict[str, Any] | None = None
    model: str
    instructions: str | None = None
    output: list[dict[str, Any]]
    parallel_tool_calls: bool = True
    tool_choice: str | dict[str, Any] = "auto"
    tools: list[dict[str, Any]] = Field(default_factory=list)
    temperature: float | None = None
    top_p: float | None = None
    max_output_tokens: int | None = None
    previous_response_id: str | None = None
    store: bool = False
    text: dict[str, Any] = Field(default_factory=lambda: {"format": {"type": "text"}})
    reasoning: dict[str, Any] | None = None
    truncation: str = "disabled"
    metadata: dict[str, str] = Field(default_factory=dict)
    user: str | None = None
    usage: ResponseUsage | None = None


class DeletedResponse(BaseModel):
    id: str
    object: Literal["response.deleted"] = "response.deleted"
    deleted: bool = True
