"""VisionConfig: what a vision-language checkpoint adds to its decoder's ModelConfig.

Read by the family (pagoda.model.families) from the wrapper's config.json: the token that stands
for one row of image features in the prompt ids, the text a chat message's image becomes
before tokenizing (the family's placeholder, expanded to one token per feature row by
pagoda.media), the vision tower's own config and the family's options for its projector and
feature selection.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


@dataclass(frozen=True)
class VisionConfig:
    kind: str  # its preprocessing and positions: "llava", "qwen2_5_vl" (Qwen3-VL too), "gemma3"
    image_token_id: int  # the placeholder token whose embeddings the image's features replace
    image_placeholder: str  # one image in a chat prompt's text, before expansion (Llava: "<image>")
    tower: dict[str, Any]  # the checkpoint's `vision_config`
    options: dict[str, Any] = field(default_factory=dict)  # the family's own: feature layer, projector...
    # The token a rendered prompt holds for one image, if not the image token itself (Gemma 3:
    # <start_of_image>), and the tokens around the image's expansion (Gemma 3: itself, then
    # <end_of_image>).
    placeholder_token_id: int | None = None
    wrap: tuple[tuple[int, ...], tuple[int, ...]] = ((), ())
    # Text the checkpoint's processor puts around each placeholder in the prompt's text before
    # tokenizing (Gemma 3: "\n\n" on both sides); a chat template trims its text parts, so it is
    # added to the rendered prompt (pagoda.media.processor.MediaProcessor.prepare_text).
    text_around: tuple[str, str] = ("", "")
    # Gemma 3: an image's tokens attend to each other both ways, so a prefill chunk never ends
    # inside an image.
    bidirectional: bool = False

    def tower_int(self, key: str, default: int | None = None) -> int:
        value = self.tower.get(key, default)
        if value is None:
            raise ValueError(f"vision_config has no {key!r}")
        return int(value)

    def llava_tokens_per_image(self) -> int:
        """LLaVA's placeholder tokens of one image: a row per patch (and the CLS row under "full")."""
        patches = (self.tower_int("image_size") // self.tower_int("patch_size")) ** 2
        return patches + (1 if self.options.get("select_strategy", "default") == "full" else 0)
