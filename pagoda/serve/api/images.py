"""Image parts of chat messages: decoded once in `prepare`, their place kept in the text.

Chat's `image_url` parts (a data URL, or an http(s) URL the server may fetch), and what the
Responses and Messages endpoints translate their `input_image` / `image` blocks into, become a
text part holding the model's image placeholder, so the chat template renders them where they
were; the decoded images, in message order, are expanded into the rendered prompt's ids
(`with_images`). Refusals are InvalidRequest (each endpoint's 400 shape); no image bytes reach
a message, a log line or the templated messages.
"""

from __future__ import annotations

from typing import Any

from PIL import Image

from pagoda.errors import InvalidRequest
from pagoda.media.inputs import MediaInputs
from pagoda.serve.api.protocol import ChatMessage, ContentPart

IMAGE_PART_TYPES = ("image_url",)


def take_images(messages: list[ChatMessage], media: MediaInputs) -> tuple[list[ChatMessage], list[Image.Image]]:
    """The messages with each image part replaced by the placeholder, and the images decoded."""
    images: list[Image.Image] = []
    if not any(_has_image(message) for message in messages):
        return messages, images
    count = sum(1 for m in messages if isinstance(m.content, list) for p in m.content if p.type in IMAGE_PART_TYPES)
    media.check_count(count)
    out = []
    for index, message in enumerate(messages):
        if not _has_image(message):
            out.append(message)
            continue
        assert isinstance(message.content, list)  # _has_image found a part
        parts = []
        for part_index, part in enumerate(message.content):
            if part.type not in IMAGE_PART_TYPES:
                parts.append(part)
                continue
            where = f"messages[{index}].content[{part_index}]"  # each refusal names the part
            images.append(media.image(_url(part, where), where))
            parts.append(ContentPart(type="text", text=media.placeholder))
        out.append(message.model_copy(update={"content": parts}))
    return out, images


def _has_image(message: ChatMessage) -> bool:
    return isinstance(message.content, list) and any(part.type in IMAGE_PART_TYPES for part in message.content)


def _url(part: ContentPart, where: str) -> str:
    image_url: Any = (part.model_extra or {}).get("image_url")
    url = image_url.get("url") if isinstance(image_url, dict) else image_url
    if not isinstance(url, str) or not url:
        raise InvalidRequest(f"{where}.image_url.url must be a string", param=where, code="invalid_image_url")
    return url
