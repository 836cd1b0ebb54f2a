"""The kernel seam: which implementation of an op runs (pagoda's native CPU kernels, PyTorch's
ops, the Triton kernels) is chosen in pagoda/kernels and nowhere else (docs/DESIGN.md, "Kernels").

Outside kernels/: no module imports pagoda.native or a Triton kernel module (cli/ reaches the
native build's version line through kernels too), no code asks an object for its native kernels
(`getattr(x, "native"...)`, `x.native`), and the layers (model/, lora/) do not branch on the
device: they call `kernels.<op>` and never ask which implementation runs.
"""

from __future__ import annotations

import ast
from pathlib import Path

from test_import_layers import PACKAGE_DIR, imported_names, module_names, unit_of

KERNELS = "pagoda.kernels"
# Units whose code computes a layer's output: a device test there would be a kernel choice.
LAYER_UNITS = ("model", "lora")


def outside_kernels() -> dict[str, Path]:
    return {
        module: path
        for module, path in module_names().items()
        if module != KERNELS
        and not module.startswith(KERNELS + ".")
        and module != "pagoda.native"
        and not module.startswith("pagoda.native.")
    }


def test_native_and_triton_modules_are_imported_only_by_kernels() -> None:
    wrong = []
    for module, path in outside_kernels().items():
        for name, line in imported_names(module, path):
            if (
                name == "pagoda.native"
                or name.startswith("pagoda.native.")
                or name == "pagoda.kernels.triton"
                or name.startswith("pagoda.kernels.triton.")
                or name.split(".")[0] == "triton"
            ):
                wrong.append(f"{module}:{line} imports {name}")
    assert wrong == []


def test_nothing_outside_kernels_asks_for_native_kernels() -> None:
    wrong = []
    for module, path in outside_kernels().items():
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Name)
                and node.func.id in ("getattr", "hasattr")
                and len(node.args) >= 2
                and isinstance(node.args[1], ast.Constant)
                and node.args[1].value == "native"
            ):
                wrong.append(f"{module}:{node.lineno} {node.func.id}(..., 'native')")
            elif isinstance(node, ast.Attribute) and node.attr == "native":
                wrong.append(f"{module}:{node.lineno} .native")
    assert wrong == []


def test_layers_do_not_branch_on_the_device() -> None:
    wrong = []
    for module, path in outside_kernels().items():
        if unit_of(module) not in LAYER_UNITS:
            continue
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Attribute) and (
                node.attr == "is_cuda"
                or (node.attr == "type" and isinstance(node.value, ast.Attribute) and node.value.attr == "device")
            ):
                wrong.append(f"{module}:{node.lineno} {ast.unparse(node)}")
    assert wrong == []


def test_every_triton_kernel_lives_in_kernels_triton() -> None:
    """A module that imports triton is under pagoda/kernels/triton (and nothing else is there)."""
    triton_dir = PACKAGE_DIR / "kernels" / "triton"
    importers = set()
    for module, path in module_names().items():
        if any(name.split(".")[0] == "triton" for name, _ in imported_names(module, path)):
            importers.add(path)
    assert importers and all(path.parent == triton_dir for path in importers)
    assert {path for path in triton_dir.glob("*.py") if path.name != "__init__.py"} == importers


def test_the_check_sees_the_seam() -> None:
    # Guard against a parser that silently finds nothing: the seam's own edges must be there.
    names = {name for name, _ in imported_names("pagoda.kernels", PACKAGE_DIR / "kernels" / "__init__.py")}
    assert "pagoda.native" in names
    names = {name for name, _ in imported_names("pagoda.model.layers", PACKAGE_DIR / "model" / "layers.py")}
    assert "pagoda.kernels" in names
