"""Images to prompt ids and MediaItems, the way the model's processor would make them.

transformers' processor classes pair an image processor with the tokenizer and expand each
image's placeholder; pagoda does the same by hand (the Qwen-VL processors want torchvision for
their video half, which does not import beside every torch): the image processor alone, with its
PIL backend, gives the pixels, and each placeholder token of the prompt becomes as many tokens
as the encoder gives rows for that image. Each item's content hash covers its pixels and grid,
so equal images hash equal however they were sent.
"""

from __future__ import annotations

import hashlib
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch
from PIL import Image

from pagoda.errors import InvalidRequest
from pagoda.media_item import MediaItem
from pagoda.model.vision.qwen import qwen_vl_tokens_per_image
from pagoda.model.vision_config import VisionConfig


class MediaProcessor:
    """One model's image preprocessing and placeholder expansion."""

    def __init__(self, vision: VisionConfig, image_processor: Any) -> None:
        self.vision = vision
        self.image_processor = image_processor

    @classmethod
    def from_pretrained(cls, model_dir: str | Path, vision: VisionConfig) -> MediaProcessor:
        """The checkpoint's image processor (preprocessor_config.json), PIL backend."""
        import transformers

        return cls(vision, transformers.AutoImageProcessor.from_pretrained(str(model_dir)))

    @property
    def placeholder(self) -> str:
        """An image in a prompt's text, before expansion."""
        return self.vision.image_placeholder

    def prepare_text(self, text: str) -> str:
        """A prompt's text as the checkpoint's processor tokenizes it: each placeholder with the
        text the processor puts around an image (Gemma 3's blank lines); unchanged for others."""
        before, after = self.vision.text_around
        if not (before or after):
            return text
        return text.replace(self.placeholder, before + self.placeholder + after)

    def expand(
        self, prompt_token_ids: Sequence[int], images: Sequence[Image.Image]
    ) -> tuple[list[int], tuple[MediaItem, ...]]:
        """The prompt with each image's placeholder token expanded to its feature rows, and the
        images as MediaItems, in prompt order. The prompt holds one placeholder per image."""
        image_token = self.vision.image_token_id
        token = self.vision.placeholder_token_id if self.vision.placeholder_token_id is not None else image_token
        before, after = self.vision.wrap
        ids = list(prompt_token_ids)
        found = ids.count(token)
        if found != len(images):
            raise InvalidRequest(
                f"the prompt has {found} image placeholders ({self.placeholder!r}) for {len(images)} images",
                param="messages",
            )
        out: list[int] = []
        items = []
        pending = iter(images)
        for token_id in ids:
            if token_id != token:
                out.append(token_id)
                continue
            pixels, grid, length = self._preprocess(next(pending))
            out.extend(before)
            items.append(MediaItem(_content_hash(pixels, grid), len(out), length, pixels, grid))
            out.extend([image_token] * length)
            out.extend(after)
        return out, tuple(items)

    def _preprocess(self, image: Image.Image) -> tuple[torch.Tensor, tuple[int, ...], int]:
        """(pixel values, grid, placeholder tokens) of one image."""
        if self.vision.kind == "llava":
            pixels = self.image_processor(images=[image], return_tensors="pt")["pixel_values"][0]
            return pixels.to(torch.float32).contiguous(), (), self.vision.llava_tokens_per_image()
        if self.vision.kind == "qwen2_5_vl":  # patches flattened, with their (t, h, w) grid
            out = self.image_processor(images=[image], return_tensors="pt")
            grid = tuple(int(n) for n in out["image_grid_thw"][0].tolist())
            pixels = out["pixel_values"].to(torch.float32).contiguous()
            return pixels, grid, qwen_vl_tokens_per_image(grid, self.vision)
        if self.vision.kind == "gemma3":  # one square image, pooled to mm_tokens_per_image rows
            pixels = self.image_processor(images=[image], return_tensors="pt")["pixel_values"][0]
            return pixels.to(torch.float32).contiguous(), (), int(self.vision.options["mm_tokens_per_image"])
        raise ValueError(f"no preprocessing for vision kind {self.vision.kind!r}")


def _content_hash(pixels: torch.Tensor, grid: tuple[int, ...]) -> str:
    h = hashlib.blake2b(digest_size=16)
    h.update(repr((tuple(pixels.shape), grid)).encode())
    h.update(pixels.numpy().tobytes())
    return h.hexdigest()
