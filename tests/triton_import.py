"""Import a module holding Triton kernels for a test, under the CPU interpreter when there is no GPU."""

from __future__ import annotations

import importlib
import os
import sys
from types import ModuleType

import pytest


def import_triton_module(name: str, *, interpret: bool) -> ModuleType:
    """TRITON_INTERPRET is read when functions are decorated with @triton.jit (triton's own
    tl.max, tl.sum, ... included): it must be set before triton is first imported. Skips the
    calling test module when triton is missing, or was already imported without it."""
    if not interpret:
        pytest.importorskip("triton")
        return importlib.import_module(name)
    if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("triton was imported without TRITON_INTERPRET=1 in this process", allow_module_level=True)
    previous = os.environ.get("TRITON_INTERPRET")
    os.environ["TRITON_INTERPRET"] = "1"
    try:
        pytest.importorskip("triton")
        return importlib.import_module(name)
    finally:  # unset again, so that subprocesses of other tests on a GPU machine compile for real
        if previous is None:
            del os.environ["TRITON_INTERPRET"]
        else:
            os.environ["TRITON_INTERPRET"] = previous
