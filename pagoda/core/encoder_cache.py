"""The encoder cache and each step's encoder budget: which images a step encodes.

A request's images (pagoda.media_item.MediaItem) are encoded by the model's vision encoder
before the prefill reaches their placeholder tokens. Their outputs are kept here by content hash
salted with the request's cache salt (as the prefix cache salts its block hashes), so a
repeated image (a multi-turn chat sending it again, n samples, a recompute after preemption,
the next chunk of a prompt cut through an image) is not encoded again, and one tenant's images
never answer another's lookups.

The cache holds no per-request state: a preempted or finished request leaves nothing behind but
least-recently-used entries, bounded in rows (one per placeholder token). What a step reads is
kept (`begin_step`) even past the bound, so a step never evicts its own inputs.

The scheduler plans each step's encoder work with an `EncoderStep`: a chunk that reaches an
image the cache does not hold is cut before it when the step's encoder budget (image tokens
encoded per step, `--max-num-encoder-tokens`) is spent; the first image of a step always fits,
so no image starves.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass, field, replace

import torch

from pagoda.media_item import MediaItem
from pagoda.request import Request


def encoder_key(item: MediaItem, cache_salt: str | None) -> str:
    """The cache key of an image's encoder output under a tenant's salt."""
    if not cache_salt:
        return item.content_hash
    return hashlib.blake2b(f"{cache_salt}\0{item.content_hash}".encode(), digest_size=16).hexdigest()


@dataclass
class EncoderCacheStats:
    """Counters since start, and the cache's size when the snapshot was taken."""

    images_encoded: int = 0
    image_tokens_encoded: int = 0
    hits: int = 0  # images a step needed that the cache held
    encoder_seconds: float = 0.0
    cached_tokens: int = 0  # rows held now
    capacity_tokens: int = 0


class EncoderCache:
    def __init__(self, capacity_tokens: int) -> None:
        self.capacity_tokens = capacity_tokens
        self._entries: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.num_tokens = 0
        self._step_keys: set[str] = set()  # read by the step being run: never evicted during it
        self.stats = EncoderCacheStats()

    def snapshot(self) -> EncoderCacheStats:
        return replace(self.stats, cached_tokens=self.num_tokens, capacity_tokens=self.capacity_tokens)

    def __contains__(self, key: str) -> bool:
        return key in self._entries

    def __len__(self) -> int:
        return len(self._entries)

    def begin_step(self, keys: Iterable[str]) -> None:
        self._step_keys = set(keys)

    def end_step(self) -> None:
        self._step_keys = set()
        self._evict()

    @property
    def in_use(self) -> set[str]:
        """Keys the running step reads (empty between steps)."""
        return set(self._step_keys)

    def get(self, key: str) -> torch.Tensor:
        self._entries.move_to_end(key)
        return self._entries[key]

    def put(self, key: str, features: torch.Tensor) -> None:
        old = self._entries.pop(key, None)
        if old is not None:
            self.num_tokens -= old.shape[0]
        self._entries[key] = features
        self.num_tokens += features.shape[0]
        self._evict()

    def clear(self) -> None:
        """Forget every output (the weights changed)."""
        self._entries.clear()
        self.num_tokens = 0

    def _evict(self) -> None:
        for key in list(self._entries):
            if self.num_tokens <= self.capacity_tokens:
                return
            if key not in self._step_keys:
                self.num_tokens -= self._entries.pop(key).shape[0]


@dataclass
class EncoderStep:
    """One step's encoder plan: the images to encode (key, item) within the step's budget."""

    cache: EncoderCache
    budget_tokens: int
    whole_images: bool = False  # Gemma 3: a chunk that would end inside an image stops before it
    work: list[tuple[str, MediaItem]] = field(default_factory=list)
    _planned: set[str] = field(default_factory=set)

    def limit(self, request: Request, start: int, num_new: int) -> int:
        """How many of `num_new` tokens from `start` the step may compute: all of them, or up to
        the first image that neither the cache holds nor the budget lets the step encode."""
        for item in request.media:
            if not item.overlaps(start, start + num_new):
                continue
            if self.whole_images and start + num_new < item.end:  # its tokens must be computed together
                return max(item.offset - start, 0)
            key = encoder_key(item, request.cache_salt)
            if key in self._planned or key in self.cache:
                if start <= item.offset:  # counted once, at the chunk that starts the image
                    self.cache.stats.hits += 1
                continue
            if self.work and item.length > self.budget_tokens:
                return max(item.offset - start, 0)
            self.budget_tokens -= item.length
            self.work.append((key, item))
            self._planned.add(key)
        return num_new
