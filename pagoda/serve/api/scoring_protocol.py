"""Request and response bodies of /v1/score, /v1/rerank and /classify, as vLLM names their fields
(its rerank body is Cohere's and Jina's: `query`, `documents`, `top_n`, `return_documents`;
`results` of `index`, `relevance_score` and `document`)."""

from __future__ import annotations

import time
from typing import Any, Literal

from pydantic import BaseModel, Field, SerializerFunctionWrapHandler, model_serializer

from pagoda.serve.api.protocol import OpenAIRequest, PromptInput


class ScoringUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int
    completion_tokens: int = 0


class ScoreRequest(OpenAIRequest):
    """vLLM's /v1/score: one text_1 scored against each text_2, or two lists paired one to one."""

    model: str | None = None
    text_1: str | list[str]
    text_2: str | list[str]
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None  # vLLM's: false answers the head's raw logits
    user: str | None = None


class ScoreData(BaseModel):
    index: int
    object: Literal["score"] = "score"
    score: float


class ScoreResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ScoreData]
    usage: ScoringUsage


class RerankDocument(BaseModel):
    text: str


class RerankRequest(OpenAIRequest):
    """Cohere's (v1, v2) and Jina's rerank body, as vLLM reads it. `top_n` None or 0: every
    document."""

    model: str | None = None
    query: str
    documents: list[str | RerankDocument]
    top_n: int | None = None
    return_documents: bool = True
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None  # vLLM's: false answers the head's raw logits
    user: str | None = None

    def document_texts(self) -> list[str]:
        return [d if isinstance(d, str) else d.text for d in self.documents]


class RerankResult(BaseModel):
    index: int  # the document's position in the request
    relevance_score: float
    document: RerankDocument | None = None

    @model_serializer(mode="wrap")
    def _without_absent_document(self, handler: SerializerFunctionWrapHandler) -> Any:
        # return_documents false: no `document` member, as Cohere and Jina answer.
        data = handler(self)
        if isinstance(data, dict) and data.get("document") is None:
            data.pop("document", None)
        return data


class RerankUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class RerankResponse(BaseModel):
    id: str
    model: str
    usage: RerankUsage
    results: list[RerankResult]  # by relevance, best first


class ClassificationRequest(OpenAIRequest):
    """vLLM's /classify: one input or a list (texts or token ids)."""

    model: str | None = None
    input: PromptInput
    truncate_prompt_tokens: int | None = None
    use_activation: bool | None = None  # vLLM's: false answers the head's raw logits
    user: str | None = None


class ClassificationData(BaseModel):
    index: int
    label: str | None  # the most probable class's name (config.json's id2label)
    probs: list[float]
    num_classes: int


class ClassificationResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int = Field(default_factory=lambda: int(time.time()))
    model: str
    data: list[ClassificationData]
    usage: ScoringUsage
