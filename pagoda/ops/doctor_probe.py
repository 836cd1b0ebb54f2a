"""The doctor's own requests (`pagoda doctor --probe`): a few cheap greedy completions that
show what the metrics cannot: whether a repeated prompt is cached (for the same key, a second
key, and through the chat template) and how the stream's chunks are spaced at a client."""

from __future__ import annotations

import time
import uuid
from typing import Any

import httpx

from pagoda.diagnosis import ProbeReadings
from pagoda.http_client.sse import iter_sse_events
from pagoda.stats import median

PROBE_WORDS = (
    "the quick brown fox jumps over the lazy dog while a patient engineer reads "
    "the metrics of a busy inference server and writes down what they say "
) * 4
PROBE_MAX_TOKENS = 16


def _headers(api_key: str | None) -> dict[str, str]:
    return {"Authorization": f"Bearer {api_key}"} if api_key else {}


def _stream(
    client: httpx.Client, url: str, body: dict[str, Any], api_key: str | None
) -> tuple[dict[str, Any], list[float], float | None]:
    """POST a streamed request: its usage, the gaps between content chunks, and the TTFT."""
    sent = time.perf_counter()
    usage: dict[str, Any] = {}
    gaps: list[float] = []
    last = ttft = None
    with client.stream(
        "POST", url, json={**body, "stream": True, "stream_options": {"include_usage": True}}, headers=_headers(api_key)
    ) as response:
        if response.status_code != 200:
            response.read()
            raise RuntimeError(f"{url} answered {response.status_code}: {response.text[:200]}")
        for event in iter_sse_events(response.iter_lines()):
            if event.done:
                break
            chunk = event.json()
            usage = chunk.get("usage") or usage
            if any((c.get("text") or (c.get("delta") or {}).get("content")) for c in chunk.get("choices") or []):
                now = time.perf_counter()
                if last is None:
                    ttft = now - sent
                else:
                    gaps.append(now - last)
                last = now
    return usage, gaps, ttft


def _cached(usage: dict[str, Any]) -> int:
    return int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)


def run_probe(base_url: str, model: str, api_keys: list[str], *, timeout: float = 60.0) -> ProbeReadings:
    """The probe requests against `base_url`; failures are kept in `errors`, never raised."""
    readings = ProbeReadings()
    key = api_keys[0] if api_keys else None
    # A fresh prefix per run, so that an earlier run's cached blocks do not answer for this one.
    text = f"probe {uuid.uuid4().hex}: {PROBE_WORDS}"
    completion = {"model": model, "prompt": text, "max_tokens": PROBE_MAX_TOKENS, "temperature": 0, "ignore_eos": True}
    completions_url, chat_url = base_url + "/v1/completions", base_url + "/v1/chat/completions"
    gaps: list[float] = []
    with httpx.Client(timeout=timeout, trust_env=False) as client:
        try:
            usage, first_gaps, readings.client_ttft = _stream(client, completions_url, completion, key)
            readings.prompt_tokens = usage.get("prompt_tokens")
            usage, second_gaps, _ = _stream(client, completions_url, completion, key)
            readings.cached_same_tenant = _cached(usage)
            gaps = first_gaps + second_gaps
            if len(api_keys) > 1:
                usage, _, _ = _stream(client, completions_url, completion, api_keys[1])
                readings.cached_other_tenant = _cached(usage)
            chat = {
                "model": model,
                "max_tokens": 4,
                "temperature": 0,
                "messages": [{"role": "user", "content": f"chat {uuid.uuid4().hex}: {PROBE_WORDS}"}],
            }
            _stream(client, chat_url, chat, key)
            usage, _, _ = _stream(client, chat_url, chat, key)
            readings.cached_chat_repeat = _cached(usage)
        except (httpx.HTTPError, RuntimeError, ValueError) as error:
            readings.errors.append(f"{type(error).__name__}: {error}"[:300])
    readings.client_itl_p50 = median(gaps)
    return readings
