"""Real tokenizers shipped with the tests: Llama-2 SentencePiece, Llama-3 and Qwen2 byte-level BPE.

`tests/fixtures/tokenizers/NAME/` holds `tokenizer.json.xz` (xz keeps the three at ~3.5 MB
instead of 32 MB) and `tokenizer_config.json` with the chat template. `tokenizer_dir(NAME)`
returns a directory Hugging Face can load, decompressing once per machine into the temp dir
(keyed by the archive's hash, written atomically so parallel test runs can share it).
"""

from __future__ import annotations

import hashlib
import lzma
import os
import shutil
import tempfile
from pathlib import Path

FIXTURES = Path(__file__).parent / "fixtures" / "tokenizers"
NAMES = ("llama2-spm", "llama3-bpe", "qwen2-bpe")


def tokenizer_dir(name: str) -> Path:
    """A loadable tokenizer directory for one of NAMES."""
    source = FIXTURES / name
    archive = source / "tokenizer.json.xz"
    if not archive.is_file():
        raise FileNotFoundError(f"tokenizer fixture {archive} is missing from the checkout")
    digest = hashlib.sha256(archive.read_bytes()).hexdigest()[:16]
    # The directory keeps the fixture's name: tests read it back from `name_or_path`.
    target = Path(tempfile.gettempdir()) / "pagoda-test-tokenizers" / digest / name
    if (target / "tokenizer.json").is_file():
        return target
    target.parent.mkdir(parents=True, exist_ok=True)
    staging = Path(tempfile.mkdtemp(prefix=f".{name}-", dir=target.parent))
    with lzma.open(archive) as compressed, open(staging / "tokenizer.json", "wb") as out:
        shutil.copyfileobj(compressed, out)
    shutil.copy(source / "tokenizer_config.json", staging / "tokenizer_config.json")
    try:
        os.rename(staging, target)
    except OSError:  # another run got there first
        shutil.rmtree(staging, ignore_errors=True)
    return target
