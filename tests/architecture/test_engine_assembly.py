"""The engine core runs what engine/assembly.py builds: its constructor stays a short wiring of
parts, and loading models, starting executors and sizing the KV pool happen in the assembly
(and core/kv_plan.py), not in the core."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE_DIR = Path(__file__).resolve().parents[2] / "pagoda"
ENGINE_CORE = PACKAGE_DIR / "engine" / "engine_core.py"

# What only the assembly reaches: model loading, executors, weight formats and kernels,
# verification, the pool plan.
ASSEMBLY_ONLY = (
    "pagoda.model.loader",
    "pagoda.executor",
    "pagoda.quant.weight_formats",
    "pagoda.native",
    "pagoda.artifacts",
    "pagoda.core.kv_plan",
    "pagoda.spec_decode.draft_proposer",
)


def engine_core_init() -> ast.FunctionDef:
    tree = ast.parse(ENGINE_CORE.read_text())
    core = next(node for node in tree.body if isinstance(node, ast.ClassDef) and node.name == "EngineCore")
    return next(node for node in core.body if isinstance(node, ast.FunctionDef) and node.name == "__init__")


def test_engine_core_init_is_short() -> None:
    init = engine_core_init()
    assert init.end_lineno is not None
    assert init.end_lineno - init.lineno + 1 < 60, "build parts in pagoda/engine/assembly.py"


def test_engine_core_leaves_building_to_the_assembly() -> None:
    imported = [
        node.module or "" for node in ast.walk(ast.parse(ENGINE_CORE.read_text())) if isinstance(node, ast.ImportFrom)
    ]
    wrong = [name for name in imported if name.startswith(ASSEMBLY_ONLY)]
    assert not wrong, f"engine_core imports {wrong}: that belongs in pagoda/engine/assembly.py"
