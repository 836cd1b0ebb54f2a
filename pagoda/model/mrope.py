"""M-RoPE positions (Qwen2.5-VL): three positions per token, temporal, height and width.

A text token has the same position in all three; an image's placeholder tokens have the
image's (temporal, row, column) grid of merged patches, offset by the position the image starts
at; the text after an image continues from that start plus the larger side of its grid (as
transformers' `get_rope_index` counts). So each image shifts the positions after it by
(larger side - its placeholder tokens), and positions past the prompt (decoding) carry the
prompt's total shift: any range of a request's positions is computed from its images alone,
without the rest of the prompt.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from pagoda.media_item import MediaItem


def mrope_components(section: tuple[int, ...], interleaved: bool = False) -> list[int]:
    """Which position (0 temporal, 1 height, 2 width) rotates each rope frequency: in sections,
    one after another (Qwen2.5-VL), or interleaved t, h, w, t, h, w, ... within the first
    3 x section[1] and 3 x section[2] frequencies (Qwen3-VL)."""
    if not interleaved:
        return [i % 3 for i, n in enumerate(section) for _ in range(n)]
    components = [0] * sum(section)
    for dim in (1, 2):  # (a slice past the frequencies stops at them, as transformers slices)
        for frequency in range(dim, min(section[dim] * 3, len(components)), 3):
            components[frequency] = dim
    return components


def image_span(item: MediaItem, merge: int) -> int:
    """How far the positions advance over an image: the larger side of its merged grid."""
    _, h, w = item.grid
    return max(h, w) // merge


def mrope_positions(start: int, end: int, media: Sequence[MediaItem], merge: int) -> torch.Tensor:
    """[3, end - start] positions of tokens start..end-1 of a request whose images are `media`."""
    out = torch.empty(3, end - start, dtype=torch.long)
    shift = 0  # positions gained (or lost) over the images before the cursor
    cursor = start
    for item in media:
        if item.end <= start:
            shift += image_span(item, merge) - item.length
            continue
        if item.offset >= end:
            break
        if cursor < item.offset:  # text before the image
            out[:, cursor - start : item.offset - start] = torch.arange(cursor, item.offset) + shift
            cursor = item.offset
        base = item.offset + shift
        t, h, w = item.grid
        grid_t, grid_h, grid_w = torch.meshgrid(
            torch.arange(t), torch.arange(h // merge), torch.arange(w // merge), indexing="ij"
        )
        rows = torch.stack([grid_t, grid_h, grid_w]).reshape(3, -1) + base
        first, last = cursor - item.offset, min(end, item.end) - item.offset
        out[:, cursor - start : cursor - start + last - first] = rows[:, first:last]
        cursor = item.offset + last
        if cursor < item.end:
            return out
        shift += image_span(item, merge) - item.length
    if cursor < end:
        out[:, cursor - start :] = torch.arange(cursor, end) + shift
    return out


def batch_positions(chunks: Sequence[tuple[int, int, Sequence[MediaItem]]], merge: int) -> torch.Tensor:
    """[3, T] positions of a step's chunks (start, end, the request's images), in batch order."""
    return torch.cat([mrope_positions(start, end, media, merge) for start, end, media in chunks], dim=1)
