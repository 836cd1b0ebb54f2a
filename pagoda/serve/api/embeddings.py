"""POST /v1/embeddings: OpenAI's embeddings for the served model, pooled by the engine.

Each input is a prefill in the engine's ordinary batches (worker/pooling.py): its final-norm
hidden states pooled ("last" or "mean": `--pooling`, else the model's sentence-transformers
config, else last), then cut to `dimensions`, L2-normalized unless `normalize` is false, and
sent as floats or base64 (little-endian float32, as OpenAI's clients decode it).
"""

from __future__ import annotations

import asyncio
import base64
import json
import math
import struct
import time
from pathlib import Path
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import BaseModel

from pagoda.sampling_params import SamplingParams
from pagoda.serve.admission.queue import end_arrival
from pagoda.serve.admission.tenants import Tenant
from pagoda.serve.admission.work import RequestWork
from pagoda.serve.api.completions import completion_prompts
from pagoda.serve.api.handler import WholeAnswer, respond
from pagoda.serve.api.lora import resolve_model
from pagoda.serve.api.protocol import OpenAIRequest, PromptInput
from pagoda.serve.api.request_fields import EMBEDDINGS, check_fields
from pagoda.serve.api.truncation import truncate_prompt, truncation_length
from pagoda.serve.errors import APIError, bad_request
from pagoda.serve.serving import EnginePrompt, Generation, ServeContext, new_request_id


class EmbeddingRequest(OpenAIRequest):
    input: PromptInput
    model: str | None = None
    encoding_format: Literal["float", "base64"] = "float"
    dimensions: int | None = None
    user: str | None = None
    normalize: bool = True  # vLLM's: false returns the pooled states as they are
    truncate_prompt_tokens: int | None = None
    truncation_side: Literal["left", "right"] = "left"


class Embedding(BaseModel):
    object: Literal["embedding"] = "embedding"
    index: int
    embedding: list[float] | str


class EmbeddingUsage(BaseModel):
    prompt_tokens: int
    total_tokens: int


class EmbeddingResponse(BaseModel):
    id: str
    object: Literal["list"] = "list"
    created: int
    model: str
    data: list[Embedding]
    usage: EmbeddingUsage


def model_pooling(model_dir: str) -> str | None:
    """The pooling a sentence-transformers model declares (modules.json's Pooling module, or
    sentence_bert_config.json), or None when it declares none pagoda has."""
    root = Path(model_dir)
    configs = []
    try:
        modules = json.loads((root / "modules.json").read_text())
        configs = [
            root / m.get("path", "") / "config.json" for m in modules if str(m.get("type", "")).endswith("Pooling")
        ]
    except (OSError, ValueError, AttributeError, TypeError):
        pass
    configs.append(root / "sentence_bert_config.json")
    for path in configs:
        try:
            config = json.loads(path.read_text())
        except (OSError, ValueError):
            continue
        if not isinstance(config, dict):
            continue
        if config.get("pooling_mode_lasttoken") or config.get("pooling_mode") == "lasttoken":
            return "last"
        if config.get("pooling_mode_mean_tokens") or config.get("pooling_mode") == "mean":
            return "mean"
    return None


def finish_embedding(vector: list[float], dimensions: int | None, normalize: bool) -> list[float]:
    if dimensions is not None:
        vector = vector[:dimensions]
    if normalize:
        norm = math.sqrt(sum(x * x for x in vector)) or 1.0
        vector = [x / norm for x in vector]
    return vector


def encode_base64(vector: list[float]) -> str:
    return base64.b64encode(struct.pack(f"<{len(vector)}f", *vector)).decode("ascii")


class EmbeddingsEndpoint:
    name = "embeddings"
    fields = EMBEDDINGS

    def __init__(self, ctx: ServeContext) -> None:
        self.ctx = ctx
        self.pooling = ctx.settings.pooling or model_pooling(ctx.settings.model_path) or "last"

    async def handle(self, raw: Request, request: EmbeddingRequest, tenant: Tenant) -> Response:
        ctx = self.ctx
        lora_request = resolve_model(ctx, request.model, tenant)
        check_fields(request, self.fields)
        if request.dimensions is not None and request.dimensions < 1:
            raise bad_request(f"dimensions must be >= 1, got {request.dimensions}.", param="dimensions")
        keep = truncation_length(request.truncate_prompt_tokens, ctx.llm.max_model_len)
        num_inputs = (
            1
            if isinstance(request.input, str) or (request.input and isinstance(request.input[0], int))
            else max(len(request.input), 1)
        )
        # No await between the two: the full-queue refusal never sees this request counted
        # both as arriving and as queued.
        end_arrival(raw.scope)
        admission = ctx.admit(tenant, RequestWork(num_inputs, 1))
        try:  # tokenizing a large input takes a while: off the event loop
            prompts = await asyncio.to_thread(self._prompts, request, keep)
        except BaseException:
            admission.release()
            raise
        # The prefill's one token is computed and dropped: nothing is decoded after it.
        params = SamplingParams(temperature=0.0, max_tokens=1, pooling=self.pooling)
        generation = Generation(
            ctx,
            new_request_id("embd"),
            self.name,
            tenant,
            prompts,
            params,
            stream=False,
            admission=admission,
            lora_request=lora_request,
        )
        await generation.start({"prompt": "input"})
        created = int(time.time())
        return await respond(
            raw, generation, None, WholeAnswer(body=lambda _: self.response(generation, request, created))
        )

    def _prompts(self, request: EmbeddingRequest, keep: int | None) -> list[EnginePrompt]:
        try:
            return [
                truncate_prompt(prompt, keep, request.truncation_side)
                for prompt in completion_prompts(request.input, self.ctx.llm.tokenizer)
            ]
        except APIError as exc:  # completions' checks, named for this endpoint
            raise bad_request(exc.message.replace("prompt", "input"), param="input") from None

    def response(self, generation: Generation, request: EmbeddingRequest, created: int) -> EmbeddingResponse:
        data = []
        for index, final in enumerate(generation.finals):
            assert final is not None and final.embedding is not None
            if request.dimensions is not None and request.dimensions > len(final.embedding):
                raise bad_request(
                    f"dimensions ({request.dimensions}) is more than the model's {len(final.embedding)}.",
                    param="dimensions",
                )
            vector: Any = finish_embedding(final.embedding, request.dimensions, request.normalize)
            if request.encoding_format == "base64":
                vector = encode_base64(vector)
            data.append(Embedding(index=index, embedding=vector))
        tokens = generation.num_prompt_tokens
        return EmbeddingResponse(
            id=generation.request_id,
            created=created,
            model=generation.model_name,
            data=data,
            usage=EmbeddingUsage(prompt_tokens=tokens, total_tokens=tokens),
        )
