"""The check at load: every file of the artifact against its manifest (or its signature), hashed
on threads while the loader reads the weights, so that the check costs little beyond the load."""

from __future__ import annotations

import os
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from pagoda.artifacts.digests import ArtifactError, ArtifactFiles, digests_id, file_digest
from pagoda.artifacts.manifest import read_manifest
from pagoda.artifacts.signature import signed_digests

WEIGHT_SUFFIXES = (".safetensors", ".gguf")
ALGORITHM_NAMES = {"sha256": "SHA-256", "blake3": "BLAKE3"}


@dataclass(frozen=True)
class VerificationPolicy:
    """What a model (or adapter) must prove before it is served."""

    verify_manifest: bool = False  # every file matches the manifest beside it
    verify_key: str | None = None  # a signature by this key (PEM public key or CA certificate) is required

    @property
    def enabled(self) -> bool:
        return self.verify_manifest or self.verify_key is not None


def expected_digests(files: ArtifactFiles, policy: VerificationPolicy) -> tuple[str, dict[str, str]]:
    """The hash algorithm and what the artifact's files must hash to by it: the signed digests
    with a key, else the manifest's."""
    if policy.verify_key is not None:
        return signed_digests(files, policy.verify_key)
    manifest = read_manifest(files)
    return manifest.hash, manifest.files


def compare_digests(
    files: ArtifactFiles, expected: dict[str, str], actual: dict[str, str], algorithm: str = "sha256"
) -> None:
    """ArtifactError naming the first file that differs, is missing or is not listed."""
    for name in sorted(expected):
        if name not in actual:
            raise ArtifactError(f"{files.root / name}: listed in the manifest but missing")
        if actual[name] != expected[name]:
            raise ArtifactError(
                f"{files.root / name}: {ALGORITHM_NAMES[algorithm]} {actual[name]} does not match the manifest's "
                f"{expected[name]} (the file changed after the manifest was made)"
            )
    unlisted = sorted(set(actual) - set(expected))
    if unlisted:
        raise ArtifactError(
            f"{files.root / unlisted[0]}: not in the manifest"
            + (f" (nor {len(unlisted) - 1} more file(s))" if len(unlisted) > 1 else "")
        )


def check_before_load(path: str | Path, policy: VerificationPolicy) -> None:
    """Check every file but the weights now: the ones a server reads before its engine starts
    (config, tokenizer, chat template). The engine checks the weights while it loads them."""
    if policy.enabled:
        ArtifactCheck(path, policy).check_small_files()


def verify_artifact(path: str | Path, policy: VerificationPolicy) -> str:
    """Hash and check now (adapters: small); the manifest's id on success."""
    check = ArtifactCheck(path, policy)
    check.run()
    return check.result()


class ArtifactCheck:
    """`start()` checks the small files (config, tokenizer, template: read before the weights)
    at once, then hashes the weights on threads of their own while the loader reads them;
    `result()` waits for it and raises ArtifactError if anything did not match."""

    def __init__(self, path: str | Path, policy: VerificationPolicy) -> None:
        self.files = ArtifactFiles.of(path)
        # The expected digests are read first: a missing or malformed manifest or a bad
        # signature stops the start before a byte of weights is read.
        self.algorithm, self.expected = expected_digests(self.files, policy)
        self._names = self.files.names()
        self._actual: dict[str, str] = {}
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._hash_weights, name="pagoda-verify", daemon=True)

    def check_small_files(self) -> None:
        small = [n for n in self._names if not n.endswith(WEIGHT_SUFFIXES)]
        self._actual.update((name, self._hash(name)) for name in small)
        compare_digests(
            self.files,
            {n: d for n, d in self.expected.items() if not n.endswith(WEIGHT_SUFFIXES)},
            self._actual,
            self.algorithm,
        )

    def start(self) -> ArtifactCheck:
        self.check_small_files()
        self._thread.start()
        return self

    def run(self) -> None:
        self.check_small_files()
        self._hash_weights()

    def _hash(self, name: str) -> str:
        try:
            return file_digest(self.files.root / name, self.algorithm)
        except OSError as error:
            raise ArtifactError(f"{self.files.root / name}: unreadable ({error.strerror})") from None

    def _hash_weights(self) -> None:
        # One hashing thread per weight file (up to the cores): a sharded checkpoint is checked
        # in the time of its largest shard, not of all of them.
        weights = [name for name in self._names if name.endswith(WEIGHT_SUFFIXES)]
        try:
            with ThreadPoolExecutor(
                max(1, min(len(weights), os.cpu_count() or 1)), thread_name_prefix="pagoda-verify"
            ) as pool:
                self._actual.update(zip(weights, pool.map(self._hash, weights)))
            compare_digests(self.files, self.expected, self._actual, self.algorithm)
        except BaseException as error:  # handed to result(), on the loader's thread
            self._error = error

    def result(self) -> str:
        """The manifest's id (the digest of every file's digest) once every file matched."""
        if self._thread.ident is not None:
            self._thread.join()
        if self._error is not None:
            raise self._error
        return digests_id(self.expected)
