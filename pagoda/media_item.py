"""MediaItem: one image of a request as the engine sees it.

The front decodes and preprocesses an image once (pagoda.media) and puts in the request what the
engine needs: the pixels the vision encoder takes, the content hash that names them (the
encoder cache's key and part of the prefix cache's block hashes, so two different images never
share KV), and where its placeholder tokens sit in the prompt ids (the rows its features
replace). It sits low, beside the request, because `Request` carries it.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass
from typing import Any

import torch


@dataclass(frozen=True, eq=False)
class MediaItem:
    content_hash: str  # hex digest of the preprocessed pixels and their grid
    offset: int  # first placeholder token in the prompt ids
    length: int  # placeholder tokens: one per row of encoder output
    pixel_values: torch.Tensor  # what the family's vision encoder takes (float32)
    # The family's grid of the image: Qwen2.5-VL's (t, h, w) patches; () where the shape is fixed.
    grid: tuple[int, ...] = ()

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, MediaItem):
            return NotImplemented
        return (self.content_hash, self.offset, self.length, self.grid) == (
            other.content_hash,
            other.offset,
            other.length,
            other.grid,
        ) and torch.equal(self.pixel_values, other.pixel_values)

    def __hash__(self) -> int:
        return hash((self.content_hash, self.offset, self.length))

    @property
    def end(self) -> int:
        return self.offset + self.length

    def overlaps(self, start: int, end: int) -> bool:
        """Whether positions [start, end) reach any of its placeholder tokens."""
        return self.offset < end and start < self.end

    def to_dict(self) -> dict[str, Any]:
        """JSON values (the process transport): the pixels as base64 of their float32 bytes."""
        pixels = self.pixel_values.detach().to(torch.float32).contiguous()
        return {
            "content_hash": self.content_hash,
            "offset": self.offset,
            "length": self.length,
            "shape": list(pixels.shape),
            "pixels": base64.b64encode(pixels.numpy().tobytes()).decode("ascii"),
            "grid": list(self.grid),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> MediaItem:
        shape = [int(s) for s in data["shape"]]
        raw = base64.b64decode(data["pixels"], validate=True)
        count = 1
        for size in shape:
            count *= size
        if len(raw) != 4 * count:
            raise ValueError(f"media item: {len(raw)} bytes of pixels for shape {shape}")
        pixels = torch.frombuffer(bytearray(raw), dtype=torch.float32).reshape(shape)
        return cls(
            content_hash=str(data["content_hash"]),
            offset=int(data["offset"]),
            length=int(data["length"]),
            pixel_values=pixels,
            grid=tuple(int(g) for g in data["grid"]),
        )


def items_in(items: tuple[MediaItem, ...], start: int, end: int) -> list[MediaItem]:
    """The items whose placeholders positions [start, end) reach, in prompt order."""
    return [item for item in items if item.overlaps(start, end)]
