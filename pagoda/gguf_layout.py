"""A GGUF file's layout checked against its size before any reader trusts it.

GGUF's header is counts and lengths: of metadata entries, of strings, of array elements, of
tensors, of each tensor's dimensions, and each tensor's data offset. A reader that loops over a
count or allocates a length as the file states it can be made to loop for ever, allocate without
bound, or read outside the file (llama.cpp CVE-2025-49847, Ollama CVE-2026-7482). `check_gguf_layout`
walks the header once, refusing every count or length that the bytes left in the file cannot
hold before it goes on, and every tensor whose data would lie outside the file, with a ValueError
naming the file and the field; only then do the `gguf` package's reader (the weights) and
transformers (the tokenizer) read it. It allocates nothing in proportion to what the file claims:
the file is mapped, strings are skipped, not decoded, except `general.alignment`'s value.
"""

from __future__ import annotations

import mmap
import struct
from pathlib import Path

UNREADABLE = "not a readable GGUF file, corrupt or truncated"
MAGIC = b"GGUF"
SUPPORTED_VERSIONS = (2, 3)
DEFAULT_ALIGNMENT = 32
MAX_ALIGNMENT = 1 << 20
MAX_DIMS = 4  # GGML_MAX_DIMS
MAX_ARRAY_NESTING = 4

# Metadata value types: fixed sizes; 8 is a string, 9 an array.
_SCALAR_SIZES = {0: 1, 1: 1, 2: 2, 3: 2, 4: 4, 5: 4, 6: 4, 7: 1, 10: 8, 11: 8, 12: 8}
_STRING, _ARRAY = 8, 9
# A tensor info at its smallest: a name's length (and one byte), n_dims, one dim, type, offset.
_MIN_TENSOR_INFO = 8 + 1 + 4 + 8 + 4 + 8
_MIN_KV = 8 + 1 + 4 + 1  # a key's length (and one byte), the value type, a one-byte value


def _block_sizes() -> dict[int, tuple[int, int]]:
    """ggml type id -> (elements per block, bytes per block)."""
    import gguf

    return {int(kind): sizes for kind, sizes in gguf.GGML_QUANT_SIZES.items()}


class _Cursor:
    def __init__(self, data: mmap.mmap | bytes, path: Path, order: str) -> None:
        self.data = data
        self.path = path
        self.order = order
        self.offset = 0

    @property
    def left(self) -> int:
        return len(self.data) - self.offset

    def fail(self, what: str) -> ValueError:
        return ValueError(f"{self.path}: {UNREADABLE} ({what} at byte {self.offset})")

    def unpack(self, fmt: str, what: str) -> tuple:
        layout = struct.Struct(self.order + fmt)
        if layout.size > self.left:
            raise self.fail(f"truncated {what}")
        values = layout.unpack_from(self.data, self.offset)
        self.offset += layout.size
        return values

    def skip(self, size: int, what: str) -> None:
        if size < 0 or size > self.left:
            raise self.fail(f"{what} of {size} bytes runs past the end of the file")
        self.offset += size

    def count(self, what: str, minimum_bytes_each: int) -> int:
        (value,) = self.unpack("Q", what)
        if value * minimum_bytes_each > self.left:
            raise self.fail(f"{what} {value} cannot fit in the {self.left} bytes left")
        return value

    def string(self, what: str) -> int:
        """Skip a string; returns where its bytes start."""
        length = self.count(f"{what} length", 1)
        start = self.offset
        self.skip(length, what)
        return start


def check_gguf_layout(path: str | Path) -> None:
    """ValueError naming `path` and the field unless every count, length, dimension, alignment
    and tensor offset of its header fits the file."""
    path = Path(path)
    try:
        with path.open("rb") as handle:
            size = path.stat().st_size
            if size < 24:
                raise ValueError(f"{path}: {UNREADABLE} ({size} bytes, shorter than a GGUF header)")
            with mmap.mmap(handle.fileno(), 0, access=mmap.ACCESS_READ) as data:
                _check(data, path)
    except OSError as error:
        raise ValueError(f"{path}: unreadable ({error.strerror or error})") from None


def _check(data: mmap.mmap, path: Path) -> None:
    if data[:4] != MAGIC:
        raise ValueError(f"{path}: {UNREADABLE} (no GGUF magic)")
    (version,) = struct.unpack_from("<I", data, 4)
    order = "<"
    if version & 0xFFFF == 0:  # written on a machine of the other byte order
        order = ">"
        (version,) = struct.unpack_from(">I", data, 4)
    if version not in SUPPORTED_VERSIONS:
        raise ValueError(
            f"{path}: {UNREADABLE} (GGUF version {version}; pagoda reads versions "
            f"{', '.join(map(str, SUPPORTED_VERSIONS))})"
        )
    cursor = _Cursor(data, path, order)
    cursor.offset = 8
    (n_tensors, n_kv) = cursor.unpack("QQ", "tensor and metadata counts")
    if n_tensors * _MIN_TENSOR_INFO > cursor.left or n_kv * _MIN_KV > cursor.left:
        raise cursor.fail(f"{n_tensors} tensors and {n_kv} metadata entries cannot fit in {cursor.left} bytes")
    alignment = DEFAULT_ALIGNMENT
    for _ in range(n_kv):
        key_start = cursor.string("metadata key")
        key = bytes(data[key_start : cursor.offset])
        (kind,) = cursor.unpack("I", "metadata value type")
        if key == b"general.alignment":
            if kind != 4:
                raise cursor.fail("general.alignment is not a uint32")
            (alignment,) = cursor.unpack("I", "general.alignment")
            if alignment == 0 or alignment & (alignment - 1) or alignment > MAX_ALIGNMENT:
                raise cursor.fail(f"general.alignment {alignment} is not a power of two up to {MAX_ALIGNMENT}")
            continue
        _skip_value(cursor, kind, key.decode("utf-8", "replace")[:80], 0)
    sizes = _block_sizes()
    tensors = []
    for index in range(n_tensors):
        cursor.string(f"tensor {index} name")
        (n_dims,) = cursor.unpack("I", f"tensor {index} dimension count")
        if not 1 <= n_dims <= MAX_DIMS:
            raise cursor.fail(f"tensor {index} has {n_dims} dimensions (1 to {MAX_DIMS})")
        dims = cursor.unpack("Q" * n_dims, f"tensor {index} dimensions")
        (kind, offset) = cursor.unpack("IQ", f"tensor {index} type and offset")
        if kind not in sizes:
            raise cursor.fail(f"tensor {index} has an unknown type {kind}")
        elements = 1
        for dim in dims:
            if dim == 0:
                raise cursor.fail(f"tensor {index} has a zero dimension")
            elements *= dim
            if elements > len(data) * 256:  # no block type packs more than 256 elements into a byte
                raise cursor.fail(f"tensor {index}'s dimensions {list(dims)} hold more elements than the file")
        block, block_bytes = sizes[kind]
        if dims[0] % block:
            raise cursor.fail(f"tensor {index}'s rows of {dims[0]} are not whole blocks of {block}")
        tensors.append((index, offset, elements // block * block_bytes))
    data_start = -(-cursor.offset // alignment) * alignment
    for index, offset, nbytes in tensors:
        if offset % alignment:
            raise cursor.fail(f"tensor {index}'s offset {offset} is not a multiple of the alignment {alignment}")
        if data_start + offset + nbytes > len(data):
            raise ValueError(
                f"{path}: {UNREADABLE} (tensor {index}'s {nbytes} bytes at offset "
                f"{offset} run past the end of the file)"
            )


def _skip_value(cursor: _Cursor, kind: int, key: str, depth: int) -> None:
    if kind in _SCALAR_SIZES:
        cursor.skip(_SCALAR_SIZES[kind], f"metadata {key!r}")
    elif kind == _STRING:
        cursor.string(f"metadata {key!r}")
    elif kind == _ARRAY:
        if depth >= MAX_ARRAY_NESTING:
            raise cursor.fail(f"metadata {key!r} nests arrays more than {MAX_ARRAY_NESTING} deep")
        (element,) = cursor.unpack("I", f"metadata {key!r} element type")
        if element in _SCALAR_SIZES:
            count = cursor.count(f"metadata {key!r} element count", _SCALAR_SIZES[element])
            cursor.skip(count * _SCALAR_SIZES[element], f"metadata {key!r}")
        elif element in (_STRING, _ARRAY):
            count = cursor.count(f"metadata {key!r} element count", 8 if element == _STRING else 12)
            for _ in range(count):
                _skip_value(cursor, element, key, depth + 1)
        else:
            raise cursor.fail(f"metadata {key!r} has an unknown element type {element}")
    else:
        raise cursor.fail(f"metadata {key!r} has an unknown value type {kind}")
