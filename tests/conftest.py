"""Shared fixtures: tiny random-weight models built once per test session."""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from model_factory import build_model  # noqa: E402

# Caches pagoda writes (the --max-num-seqs calibration) go to a directory of this run, not the
# user's home; subprocesses inherit it.
_USER_CACHE = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache")
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="pagoda-test-cache-")


def _seed_native_kernels() -> None:
    """Engines run the native kernels by default (--native-kernels auto): copy the finished build
    `make install` left for these sources (the same pagoda.native.build_key, compiled from this
    checkout: the build's commands name the files) into this run's cache, so a run does not spend
    a minute compiling them again; without one, the first engine builds them."""
    from pagoda import native

    key = native.build_key()
    built = _USER_CACHE / "pagoda" / "kernels" / key
    try:
        same_sources = str(native.SOURCE_DIR) in (built / "build.ninja").read_text()
    except OSError:
        return
    if same_sources and not (built / "lock").exists() and any(built.glob("*.so")):
        shutil.copytree(built, native.cache_dir() / key)


_seed_native_kernels()
# State too (`pagoda serve`'s default --batch-store): servers started by the tests keep none there.
os.environ["XDG_STATE_HOME"] = tempfile.mkdtemp(prefix="pagoda-test-state-")

# Two cores in CI: one intra-op thread keeps tests from fighting each other (MEASURED.md).
torch.set_num_threads(1)


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """One tiny model per supported architecture, keyed by architecture name."""
    root = tmp_path_factory.mktemp("models")
    return {arch: build_model(root / arch, arch) for arch in ("llama", "qwen2", "qwen3", "mistral")}


@pytest.fixture(scope="session")
def llama_dir(model_dirs: dict[str, Path]) -> Path:
    return model_dirs["llama"]
