"""Signatures over a manifest's digests with OpenSSF model-signing (offline modes: an
elliptic-curve private key, or a key with its certificate). The signature is model-signing's
own bundle, so `model_signing verify` checks a directory pagoda signed."""

from __future__ import annotations

import pathlib
from collections.abc import Sequence
from pathlib import Path

from pagoda.artifacts.digests import HASH_ALGORITHMS, ArtifactError, ArtifactFiles
from pagoda.artifacts.manifest import Manifest


def sign_manifest(
    files: ArtifactFiles,
    manifest: Manifest,
    private_key: str | Path,
    certificate: str | Path | None = None,
    certificate_chain: Sequence[str | Path] = (),
) -> Path:
    """Write the signature of `manifest`'s digests beside the artifact; with `certificate`, the
    signer's certificate (and its chain) go into the bundle."""
    # model-signing's public API hashes the files again to build what it signs; its signers take
    # any manifest, so the digests already computed are signed as they are.
    sign_ec_key, signing, _ = _model_signing()
    try:
        if certificate is None:
            signer = sign_ec_key.Signer(Path(private_key))
        else:
            signer = _certificate_module().Signer(
                Path(private_key), Path(certificate), [Path(c) for c in certificate_chain]
            )
        signature = signer.sign(signing.Payload(_model_signing_manifest(files, manifest)))
    except (OSError, ValueError, TypeError) as error:
        raise ArtifactError(f"{private_key}: cannot sign with this key ({error})") from None
    signature.write(files.signature_path)
    return files.signature_path


def signed_digests(files: ArtifactFiles, verify_key: str | Path) -> tuple[str, dict[str, str]]:
    """The hash algorithm and the file digests the artifact's signature vouches for, after
    checking it against `verify_key`: a PEM public key (key mode) or a PEM CA certificate
    (certificate mode)."""
    sign_ec_key, _, sign_sigstore_pb = _model_signing()
    path = files.signature_path
    if not path.is_file():
        raise ArtifactError(f"{files.root}: unsigned ({path.name} not found) but a signature is required")
    key_path = Path(verify_key)
    try:
        key_text = key_path.read_bytes()
    except OSError as error:
        raise ArtifactError(f"{key_path}: cannot read the verification key ({error.strerror})") from None
    try:
        verifier = (
            _certificate_module().Verifier([key_path])
            if b"BEGIN CERTIFICATE" in key_text
            else sign_ec_key.Verifier(key_path)
        )
    except (ValueError, TypeError) as error:
        raise ArtifactError(f"{key_path}: not a PEM elliptic-curve public key or CA certificate ({error})") from None
    try:
        signature = sign_sigstore_pb.Signature.read(path)
    except Exception as error:  # the bundle parser raises KeyError, ValueError, betterproto errors
        raise ArtifactError(f"{path}: malformed signature ({type(error).__name__}: {error})") from None
    try:
        signed = verifier.verify(signature)
    except Exception as error:  # cryptography's InvalidSignature, ValueError for a key mismatch
        reason = str(error) or type(error).__name__
        raise ArtifactError(f"{path}: signature does not verify with {key_path} ({reason})") from None
    digests = {}
    algorithms = set()
    for descriptor in signed.resource_descriptors():
        algorithms.add(descriptor.digest.algorithm)
        digests[descriptor.identifier] = descriptor.digest.digest_hex
    if len(algorithms) != 1 or not algorithms <= set(HASH_ALGORITHMS):
        raise ArtifactError(
            f"{path}: signed with {', '.join(sorted(algorithms)) or 'no'} digests; pagoda checks "
            f"one of {', '.join(HASH_ALGORITHMS)}"
        )
    return algorithms.pop(), digests


def _model_signing():
    """model-signing's key-mode signer and verifier, its payload and bundle modules."""
    try:
        from model_signing._signing import sign_ec_key, sign_sigstore_pb, signing
    except ImportError as error:  # its package imports pyOpenSSL without declaring it
        raise ArtifactError(
            f"signatures need the model-signing package and pyOpenSSL (pip install model-signing pyopenssl): {error}"
        ) from None
    return sign_ec_key, signing, sign_sigstore_pb


def _certificate_module():
    """model-signing's certificate mode, which needs pyOpenSSL (key mode does not)."""
    try:
        from model_signing._signing import sign_certificate
    except ImportError as error:
        raise ArtifactError(f"certificate signatures need pyOpenSSL (pip install pyopenssl): {error}") from None
    return sign_certificate


def _model_signing_manifest(files: ArtifactFiles, manifest: Manifest):
    from model_signing import manifest as ms_manifest
    from model_signing._hashing import hashing

    # Bare file names (model-signing records them as strings): the same on every platform's Path.
    ignored = [pathlib.Path(p.name) for p in (files.manifest_path, files.signature_path)]
    # Links are followed when hashing (digests.py), so model-signing's own verifier must too.
    serialization = ms_manifest._FileSerialization(manifest.hash, True, ignored)
    items = [
        ms_manifest.FileManifestItem(
            path=pathlib.PurePosixPath(name), digest=hashing.Digest(manifest.hash, bytes.fromhex(digest))
        )
        for name, digest in sorted(manifest.files.items())
    ]
    return ms_manifest.Manifest(files.root.name, items, serialization)
