"""Shared fixtures: tiny random-weight models built once per test session."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).parent))

from model_factory import build_model  # noqa: E402

# Caches pagoda writes (the --max-num-seqs calibration) go to a directory of this run, not the
# user's home; subprocesses inherit it.
os.environ["XDG_CACHE_HOME"] = tempfile.mkdtemp(prefix="pagoda-test-cache-")
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
