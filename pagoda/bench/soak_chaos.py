"""The faults and the watchers of `pagoda bench soak`: a chaos thread that SIGKILLs a replica's
engine on a schedule and fills the disk KV tier's file system, a /health prober in its own process
(so the load generator's event loop and GIL never show up in its latencies), and RSS from /proc."""

from __future__ import annotations

import errno
import json
import multiprocessing
import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx

FILLER_NAME = "soak-filler.bin"
FILL_CHUNK_BYTES = 64 * 1024


def rss_bytes(pid: int) -> int | None:
    """Resident set size of a live process (VmRSS), None when it is gone."""
    try:
        for line in Path(f"/proc/{pid}/status").read_text().splitlines():
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        return None
    return None


@dataclass
class KillEvent:
    """One SIGKILL: whom, when (seconds since the soak began), and when it served again."""

    replica: str
    pid: int
    at_s: float
    recovered_after_s: float | None = None  # None: not back within the wait
    new_pid: int | None = None


@dataclass
class DiskFillEvent:
    """The disk tier's file system filled with a filler file, then freed."""

    directory: str
    at_s: float
    bytes_written: int = 0
    reached_enospc: bool = False
    freed_at_s: float | None = None
    error: str | None = None


@dataclass
class ChaosPlan:
    url: str
    kill_every_s: float
    duration_s: float
    recovery_wait_s: float  # how long to wait for a killed replica before giving up on it
    disk_dir: str | None = None  # the disk tier's directory (None: no disk fill)
    fill_limit_bytes: int | None = None  # cap of the filler when the file system is not a small tmpfs
    fill_at_s: float = 0.0  # when the disk is filled (seconds into the soak)
    fill_for_s: float = 0.0  # how long it stays full
    headers: dict[str, str] = field(default_factory=dict)


class ChaosThread(threading.Thread):
    """Kills a live replica every `kill_every_s` (alternating between them) and watches it come
    back with a new pid; fills the disk tier's file system at `fill_at_s` and frees it
    `fill_for_s` later. Records every event and the machine's load average every few seconds."""

    def __init__(self, plan: ChaosPlan, started: float) -> None:
        super().__init__(name="soak-chaos", daemon=True)
        self.plan = plan
        self.started = started
        self.finishing = threading.Event()
        self.kills: list[KillEvent] = []
        self.fills: list[DiskFillEvent] = []
        self.load_samples: list[tuple[float, float]] = []  # (seconds, 1-minute load average)
        self.errors: list[str] = []

    def finish(self) -> None:
        """No new fault; a kill in progress still waits for its replica, and the disk is freed."""
        self.finishing.set()

    def elapsed(self) -> float:
        return time.monotonic() - self.started

    def run(self) -> None:
        plan = self.plan
        kill_times = [
            k * plan.kill_every_s
            for k in range(1, int(plan.duration_s // plan.kill_every_s) + 1)
            if k * plan.kill_every_s < plan.duration_s
        ]
        fill_at = plan.fill_at_s if plan.disk_dir else None
        free_at = None if fill_at is None else fill_at + plan.fill_for_s
        next_load = 0.0
        pending: KillEvent | None = None  # killed, not back yet
        with httpx.Client(base_url=plan.url, timeout=10.0, trust_env=False, headers=plan.headers) as client:
            while not (self.finishing.is_set() and pending is None):
                now = self.elapsed()
                if now >= next_load:
                    self.load_samples.append((round(now, 1), os.getloadavg()[0]))
                    next_load = now + 5.0
                if pending is not None and self._back(client, pending):
                    pending = None
                if self.finishing.is_set():
                    time.sleep(0.1)
                    continue
                if fill_at is not None and plan.disk_dir and now >= fill_at:
                    fill_at = None
                    self.fills.append(self._fill(plan.disk_dir, plan.fill_limit_bytes))
                if free_at is not None and self.fills and now >= free_at:
                    free_at = None
                    self._free()
                # One replica down at a time: a kill falls due only once the last one is back.
                if kill_times and now >= kill_times[0] and pending is None:
                    kill_times.pop(0)
                    pending = self._kill_one(client)
                self.finishing.wait(0.1)
        if free_at is not None and self.fills:
            self._free()

    def _kill_one(self, client: httpx.Client) -> KillEvent | None:
        try:
            replicas = engines_of(client.get("/health").json())
        except (httpx.HTTPError, ValueError) as e:
            self.errors.append(f"{self.elapsed():.1f}s: /health unreadable before a kill: {e!r}")
            return None
        live = [r for r in replicas if r.get("alive") and r.get("pid")]
        if not live:
            self.errors.append(f"{self.elapsed():.1f}s: no live replica to kill")
            return None
        victim = live[len(self.kills) % len(live)]
        event = KillEvent(replica=str(victim["replica"]), pid=int(victim["pid"]), at_s=round(self.elapsed(), 3))
        try:
            os.kill(event.pid, signal.SIGKILL)
        except OSError as e:
            self.errors.append(f"{event.at_s:.1f}s: SIGKILL of {event.pid} failed: {e}")
            return None
        self.kills.append(event)
        return event

    def _back(self, client: httpx.Client, event: KillEvent) -> bool:
        """Whether the killed replica serves again (alive, ok, a new pid), or was waited for long
        enough (then it stays unrecovered in the record)."""
        try:
            entry = next(
                (r for r in engines_of(client.get("/health").json()) if str(r.get("replica")) == event.replica), None
            )
        except (httpx.HTTPError, ValueError):
            entry = None
        if entry and entry.get("alive") and entry.get("status") == "ok" and entry.get("pid") != event.pid:
            event.recovered_after_s = round(self.elapsed() - event.at_s, 3)
            event.new_pid = entry.get("pid")
            return True
        if self.elapsed() - event.at_s > self.plan.recovery_wait_s:
            self.errors.append(
                f"replica {event.replica} not back {self.plan.recovery_wait_s:g}s after its kill (/health: {entry})"
            )
            return True
        return False

    def _fill(self, directory: str, limit: int | None) -> DiskFillEvent:
        event = DiskFillEvent(directory=directory, at_s=round(self.elapsed(), 1))
        chunk = b"\0" * FILL_CHUNK_BYTES
        try:
            with open(Path(directory) / FILLER_NAME, "wb") as f:
                while limit is None or event.bytes_written < limit:
                    f.write(chunk)
                    f.flush()
                    event.bytes_written += len(chunk)
        except OSError as e:
            if e.errno in (errno.ENOSPC, errno.EDQUOT):
                event.reached_enospc = True
            else:
                event.error = repr(e)
        return event

    def _free(self) -> None:
        try:
            (Path(self.fills[-1].directory) / FILLER_NAME).unlink(missing_ok=True)
            self.fills[-1].freed_at_s = round(self.elapsed(), 1)
        except OSError as e:
            self.fills[-1].error = repr(e)


def engines_of(health: dict[str, Any]) -> list[dict[str, Any]]:
    """The engines a /health body lists: its replicas, or the one engine of a DP=1 server."""
    if "replicas" in health:
        return list(health["replicas"] or [])
    return [{"replica": "engine", **health}] if health.get("pid") else []


def _probe_health(url: str, interval_s: float, timeout_s: float, stop: Any, results: Any) -> None:
    """In a child process: GET /health every `interval_s`; sends [(seconds, latency_s, status)]
    (status 0: no answer within `timeout_s`) through `results` once `stop` is set."""
    samples: list[tuple[float, float, int]] = []
    started = time.monotonic()
    with httpx.Client(timeout=timeout_s, trust_env=False) as client:
        while not stop.is_set():
            begin = time.monotonic()
            try:
                status = client.get(url + "/health").status_code
            except httpx.HTTPError:
                status = 0
            end = time.monotonic()
            samples.append((round(begin - started, 3), end - begin, status))
            stop.wait(max(0.0, interval_s - (end - begin)))
    results.send_bytes(json.dumps(samples).encode())  # JSON, as every internal channel: never a pickle
    results.close()


class HealthProber:
    """The /health prober's child process (spawned: nothing of the parent's threads inherited)."""

    def __init__(self, url: str, interval_s: float = 0.1, timeout_s: float = 5.0) -> None:
        context = multiprocessing.get_context("spawn")
        self._stop = context.Event()
        self._receive, send = context.Pipe(duplex=False)
        self._process = context.Process(
            target=_probe_health, name="soak-health", args=(url, interval_s, timeout_s, self._stop, send), daemon=True
        )
        self._process.start()
        send.close()

    def stop(self) -> list[tuple[float, float, int]]:
        self._stop.set()
        samples = (
            [(float(at), float(took), int(status)) for at, took, status in json.loads(self._receive.recv_bytes())]
            if self._receive.poll(30)
            else []
        )
        self._process.join(10)
        return samples
