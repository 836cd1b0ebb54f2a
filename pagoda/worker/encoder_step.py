"""The encoder step: a step's images through the vision encoder, and the rows they fill.

Before the forward, the runner encodes the images the scheduler planned (`encoder_work`, those
the encoder cache did not hold) into the cache, then gathers, for each request's chunk, the
feature rows of the placeholder tokens it computes: a chunk may start or end inside an image
(chunked prefill through image tokens), so it takes the slice of the image's rows its
positions cover.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Protocol

import torch

from pagoda.core.encoder_cache import EncoderCache, encoder_key
from pagoda.media_item import MediaItem
from pagoda.model.decoder import DecoderModel, InputEmbeds
from pagoda.request import Request


class Chunk(Protocol):
    """One request's tokens in the step (the runner's Segment)."""

    request: Request
    start: int
    token_ids: list[int]


def image_embeds(
    model: DecoderModel,
    cache: EncoderCache,
    work: Sequence[tuple[str, MediaItem]],
    chunks: Sequence[Chunk],
    device: torch.device,
) -> InputEmbeds | None:
    """Encode the planned images and return the rows of this step's placeholder tokens (None
    when no chunk reaches an image). The cache keeps what the step reads until `end_step`."""
    needed: list[tuple[int, str, MediaItem, int, int]] = []  # (batch row, key, item, first, last)
    row = 0
    for chunk in chunks:
        start, end = chunk.start, chunk.start + len(chunk.token_ids)
        for item in chunk.request.media:
            if item.overlaps(start, end):
                first, last = max(start, item.offset), min(end, item.end)
                needed.append((row + first - start, encoder_key(item, chunk.request.cache_salt), item, first, last))
        row += len(chunk.token_ids)
    if not needed and not work:
        return None
    cache.begin_step(key for _, key, _, _, _ in needed)
    vision = model.vision
    assert vision is not None, "only a vision-language model's requests carry images"
    for key, item in work:
        if key in cache:  # two requests of the step brought the same image
            continue
        began = time.perf_counter()
        features = vision.encode(item.pixel_values.to(device), item.grid)
        if features.shape[0] != item.length:
            raise ValueError(f"the encoder gave {features.shape[0]} rows for {item.length} placeholder tokens")
        cache.put(key, features)
        cache.stats.encoder_seconds += time.perf_counter() - began
        cache.stats.images_encoded += 1
        cache.stats.image_tokens_encoded += item.length
    if not needed:
        return None
    rows, values = [], []
    for batch_row, key, item, first, last in needed:
        rows.append(torch.arange(batch_row, batch_row + last - first))
        values.append(cache.get(key)[first - item.offset : last - item.offset])
    features = torch.cat(values)
    # Qwen3-VL: the embedding rows, then each DeepStack layer's, side by side.
    parts = features.split(model.config.hidden_size, dim=-1)
    return InputEmbeds(torch.cat(rows).to(device), parts[0], tuple(parts[1:]))
