"""Files of the disk tier: one file per block, named by the tier (salted hash + fingerprint).

The files hold other users' context: the directory is owner-only (0700) and every file is
created 0600, written under a temporary name and renamed into place, so a crash never leaves
a half-written block under a real name. Each file records the fingerprint and block hash it
was written for; a startup with another fingerprint ignores it.

A full disk (ENOSPC, or a quota: EDQUOT) loses blocks, never requests: the first failure logs one
warning, writing stops (nothing is even attempted, and the tier admits no new blocks) until a
free-space check, at most once a second, finds room for a block again; then one line says how
many blocks were not written. Any other failing write is reported the same way: one warning per
kind of error, one line with the count when writes succeed again.

Format: a 4-byte little-endian header length, a JSON header (fingerprint, block hash, token ids,
payload size), then the block's raw bytes, every cache tensor's slice of it in order (a flat
read, several times cheaper than unpickling tensors).
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shutil
import struct
import time
from collections.abc import Sequence
from pathlib import Path

import torch

from pagoda.core.kv_tiers import disk_file_name

logger = logging.getLogger(__name__)

SUFFIX = ".kv"
SPACE_RECHECK_S = 1.0  # while the disk is full, how often free space is checked
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)


def file_bytes(payload_bytes: int, block_size: int) -> int:
    """Room a block's file takes on disk, its header included (an upper bound)."""
    return payload_bytes + 4 + 256 + 12 * block_size


def _bytes_of(tensor: torch.Tensor):
    """A writable numpy byte view of a contiguous CPU tensor (any dtype, bfloat16 included)."""
    return tensor.view(torch.uint8).reshape(-1).numpy()


def remove_files_written_since(directory: str | Path, since: float) -> int:
    """Delete the block files (and temporaries) in `directory` last written at or after `since`
    (a wall-clock time): the clean-up of an engine that started then and was killed before its
    shutdown could remove them. Returns how many were deleted."""
    removed = 0
    try:
        paths = list(Path(directory).iterdir())
    except OSError:
        return 0
    for path in paths:
        if not (path.name.endswith(SUFFIX) or path.name.endswith(SUFFIX + ".tmp")):
            continue
        try:
            if path.stat().st_mtime >= since:
                path.unlink()
                removed += 1
        except OSError:  # gone meanwhile, or not ours to delete
            continue
    return removed


class DiskStore:
    def __init__(self, directory: str | Path, fingerprint: bytes) -> None:
        self.directory = Path(directory)
        self.fingerprint = fingerprint
        self.directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.directory, 0o700)
        self.written: set[str] = set()  # complete files written by this instance (or adopted at startup)
        self.owned: set[str] = set()  # every name this instance wrote or tried to (removed at shutdown)
        self.full = False  # the last write found no space: writing waits until space returns
        self.failures: dict[str, int] = {}  # kind of error -> blocks not written since it began
        self._file_bytes = 0  # the size of the last file written or tried
        self._next_space_check = 0.0

    def free_bytes(self) -> int:
        return shutil.disk_usage(self.directory).free

    def can_write(self) -> bool:
        """False while the disk is full; space is checked again at most once a second."""
        if not self.full:
            return True
        now = time.monotonic()
        if now < self._next_space_check:
            return False
        self._next_space_check = now + SPACE_RECHECK_S
        try:
            room = self.free_bytes() >= 2 * self._file_bytes
        except OSError:
            return False
        if room:
            self.full = False
        return room

    def _write_file(self, path: Path, header: bytes, payload: Sequence) -> None:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        with os.fdopen(fd, "wb") as f:
            f.write(struct.pack("<I", len(header)) + header)
            for chunk in payload:
                f.write(memoryview(chunk))

    def _lost(self, kind: str, error: OSError | None) -> None:
        """A block not written for `kind` (an errno name): one warning when the condition begins."""
        count = self.failures.get(kind, 0)
        self.failures[kind] = count + 1
        if count or error is None:
            return
        if self.full:
            logger.warning(
                "disk KV tier: no space left in %s (%s); blocks stay off disk until space "
                "returns (outputs are unaffected)",
                self.directory,
                error.strerror or error,
            )
        else:
            logger.warning(
                "disk KV tier: writes to %s fail (%s: %s); those blocks stay off disk (outputs are unaffected)",
                self.directory,
                kind,
                error.strerror or error,
            )

    def _recovered(self) -> None:
        if self.failures:
            lost = ", ".join(f"{count} ({kind})" for kind, count in sorted(self.failures.items()))
            logger.info("disk KV tier: writing to %s again; blocks not written meanwhile: %s", self.directory, lost)
            self.failures.clear()

    def path(self, name: str) -> Path:
        if os.sep in name or not name.endswith(SUFFIX):
            raise ValueError(f"not a disk-tier file name: {name!r}")
        return self.directory / name

    def write(self, name: str, block_hash: bytes, token_ids: Sequence[int], tensors: Sequence[torch.Tensor]) -> None:
        payload = [_bytes_of(t.contiguous()) for t in tensors]
        header = json.dumps(
            {
                "fingerprint": self.fingerprint.hex(),
                "block_hash": block_hash.hex(),
                "token_ids": list(token_ids),
                "payload_bytes": sum(p.nbytes for p in payload),
            }
        ).encode()
        path = self.path(name)
        tmp = path.with_name(path.name + ".tmp")
        self.written.discard(name)  # a rewrite: not readable until it is complete again
        self.owned.add(name)
        self._file_bytes = len(header) + 4 + sum(p.nbytes for p in payload)
        if not self.can_write():
            self._lost(errno.errorcode[errno.ENOSPC], None)
            return
        try:
            self._write_file(tmp, header, payload)
            os.replace(tmp, path)
        except OSError as exc:  # a full or failing disk loses this block, never a request
            tmp.unlink(missing_ok=True)
            if exc.errno in _FULL_ERRNOS:
                self.full = True
                self._next_space_check = time.monotonic() + SPACE_RECHECK_S
            self._lost(
                errno.errorcode[errno.ENOSPC]
                if exc.errno in _FULL_ERRNOS
                else errno.errorcode.get(exc.errno or 0, type(exc).__name__),
                exc,
            )
            return
        self._recovered()
        self.written.add(name)

    def is_written(self, name: str) -> bool:
        return name in self.written

    def read_into(self, name: str, tensors: Sequence[torch.Tensor]) -> None:
        """Fill `tensors` (one host block's slice of every cache tensor) from a file."""
        with open(self.path(name), "rb") as f:
            header = self._header(f)
            if header["fingerprint"] != self.fingerprint.hex():
                raise RuntimeError(f"disk-tier file {name} belongs to another model or config")
            if header["payload_bytes"] != sum(t.numel() * t.element_size() for t in tensors):
                raise RuntimeError(f"disk-tier file {name} holds a block of another layout")
            for tensor in tensors:  # straight into the host block's memory: no staging copy
                target = _bytes_of(tensor)
                if f.readinto(memoryview(target)) != target.nbytes:
                    raise RuntimeError(f"disk-tier file {name} is truncated")

    @staticmethod
    def _header(f) -> dict:
        (length,) = struct.unpack("<I", f.read(4))
        return json.loads(f.read(length))

    def delete(self, name: str) -> None:
        self.written.discard(name)
        self.owned.discard(name)
        try:
            os.unlink(self.path(name))
        except FileNotFoundError:
            pass

    def scan(self) -> list[tuple[str, bytes, tuple[int, ...]]]:
        """Blocks persisted by an earlier instance with this fingerprint, oldest first."""
        found = []
        for path in sorted(self.directory.glob("*" + SUFFIX), key=lambda p: p.stat().st_mtime):
            try:
                with open(path, "rb") as f:
                    data = self._header(f)
            except (OSError, ValueError, struct.error):  # a foreign or damaged file: never ours to reuse
                logger.warning("ignoring unreadable disk-tier file %s", path.name)
                continue
            if not isinstance(data, dict) or data.get("fingerprint") != self.fingerprint.hex():
                continue
            block_hash = bytes.fromhex(data["block_hash"])
            if path.name != disk_file_name(self.fingerprint, block_hash):
                continue  # renamed or copied in: its name does not vouch for its contents
            found.append((path.name, block_hash, tuple(data["token_ids"])))
            self.written.add(path.name)
            self.owned.add(path.name)
        return found

    def remove_all(self) -> None:
        """Delete every file this instance wrote or adopted (clean shutdown without persist)."""
        for name in list(self.owned | self.written):
            self.delete(name)
