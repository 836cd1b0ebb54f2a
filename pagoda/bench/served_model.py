"""What a pagoda (or vLLM) server says about its model: its local directory and context length.

`/v1/models` cards carry `root` (the model's path on the server) and `max_model_len`. When the
server runs on this machine the root is a directory we can load the tokenizer from, so
`pagoda bench serve` needs no --tokenizer for a local server, and its workload lengths adapt to
the served context.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model")


@dataclass(frozen=True)
class ServedModel:
    local_dir: str | None  # the model directory, when it exists here and holds a tokenizer
    max_model_len: int | None


def discover_served_model(base_url: str, model: str, api_key: str | None = None, timeout: float = 10.0) -> ServedModel:
    """The served model's card; a server without /v1/models (or not answering) gives nothing."""
    url = base_url.rstrip("/")
    url = url[: -len("/v1")] if url.endswith("/v1") else url
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(url + "/v1/models", headers=headers, timeout=timeout, trust_env=False)
        cards = response.json().get("data", []) if response.status_code == 200 else []
    except (httpx.HTTPError, ValueError):
        cards = []
    card = next((c for c in cards if c.get("id") == model), cards[0] if len(cards) == 1 else None)
    if card is None:
        return ServedModel(None, None)
    root = card.get("root")
    local = root if isinstance(root, str) and any((Path(root) / f).is_file() for f in TOKENIZER_FILES) else None
    length = card.get("max_model_len")
    return ServedModel(local, length if isinstance(length, int) and length > 0 else None)
