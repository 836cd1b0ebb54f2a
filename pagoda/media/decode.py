"""Safe image decoding: the one place client bytes become pixels.

Only PNG, JPEG, WebP and GIF (its first frame) are opened, by Pillow with its format list
restricted, so none of Pillow's other decoders is reachable from a request. Before any pixel is
decoded the byte size, the header's width x height and Pillow's decompression-bomb guard
(`Image.MAX_IMAGE_PIXELS`, set from the same cap, errors instead of warnings) are checked;
every refusal is an InvalidRequest (a 400 in each API's error shape), whose message names the
limit and never the bytes. The image is converted to RGB (alpha over white would change what
the processor sees; transformers' processors convert with `convert("RGB")` too).
"""

from __future__ import annotations

import io
import warnings
from dataclasses import dataclass

from PIL import Image

from pagoda.errors import InvalidRequest

FORMATS = ("PNG", "JPEG", "WEBP", "GIF")


@dataclass(frozen=True)
class ImageLimits:
    """Per image: encoded bytes and decoded pixels; per request: how many images."""

    max_bytes: int = 20 * 1024 * 1024
    max_pixels: int = 40_000_000  # width x height: a 6k x 6k photo, far below a bomb's size
    max_images: int = 16


def decode_image(data: bytes, limits: ImageLimits, param: str = "messages") -> Image.Image:
    """The image in `data` as RGB; InvalidRequest naming the cap it breaks or the format."""
    if len(data) > limits.max_bytes:
        raise InvalidRequest(
            f"an image is {len(data)} bytes; at most {limits.max_bytes} are accepted",
            param=param,
            code="image_too_large",
        )
    if not data:
        raise InvalidRequest("an image is empty", param=param, code="invalid_image")
    try:
        with warnings.catch_warnings():
            warnings.simplefilter("error", Image.DecompressionBombWarning)
            _guard_bomb(limits)
            image = Image.open(io.BytesIO(data), formats=FORMATS)
            width, height = image.size
            if width < 1 or height < 1 or width * height > limits.max_pixels:
                raise InvalidRequest(
                    f"an image is {width}x{height} pixels; at most {limits.max_pixels} pixels are accepted",
                    param=param,
                    code="image_too_large",
                )
            image.load()  # an animation's first frame: where open() leaves it, no other frame is read
            return image.convert("RGB")
    except InvalidRequest:
        raise
    except (Image.DecompressionBombError, Image.DecompressionBombWarning):
        raise InvalidRequest(
            f"an image decompresses past {limits.max_pixels} pixels", param=param, code="image_too_large"
        ) from None
    except Image.UnidentifiedImageError:
        raise InvalidRequest(
            f"an image is not in an accepted format ({', '.join(FORMATS)})", param=param, code="invalid_image"
        ) from None
    except Exception:  # noqa: BLE001 -- truncated or corrupt data: Pillow's decoders raise many types
        raise InvalidRequest(
            "an image could not be decoded (corrupt or truncated)", param=param, code="invalid_image"
        ) from None


def _guard_bomb(limits: ImageLimits) -> None:
    """Pillow's own guard at the same cap (it also checks frames and tiles the header check
    does not see). Process-wide in Pillow; pagoda sets the same value every time."""
    Image.MAX_IMAGE_PIXELS = limits.max_pixels


def check_image_count(count: int, limits: ImageLimits, param: str = "messages") -> None:
    if count > limits.max_images:
        raise InvalidRequest(
            f"{count} images in one request; at most {limits.max_images} are accepted",
            param=param,
            code="too_many_images",
        )
