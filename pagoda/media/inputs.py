"""MediaInputs: one served model's way from image parts to the engine's MediaItems.

The server's endpoints hold one per model (built from the model's config at start-up): an image
part's URL to bytes (pagoda.media.sources, under the fetch policy), the bytes to an RGB image
(pagoda.media.decode, under the image caps), and the images of a rendered prompt to expanded
prompt ids and MediaItems (pagoda.media.processor). A text-only model's has no processor: any
image part is a 400 saying so.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from PIL import Image

from pagoda.errors import InvalidRequest
from pagoda.media.decode import ImageLimits, check_image_count, decode_image
from pagoda.media.processor import MediaProcessor
from pagoda.media.sources import FetchPolicy, image_bytes
from pagoda.media_item import MediaItem
from pagoda.model.vision_config import VisionConfig


@dataclass
class MediaInputs:
    processor: MediaProcessor | None
    limits: ImageLimits = field(default_factory=ImageLimits)
    fetch: FetchPolicy = field(default_factory=FetchPolicy)

    @classmethod
    def for_model(cls, model: str | Path, limits: ImageLimits, fetch: FetchPolicy) -> MediaInputs:
        """The model's (a directory or GGUF file): with its image processor when its config is a
        vision-language model's."""
        vision = _vision_config(model)
        processor = MediaProcessor.from_pretrained(model, vision) if vision is not None else None
        return cls(processor, limits, fetch)

    @property
    def placeholder(self) -> str:
        """What an image part becomes in a message's text before templating."""
        return self.require().placeholder

    def require(self, param: str = "messages") -> MediaProcessor:
        if self.processor is None:
            raise InvalidRequest(
                "this model takes no images (it is not a vision-language model)",
                param=param,
                code="images_not_supported",
            )
        return self.processor

    def image(self, url: str, param: str = "messages") -> Image.Image:
        """An image part's URL (data: or an allowed http(s) URL), decoded."""
        self.require(param)
        return decode_image(image_bytes(url, self.fetch, param), self.limits, param)

    def image_from_base64(self, data: str, media_type: str, param: str = "messages") -> Image.Image:
        """An image given as base64 with its media type (Anthropic's `source`)."""
        return self.image(f"data:{media_type};base64,{data}", param)

    def check_count(self, count: int, param: str = "messages") -> None:
        check_image_count(count, self.limits, param)

    def prepare_text(self, text: str) -> str:
        return self.require().prepare_text(text)

    def expand(
        self, prompt_token_ids: Sequence[int], images: Sequence[Image.Image]
    ) -> tuple[list[int], tuple[MediaItem, ...]]:
        return self.require().expand(prompt_token_ids, images)


def _vision_config(model: str | Path) -> VisionConfig | None:
    from pagoda.model.loader import load_model_config

    try:
        return load_model_config(model).vision
    except (ValueError, OSError):  # the engine reports a model it cannot read; text only here
        return None
