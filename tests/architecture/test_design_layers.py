"""docs/DESIGN.md's import-layer picture names the units of LAYERS, in the same order."""

from __future__ import annotations

import re
from pathlib import Path

from test_import_layers import LAYERS

DESIGN = Path(__file__).resolve().parents[2] / "docs" / "DESIGN.md"


def test_the_design_picture_lists_the_layers() -> None:
    section = DESIGN.read_text().split("## Import layers", 1)[1]
    picture = re.search(r"```\n(.*?)```", section, re.S).group(1)
    layers = [
        tuple(u.strip().removesuffix(" (front)") for u in layer.split(","))
        for layer in " ".join(picture.split()).split("←")
    ]
    assert layers == LAYERS
