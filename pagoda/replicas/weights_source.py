"""Where the serving weights came from, kept by the front of a model's engines for the engines it
starts later (a restarted or an added replica), so they serve the weights the others serve and
not the original checkpoint: the directory of the latest update from disk, or the snapshot of the
latest streamed update, which one engine saved as a safetensors checkpoint under a directory of
this front's own (removed when superseded and at shutdown). None before any update: the config's.
"""

from __future__ import annotations

import shutil
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any


class WeightsSource:
    def __init__(self) -> None:
        self.current: str | None = None  # None: the checkpoint the engines were configured with
        self._root: Path | None = None  # this front's snapshots, made on the first streamed update
        self._pending: str | None = None  # the snapshot of a streamed update staged, not yet committed
        self._snapshots = 0

    def next_snapshot(self) -> str:
        """Where the streamed update about to be staged is to be saved (by one engine)."""
        if self._root is None:
            self._root = Path(tempfile.mkdtemp(prefix="pagoda-weights-"))
        self._snapshots += 1
        self._pending = str(self._root / f"update-{self._snapshots}")
        return self._pending

    def committed(self, model_path: str | None = None) -> None:
        """An update serves on every engine now: from `model_path`, else the streamed one whose
        snapshot is pending (a streamed update saved nowhere leaves the source unknown: None)."""
        new, self._pending = model_path if model_path is not None else self._pending, None
        previous, self.current = self.current, new
        if previous is not None and previous != new and self._owns(previous):
            shutil.rmtree(previous, ignore_errors=True)

    def written(self, timeout_s: float, stopped: Callable[[], bool] = lambda: False) -> str | None:
        """The current source, once it is on disk: a streamed update's snapshot is written by its
        engine after the commit (it appears whole, renamed into place). RuntimeError when it is
        not there within `timeout_s` (its engine died before it finished, or its disk failed)."""
        current = self.current
        if current is None or not self._owns(current):
            return current
        deadline = time.monotonic() + timeout_s
        while not Path(current).is_dir():
            if time.monotonic() > deadline or stopped():
                raise RuntimeError(f"the latest weights' snapshot {current} was not written (see the engine's log)")
            time.sleep(0.05)
        return current

    def dropped(self) -> None:
        """The staged update was dropped (the engine that saved its snapshot removed it)."""
        self._pending = None

    def close(self) -> None:
        if self._root is not None:
            shutil.rmtree(self._root, ignore_errors=True)

    def _owns(self, path: str) -> bool:
        return self._root is not None and Path(path).parent == self._root

    def record(self, command: str, args: dict[str, Any]) -> None:
        """What an engine command that every engine accepted changed."""
        if command == "update_weights_from_disk":
            self.committed(str(args["model_path"]))
        elif command == "finish_weight_update":
            if args.get("abort"):
                self.dropped()
            else:
                self.committed()
