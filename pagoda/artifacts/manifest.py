"""The manifest: every file of an artifact with its digest (SHA-256, or BLAKE3 by choice), plus
the declared source and revision, written as JSON beside the files (`pagoda inspect MODEL
--write-manifest`)."""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

from pagoda.artifacts.digests import HASH_ALGORITHMS, ArtifactError, ArtifactFiles, digests_id

MANIFEST_FORMAT = "pagoda-manifest/1"
_HEX_DIGITS = set("0123456789abcdef")


@dataclass(frozen=True)
class Manifest:
    files: dict[str, str]  # relative POSIX name -> hex digest by `hash`
    source: str | None = None  # where the artifact says it came from (a hub id or URL)
    revision: str | None = None  # the source's commit or tag
    hash: str = field(default="sha256")

    @property
    def digest(self) -> str:
        """The manifest's id: one string naming exactly these files with these contents."""
        return digests_id(self.files)

    def to_json(self) -> str:
        body = {
            "format": MANIFEST_FORMAT,
            "hash": self.hash,
            "source": self.source,
            "revision": self.revision,
            "files": dict(sorted(self.files.items())),
        }
        return json.dumps(body, indent=2) + "\n"


def build_manifest(
    files: ArtifactFiles, source: str | None = None, revision: str | None = None, hash: str = "sha256"
) -> Manifest:
    return Manifest(files.digests(hash), source, revision, hash)


def write_manifest(files: ArtifactFiles, manifest: Manifest) -> Path:
    files.manifest_path.write_text(manifest.to_json())
    return files.manifest_path


def read_manifest(files: ArtifactFiles) -> Manifest:
    """The manifest beside the artifact; ArtifactError naming the file and the field for a
    missing or malformed one."""
    path = files.manifest_path
    if not path.is_file():
        raise ArtifactError(f"{path}: no manifest (write one with `pagoda inspect {files.root} --write-manifest`)")
    try:
        body = json.loads(path.read_text())
    except (ValueError, UnicodeDecodeError) as error:
        raise ArtifactError(f"{path}: malformed manifest, not JSON ({error})") from None
    if not isinstance(body, dict) or body.get("format") != MANIFEST_FORMAT:
        raise ArtifactError(f"{path}: malformed manifest: 'format' must be {MANIFEST_FORMAT!r}")
    algorithm = body.get("hash")
    if algorithm not in HASH_ALGORITHMS:
        raise ArtifactError(
            f"{path}: malformed manifest: 'hash' must be one of {', '.join(HASH_ALGORITHMS)}, got {algorithm!r}"
        )
    listed = body.get("files")
    if not isinstance(listed, dict) or not listed:
        raise ArtifactError(f"{path}: malformed manifest: 'files' must map file names to {algorithm} digests")
    for name, digest in listed.items():
        if not _is_hex_digest(digest):
            raise ArtifactError(f"{path}: malformed manifest: files[{name!r}] is not a {algorithm} hex digest")
        if name.startswith("/") or ".." in Path(name).parts:
            raise ArtifactError(f"{path}: malformed manifest: files[{name!r}] is not a name inside the artifact")
    for key in ("source", "revision"):
        if body.get(key) is not None and not isinstance(body[key], str):
            raise ArtifactError(f"{path}: malformed manifest: {key!r} must be a string")
    return Manifest(dict(listed), body.get("source"), body.get("revision"), algorithm)


def _is_hex_digest(digest: object) -> bool:
    """64 hex digits: a SHA-256 or a (default-length) BLAKE3 digest."""
    return isinstance(digest, str) and len(digest) == 64 and set(digest) <= _HEX_DIGITS
