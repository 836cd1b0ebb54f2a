"""What a model artifact is and whether it is the one that was signed: file digests
(digests.py), the review `pagoda inspect` prints (review.py), manifests of every file's digest
(manifest.py), their signatures through OpenSSF model-signing (signature.py), and the check at
load that hashes the files while the loader reads them (verify.py)."""
