"""`pagoda inspect MODEL`: the artifact review (pagoda/artifacts/review.py) as a table, JSON or
Markdown; `--write-manifest` records every file's digest beside the model, `--sign KEY` signs it."""

from __future__ import annotations

import argparse
import sys

from pagoda.artifacts.digests import HASH_ALGORITHMS


def add_parser(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "inspect",
        help="review a model, GGUF file or LoRA adapter; write and sign its manifest",
        description="The artifact review: architecture, parameters, dtype and quantization, context, vocabulary, "
        "tokenizer and chat template digests, generation config, license, source and revision, "
        "KV bytes per token, and the SHA-256 of every file. Refuses pickle files.",
    )
    parser.add_argument(
        "model",
        metavar="MODEL",
        help="model directory, GGUF file, PEFT LoRA adapter directory, or a bundled model's name",
    )
    output = parser.add_mutually_exclusive_group()
    output.add_argument("--json", action="store_true", help="print the review as JSON")
    output.add_argument("--markdown", action="store_true", help="print the review as Markdown tables")
    parser.add_argument(
        "--base", default=None, metavar="MODEL", help="for an adapter: the base model to check its shapes against"
    )
    parser.add_argument(
        "--write-manifest",
        action="store_true",
        help="write every file's SHA-256 to pagoda-manifest.json in the model directory "
        "(MODEL.gguf.pagoda-manifest.json beside a GGUF file)",
    )
    parser.add_argument(
        "--manifest-hash",
        choices=HASH_ALGORITHMS,
        default="sha256",
        help="the manifest's file digests: sha256 (default), or blake3 (several times faster "
        "to check at load on CPUs, where SHA-256 takes longer than reading the weights)",
    )
    parser.add_argument("--source", default=None, help="the declared source recorded in the manifest (a hub id or URL)")
    parser.add_argument("--revision", default=None, help="the source's revision recorded in the manifest")
    parser.add_argument(
        "--sign",
        default=None,
        metavar="KEY",
        help="sign the manifest with this PEM elliptic-curve private key (model-signing's bundle, "
        "model.sig); implies --write-manifest",
    )
    parser.add_argument(
        "--signing-certificate",
        default=None,
        metavar="CERT",
        help="with --sign: the key's PEM certificate, for certificate-mode signatures",
    )
    parser.add_argument(
        "--certificate-chain",
        nargs="+",
        default=[],
        metavar="PEM",
        help="with --signing-certificate: the issuing certificates up to the root CA",
    )
    parser.set_defaults(func=run_inspect)


def run_inspect(args: argparse.Namespace) -> int:
    from pagoda.artifacts.digests import ArtifactFiles
    from pagoda.artifacts.manifest import Manifest, build_manifest, write_manifest
    from pagoda.artifacts.review import render_json, render_markdown, render_table, review_artifact
    from pagoda.artifacts.signature import sign_manifest
    from pagoda.config import resolve_model_path
    from pagoda.model.families.base import gguf_config

    if args.signing_certificate is not None and (args.sign is None or not args.certificate_chain):
        print(
            "pagoda inspect: error: --signing-certificate needs --sign KEY and --certificate-chain PEM...",
            file=sys.stderr,
        )
        return 2
    model = resolve_model_path(args.model)
    try:
        review = review_artifact(model, args.base, gguf_config=gguf_config)
        written = []
        if args.write_manifest or args.sign is not None:
            files = ArtifactFiles.of(model)
            if args.manifest_hash == "sha256":  # the review hashed every file already
                manifest = Manifest({f.name: f.sha256 for f in review.files}, args.source, args.revision)
            else:
                manifest = build_manifest(files, args.source, args.revision, hash=args.manifest_hash)
            if args.sign is not None:  # first: a key that cannot sign leaves nothing written
                written.append(
                    sign_manifest(files, manifest, args.sign, args.signing_certificate, args.certificate_chain)
                )
            written.append(write_manifest(files, manifest))
            review = review_artifact(model, args.base, gguf_config=gguf_config)
    except ValueError as error:
        print(f"pagoda inspect: error: {error}", file=sys.stderr)
        return 1
    print(render_json(review) if args.json else render_markdown(review) if args.markdown else render_table(review))
    for path in written:
        print(f"wrote {path}", file=sys.stderr)
    return 0
