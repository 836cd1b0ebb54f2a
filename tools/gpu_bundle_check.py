"""Check that a folder of wheels plus a machine's list of installed packages meet every
requirement of every wheel and of pyproject.toml, for CPython 3.12 on Linux x86_64.

    python tools/gpu_bundle_check.py .whl tools/gpu_preinstalled.txt pyproject.toml

Names only, not versions: the machine's list carries no versions (its few known ones are in the
list's header). Optional requirements (extras) are skipped."""

from __future__ import annotations

import re
import sys
import zipfile
from pathlib import Path

import tomllib
from packaging.markers import default_environment
from packaging.requirements import Requirement

TARGET = {
    **default_environment(),
    "python_version": "3.12",
    "python_full_version": "3.12.3",
    "implementation_name": "cpython",
    "platform_python_implementation": "CPython",
    "sys_platform": "linux",
    "platform_system": "Linux",
    "platform_machine": "x86_64",
    "os_name": "posix",
}


def normalize(name: str) -> str:
    return re.sub(r"[-_.]+", "-", name).lower()


def wheel_requirements(wheel: Path) -> tuple[str, list[str]]:
    with zipfile.ZipFile(wheel) as archive:
        metadata = next(n for n in archive.namelist() if n.endswith(".dist-info/METADATA"))
        lines = archive.read(metadata).decode().splitlines()
    name = next(line.split(":", 1)[1].strip() for line in lines if line.startswith("Name:"))
    return name, [line.split(":", 1)[1].strip() for line in lines if line.startswith("Requires-Dist:")]


def needed(requirement: str) -> str | None:
    """The requirement's name if the target needs it (no extra asked for), else None."""
    parsed = Requirement(requirement)
    if parsed.marker is not None and not parsed.marker.evaluate({**TARGET, "extra": ""}):
        return None
    return normalize(parsed.name)


def main(folder: str, installed_list: str, pyproject: str) -> int:
    installed = {
        normalize(line.strip())
        for line in Path(installed_list).read_text().splitlines()
        if line.strip() and not line.startswith("#")
    }
    bundle: dict[str, list[str]] = {}
    for wheel in sorted(Path(folder).glob("*.whl")):
        name, requirements = wheel_requirements(wheel)
        bundle[normalize(name)] = requirements
    project = tomllib.loads(Path(pyproject).read_text())["project"]["dependencies"]
    # pagoda.artifacts imports these only to make or check a signature: not on the GPU path.
    lazy = {"model-signing", "pyopenssl"}
    unmet = []
    for owner, requirements in [("pyproject.toml", project), *bundle.items()]:
        for requirement in requirements:
            name = needed(requirement)
            if name is None or name in bundle or name in installed or (owner == "pyproject.toml" and name in lazy):
                continue
            unmet.append(f"{owner}: {requirement}")
    duplicates = len(list(Path(folder).glob("*.whl"))) - len(bundle)
    if duplicates:
        print(f"{duplicates} wheel(s) of a name already bundled", file=sys.stderr)
    for line in unmet:
        print(f"unmet: {line}", file=sys.stderr)
    if unmet or duplicates:
        return 1
    print(
        f"requirements met: {len(bundle)} wheels + {len(installed)} packages on the machine "
        f"(not bundled, imported lazily: {', '.join(sorted(lazy))})"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main(*sys.argv[1:]))
