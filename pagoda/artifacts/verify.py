"""The check at load: every file of the artifact against its manifest (or its signature), hashed
on a thread while the loader reads the weights, so that the check costs little beyond the load."""

from __future__ import annotations

import threading
from dataclasses import dataclass
from pathlib import Path

from pagoda.artifacts.digests import ArtifactError, ArtifactFiles, digests_id, sha256_file
from pagoda.artifacts.manifest import read_manifest
from pagoda.artifacts.signature import signed_digests


@dataclass(frozen=True)
class VerificationPolicy:
    """What a model (or adapter) must prove before it is served."""

    verify_manifest: bool = False  # every file matches the manifest beside it
    verify_key: str | None = None  # a signature by this key (PEM public key or CA certificate) is required

    @property
    def enabled(self) -> bool:
        return self.verify_manifest or self.verify_key is not None


def expected_digests(files: ArtifactFiles, policy: VerificationPolicy) -> dict[str, str]:
    """What the artifact's files must hash to: the signed digests with a key, else the manifest's."""
    if policy.verify_key is not None:
        return signed_digests(files, policy.verify_key)
    return read_manifest(files).files


def compare_digests(files: ArtifactFiles, expected: dict[str, str], actual: dict[str, str]) -> None:
    """ArtifactError naming the first file that differs, is missing or is not listed."""
    for name in sorted(expected):
        if name not in actual:
            raise ArtifactError(f"{files.root / name}: listed in the manifest but missing")
        if actual[name] != expected[name]:
            raise ArtifactError(f"{files.root / name}: SHA-256 {actual[name]} does not match the manifest's "
                                f"{expected[name]} (the file was changed after it was signed)")
    unlisted = sorted(set(actual) - set(expected))
    if unlisted:
        raise ArtifactError(f"{files.root / unlisted[0]}: not in the manifest"
                            + (f" (nor {len(unlisted) - 1} more file(s))" if len(unlisted) > 1 else ""))


def verify_artifact(path: str | Path, policy: VerificationPolicy) -> str:
    """Hash and check now (adapters: small); the manifest's id on success."""
    check = ArtifactCheck(path, policy)
    check.run()
    return check.result()


class ArtifactCheck:
    """Hashes an artifact's files on a thread of its own: `start()` before loading the weights,
    `result()` after, which raises ArtifactError if anything did not match."""

    def __init__(self, path: str | Path, policy: VerificationPolicy) -> None:
        self.files = ArtifactFiles.of(path)
        self.policy = policy
        # The expected digests are read first: a missing or malformed manifest or a bad
        # signature stops the start before a byte of weights is read.
        self.expected = expected_digests(self.files, policy)
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run_guarded, name="pagoda-verify", daemon=True)

    def start(self) -> "ArtifactCheck":
        self._thread.start()
        return self

    def run(self) -> None:
        self._run_guarded()

    def _run_guarded(self) -> None:
        try:
            actual = {name: sha256_file(self.files.root / name) for name in self.files.names()}
            compare_digests(self.files, self.expected, actual)
        except BaseException as error:  # handed to result(), on the loader's thread
            self._error = error

    def result(self) -> str:
        """The manifest's id (the digest of every file's digest) once every file matched."""
        if self._thread.is_alive() or self._thread.ident is not None:
            self._thread.join()
        if self._error is not None:
            if isinstance(self._error, OSError):
                raise ArtifactError(f"{self._error.filename}: unreadable ({self._error.strerror})")
            raise self._error
        return digests_id(self.expected)
