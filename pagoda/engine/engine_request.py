"""EngineRequest: one request as every layer between the front and the engine core sees it.

Built once where a request enters (the server's handler, the offline LLM, a router's prefill
leg) and carried whole through the client (AsyncLLM, ReplicaSet), the transport (AddRequest),
LLMEngine and EngineCore.add_request. No signature on that path names its fields, so a new
per-request field touches this class and the code that reads it, nothing in between; the engine
side only resolves what the front cannot (the prompt's token ids, bad words' token ids) with
`dataclasses.replace`, which keeps every other field as the front set it.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any

from pagoda.errors import InvalidRequest
from pagoda.lora_request import LoRARequest
from pagoda.media_item import MediaItem
from pagoda.sampling_params import SamplingParams


@dataclass(frozen=True)
class EngineRequest:
    request_id: str
    prompt: str | list[int]  # text (the engine tokenizes it, special tokens included) or token ids
    params: SamplingParams
    arrival_time: float | None = None  # when the request reached the server (time.time()); None: now
    cache_salt: str | None = None  # prefix-cache blocks are shared only under the same salt
    priority: int = 0  # --scheduling-policy priority: lower runs first
    lora_request: LoRARequest | None = None  # None: the base model
    # Route hints: what a replica router's pool rules match on; one engine ignores them.
    tenant: str | None = None
    model: str | None = None  # the model name the client asked for (the served one or an adapter)
    # Its images, preprocessed at the edge (pagoda.media): each one's pixels, content hash and
    # placeholder range in the prompt ids (which must then be token ids).
    media: tuple[MediaItem, ...] = ()

    @property
    def prompt_token_ids(self) -> list[int]:
        """The prompt as token ids; text must have been tokenized first (LLMEngine does)."""
        if isinstance(self.prompt, str):
            raise InvalidRequest("the engine core takes token ids: tokenize the prompt first", param="prompt")
        return list(self.prompt)

    def to_dict(self) -> dict[str, Any]:
        """The request as JSON-ready values (the process transport's encoding): every field by
        its name, the sampling parameters and adapter as their fields' values."""
        data = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)}
        data["params"] = dataclasses.asdict(self.params)
        data["lora_request"] = dataclasses.asdict(self.lora_request) if self.lora_request is not None else None
        data["media"] = [item.to_dict() for item in self.media]
        return data

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> EngineRequest:
        """The request to_dict described (SamplingParams checks its values again)."""
        data = dict(data)
        data["params"] = SamplingParams(**data["params"])
        if data["lora_request"] is not None:
            data["lora_request"] = LoRARequest(**data["lora_request"])
        data["media"] = tuple(MediaItem.from_dict(item) for item in data.get("media") or ())
        return cls(**data)
