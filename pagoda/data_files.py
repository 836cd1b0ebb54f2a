"""Files of settings users write (price tables, guardrails): YAML, or JSON when the name ends in
`.json`."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any


class DataFileError(ValueError):
    """A settings file that cannot be read or parsed; the message says which (not the path)."""


def read_data_file(path: str | Path) -> Any:
    """The file's parsed contents; DataFileError for an unreadable file or invalid YAML/JSON."""
    try:
        text = Path(path).read_text()
    except OSError as exc:
        raise DataFileError(f"cannot read it: {exc.strerror}") from None
    try:
        if str(path).endswith(".json"):
            return json.loads(text)
        import yaml

        return yaml.safe_load(text)
    except Exception as exc:  # json's ValueError or yaml.YAMLError
        raise DataFileError(f"not valid YAML/JSON: {exc}") from None
