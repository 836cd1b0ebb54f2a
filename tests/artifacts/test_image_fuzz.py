"""The image decoder (pagoda.media.decode) fuzzed: every client's image reaches it, before any
authentication of its content (peers shipped decoder overflows and image-borne DoS reached this
way: vLLM CVE-2026-22778).

Seeds: a valid PNG, JPEG, WebP and animated GIF, a PNG whose header claims 100,000 x 100,000
pixels (a decompression bomb), a GIF whose logical screen is huge, formats that are refused
(BMP, TIFF, ICO, PDF-ish text) and truncations. Hypothesis then mutates them (byte flips,
truncations, splices), deterministically and within a bounded number of examples. Every input
ends in an RGB image within the caps or in InvalidRequest: no other exception, no hang, and no
allocation beyond the pixel cap's worth of memory.
"""

from __future__ import annotations

import io
import struct
import tracemalloc
import zlib

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from pagoda.errors import InvalidRequest
from pagoda.media.decode import ImageLimits, decode_image

PIL = pytest.importorskip("PIL.Image")
FUZZ = settings(
    max_examples=150, deadline=None, derandomize=True, database=None, suppress_health_check=list(HealthCheck)
)
LIMITS = ImageLimits(max_bytes=1 << 20, max_pixels=512 * 512, max_images=4)
# Peak Python allocation for one decode: the pixel cap in RGBA plus the decoder's own overhead.
ALLOWED_PEAK = 4 * LIMITS.max_pixels * 3 + (16 << 20)


def encoded(fmt: str, size=(24, 16), **save) -> bytes:
    rng = np.random.default_rng(len(fmt))
    image = PIL.fromarray(rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8))
    out = io.BytesIO()
    image.save(out, format=fmt, **save)
    return out.getvalue()


def animated_gif() -> bytes:
    frames = [PIL.new("RGB", (20, 10), color) for color in ((255, 0, 0), (0, 255, 0), (0, 0, 255))]
    out = io.BytesIO()
    frames[0].save(out, format="GIF", save_all=True, append_images=frames[1:], duration=50, loop=0)
    return out.getvalue()


def png_bomb(width: int = 100_000, height: int = 100_000) -> bytes:
    """A PNG header claiming a huge image over a tiny compressed stream of zeros."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)

    ihdr = struct.pack(">IIBBBBB", width, height, 8, 2, 0, 0, 0)
    rows = zlib.compress(b"\0" * (1 << 16), 9)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", rows) + chunk(b"IEND", b"")


def gif_with_screen(width: int, height: int) -> bytes:
    data = bytearray(encoded("GIF"))
    data[6:10] = struct.pack("<HH", width, height)
    return bytes(data)


VALID = {
    "png": encoded("PNG"),
    "jpeg": encoded("JPEG", quality=80),
    "webp": encoded("WEBP"),
    "gif": animated_gif(),
}
REFUSED = {
    "bmp": encoded("BMP"),
    "tiff": encoded("TIFF"),
    "ico": encoded("ICO", size=(16, 16)),
    "bomb": png_bomb(),
    "wide-bomb": png_bomb(1 << 20, 4),
    "gif-screen": gif_with_screen(65535, 65535),
    "text": b"%PDF-1.4 not an image",
    "empty": b"",
    "too-many-bytes": b"\x89PNG" + b"\0" * (LIMITS.max_bytes + 1),
}


def decode_checked(data: bytes) -> None:
    tracemalloc.start()
    try:
        image = decode_image(data, LIMITS)
    except InvalidRequest as error:
        assert error.code in ("invalid_image", "image_too_large")
        chunks = [data[i : i + 8] for i in range(0, min(len(data), 64), 8)]
        assert not any(repr(chunk)[2:-1] in error.message for chunk in chunks if len(chunk) == 8)  # no bytes echoed
    else:
        assert image.mode == "RGB" and image.width * image.height <= LIMITS.max_pixels
    finally:
        _, peak = tracemalloc.get_traced_memory()
        tracemalloc.stop()
    assert peak < ALLOWED_PEAK, peak


@pytest.mark.parametrize("name", list(VALID))
def test_the_accepted_formats_decode(name):
    image = decode_image(VALID[name], LIMITS)
    assert image.mode == "RGB" and image.size == ((20, 10) if name == "gif" else (24, 16))


def test_an_animation_gives_its_first_frame():
    assert decode_image(VALID["gif"], LIMITS).getpixel((0, 0)) == (255, 0, 0)


@pytest.mark.parametrize("name", list(REFUSED))
def test_refused_inputs_are_invalid_requests(name):
    with pytest.raises(InvalidRequest):
        decode_image(REFUSED[name], LIMITS)


@pytest.mark.parametrize("name", list(VALID))
def test_every_truncation(name):
    data = VALID[name]
    for end in range(0, len(data), max(1, len(data) // 40)):
        decode_checked(data[:end])


SEEDS = list(VALID.values()) + [REFUSED["bomb"], REFUSED["gif-screen"]]


@FUZZ
@given(
    st.sampled_from(SEEDS),
    st.lists(st.tuples(st.integers(0, 1 << 16), st.integers(0, 255)), max_size=8),
    st.integers(0, 1 << 16),
    st.binary(max_size=64),
)
def test_mutated_images(seed, flips, cut, splice):
    data = bytearray(seed)
    for position, value in flips:
        data[position % len(data)] = value
    position = cut % (len(data) + 1)
    decode_checked(bytes(data[:position]) + splice + bytes(data[position:]))
