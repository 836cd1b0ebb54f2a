"""SHA-256 of files, and which files make up an artifact (a model directory, a GGUF file or a
LoRA adapter directory)."""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# PyTorch's pickle formats: never loaded (unpickling runs code from the file).
PICKLE_PATTERNS = ("*.bin", "*.pt", "*.pth", "*.ckpt", "*.pkl")
MANIFEST_FILE = "pagoda-manifest.json"
SIGNATURE_FILE = "model.sig"
# Version-control bookkeeping, never part of an artifact (model-signing ignores the same).
_IGNORED_NAMES = (".git", ".gitattributes", ".github", ".gitignore")
_CHUNK_BYTES = 8 << 20


class ArtifactError(ValueError):
    """An artifact that cannot be trusted or read; the message is one line naming the file."""


# What a manifest's file digests may be: SHA-256 (the default, what `pagoda inspect` shows), or
# BLAKE3 (several times faster per core, so hashing hides behind the weight load).
HASH_ALGORITHMS = ("sha256", "blake3")


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def sha256_file(path: str | Path) -> str:
    """The hex SHA-256 of a file's contents."""
    return _hash_file(path, hashlib.sha256())


def _hash_file(path: str | Path, digest: Any) -> str:
    """`digest` (a hashlib-like object) fed the file in large chunks (hashlib and blake3 release
    the GIL on each, so a loader thread keeps running beside it); its hex digest."""
    buffer = bytearray(_CHUNK_BYTES)
    view = memoryview(buffer)
    with open(path, "rb", buffering=0) as file:
        while read := file.readinto(buffer):
            digest.update(view[:read])
    return digest.hexdigest()


def file_digest(path: str | Path, algorithm: str = "sha256") -> str:
    """The hex digest of a file's contents by one of HASH_ALGORITHMS."""
    if algorithm == "sha256":
        return sha256_file(path)
    if algorithm != "blake3":
        raise ArtifactError(f"{path}: unknown hash algorithm {algorithm!r} (one of {', '.join(HASH_ALGORITHMS)})")
    import blake3  # model-signing's dependency

    return _hash_file(path, blake3.blake3())


def digests_id(digests: dict[str, str]) -> str:
    """One id for a set of (file, digest) pairs: the SHA-256 of their sorted canonical JSON."""
    canonical = json.dumps(dict(sorted(digests.items())), separators=(",", ":"))
    return "sha256:" + sha256_bytes(canonical.encode())


@dataclass(frozen=True)
class ArtifactFiles:
    """Where an artifact's files, manifest and signature are. `root` is the directory the
    manifest's relative names start from; a single GGUF file is an artifact of its own, its
    manifest and signature beside it."""

    root: Path
    single_file: str | None  # the GGUF file's name when the artifact is one file
    manifest_path: Path
    signature_path: Path

    @classmethod
    def of(cls, path: str | Path) -> ArtifactFiles:
        path = Path(path)
        if path.is_dir():
            return cls(path, None, path / MANIFEST_FILE, path / SIGNATURE_FILE)
        if path.is_file():
            return cls(
                path.parent,
                path.name,
                path.parent / f"{path.name}.{MANIFEST_FILE}",
                path.parent / f"{path.name}.{SIGNATURE_FILE}",
            )
        raise ArtifactError(f"{path}: no such file or directory")

    def names(self) -> list[str]:
        """The artifact's files, relative to `root` in POSIX form, sorted; the manifest and the
        signature themselves excluded."""
        if self.single_file is not None:
            return [self.single_file]
        excluded = {self.manifest_path, self.signature_path}
        names = []
        for path in self.root.rglob("*"):
            relative = path.relative_to(self.root)
            # A symbolic link counts as the file it points to (a Hugging Face cache snapshot is
            # links into its blob store): its content is what is hashed and loaded.
            if relative.parts[0] in _IGNORED_NAMES or path in excluded or path.is_dir():
                continue
            names.append(relative.as_posix())
        return sorted(names)

    def pickle_files(self) -> list[str]:
        names = self.names()
        return [n for n in names if any(Path(n).match(pattern) for pattern in PICKLE_PATTERNS)]

    def digests(self, algorithm: str = "sha256") -> dict[str, str]:
        return {name: file_digest(self.root / name, algorithm) for name in self.names()}
