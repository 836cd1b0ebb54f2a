"""The Batch API's store: file records, batches and each batch line's result in one SQLite
database (--batch-store PATH), the files' bytes in a directory beside it (PATH.files/).

Every line's result is committed as it comes back, so a server killed mid-batch loses at most
the lines in flight: on restart the runner runs only the lines without a result. A batch is kept
as its answer body (protocol.BatchObject as JSON; its completed and failed counts are counted
from the results); files and batches belong to the tenant that created them and every read names that
tenant, so no tenant reaches another's. `BatchStore.memory()` keeps the database in memory and
the bytes in a temporary directory (a server built without a store path, e.g. in tests).

Thread-safe (one connection behind a lock): the routes use it on the event loop, file bytes
are written and read on worker threads.
"""

from __future__ import annotations

import json
import os
import sqlite3
import tempfile
import threading
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pagoda.serve.batches.protocol import ACTIVE_STATUSES, BatchObject, BatchRequestCounts, FileObject

_SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    id TEXT PRIMARY KEY, tenant TEXT NOT NULL, status TEXT NOT NULL, body TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS results (
    batch_id TEXT NOT NULL, line INTEGER NOT NULL, failed INTEGER NOT NULL, record TEXT NOT NULL,
    PRIMARY KEY (batch_id, line));
"""


@dataclass(frozen=True)
class LineResult:
    """One batch line's outcome: its record in the output file (failed: the error file)."""

    line: int
    failed: bool
    record: dict[str, Any]


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:24]}" if prefix == "file" else f"{prefix}_{uuid.uuid4().hex[:24]}"


class BatchStore:
    def __init__(
        self, database: str, files_dir: Path, temporary: tempfile.TemporaryDirectory[str] | None = None
    ) -> None:
        self.files_dir = files_dir
        self._temporary = temporary  # memory(): removed with the store
        files_dir.mkdir(parents=True, exist_ok=True)
        self._lock = threading.Lock()
        self._db = sqlite3.connect(database, check_same_thread=False, isolation_level=None)
        if database != ":memory:":
            self._db.execute("PRAGMA journal_mode=WAL")  # a commit per line costs no full sync
            self._db.execute("PRAGMA synchronous=NORMAL")
        self._db.executescript(_SCHEMA)

    @classmethod
    def open(cls, path: str | os.PathLike[str]) -> BatchStore:
        """The store at `path` (created with its directory when missing)."""
        database = Path(path)
        database.parent.mkdir(parents=True, exist_ok=True)
        return cls(str(database), database.with_name(database.name + ".files"))

    @classmethod
    def memory(cls) -> BatchStore:
        temporary = tempfile.TemporaryDirectory(prefix="pagoda-batch-files-")
        return cls(":memory:", Path(temporary.name), temporary)

    def close(self) -> None:
        with self._lock:
            self._db.close()
        if self._temporary is not None:
            self._temporary.cleanup()

    # ---- files ----

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def add_file(self, tenant: str, file: FileObject, content: bytes) -> None:
        """Write the bytes first: a record never names a file that is not there."""
        path = self.file_path(file.id)
        partial = path.with_suffix(".partial")
        partial.write_bytes(content)
        partial.replace(path)
        with self._lock:
            self._db.execute("INSERT INTO files VALUES (?, ?, ?)", (file.id, tenant, file.model_dump_json()))

    def file(self, tenant: str, file_id: str) -> FileObject | None:
        with self._lock:
            row = self._db.execute("SELECT body FROM files WHERE id = ? AND tenant = ?", (file_id, tenant)).fetchone()
        return FileObject.model_validate_json(row[0]) if row else None

    def files(self, tenant: str, purpose: str | None = None) -> list[FileObject]:
        """The tenant's files, newest first."""
        with self._lock:
            rows = self._db.execute("SELECT body FROM files WHERE tenant = ? ORDER BY rowid DESC", (tenant,)).fetchall()
        found = [FileObject.model_validate_json(row[0]) for row in rows]
        return [f for f in found if purpose is None or f.purpose == purpose]

    def tenant_bytes(self, tenant: str) -> int:
        return sum(f.bytes for f in self.files(tenant))

    def delete_file(self, tenant: str, file_id: str) -> bool:
        with self._lock:
            deleted = self._db.execute("DELETE FROM files WHERE id = ? AND tenant = ?", (file_id, tenant)).rowcount
        if deleted:
            self.file_path(file_id).unlink(missing_ok=True)
        return bool(deleted)

    # ---- batches ----

    def put_batch(self, tenant: str, batch: BatchObject) -> None:
        """Insert or update the batch (its completed and failed counts are the results')."""
        body = batch.model_dump_json()
        with self._lock:
            self._db.execute(
                "INSERT INTO batches VALUES (?, ?, ?, ?) ON CONFLICT(id) DO UPDATE SET "
                "status = excluded.status, body = excluded.body",
                (batch.id, tenant, batch.status, body),
            )

    def batch(self, tenant: str, batch_id: str) -> BatchObject | None:
        with self._lock:
            row = self._db.execute(
                "SELECT body FROM batches WHERE id = ? AND tenant = ?", (batch_id, tenant)
            ).fetchone()
        return self._with_counts(row[0]) if row else None

    def batches(self, tenant: str) -> list[BatchObject]:
        """The tenant's batches, newest first."""
        with self._lock:
            rows = self._db.execute(
                "SELECT body FROM batches WHERE tenant = ? ORDER BY rowid DESC", (tenant,)
            ).fetchall()
        return [self._with_counts(row[0]) for row in rows]

    def active_batches(self) -> list[tuple[str, BatchObject]]:
        """(tenant, batch) of every batch the runner has work in, oldest first."""
        marks = ",".join("?" * len(ACTIVE_STATUSES))
        with self._lock:
            rows = self._db.execute(
                f"SELECT tenant, body FROM batches WHERE status IN ({marks}) ORDER BY rowid", ACTIVE_STATUSES
            ).fetchall()
        return [(tenant, self._with_counts(body)) for tenant, body in rows]

    def _with_counts(self, body: str) -> BatchObject:
        batch = BatchObject.model_validate_json(body)
        total = batch.request_counts.total
        with self._lock:
            completed, failed = self._db.execute(
                "SELECT COUNT(*) - COALESCE(SUM(failed), 0), COALESCE(SUM(failed), 0) FROM results WHERE batch_id = ?",
                (batch.id,),
            ).fetchone()
        batch.request_counts = BatchRequestCounts(total=total, completed=completed, failed=failed)
        return batch

    # ---- results ----

    def add_result(self, batch_id: str, result: LineResult) -> None:
        with self._lock:
            self._db.execute(
                "INSERT OR REPLACE INTO results VALUES (?, ?, ?, ?)",
                (batch_id, result.line, int(result.failed), json.dumps(result.record)),
            )

    def done_lines(self, batch_id: str) -> set[int]:
        with self._lock:
            rows = self._db.execute("SELECT line FROM results WHERE batch_id = ?", (batch_id,)).fetchall()
        return {row[0] for row in rows}

    def results(self, batch_id: str) -> Iterator[LineResult]:
        """The batch's results in line order."""
        with self._lock:
            rows = self._db.execute(
                "SELECT line, failed, record FROM results WHERE batch_id = ? ORDER BY line", (batch_id,)
            ).fetchall()
        for line, failed, record in rows:
            yield LineResult(line, bool(failed), json.loads(record))
