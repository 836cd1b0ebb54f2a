"""The `mp` backend: tensor-parallel ranks 1..N-1 as local child processes.

Started with subprocess (a fresh interpreter running this module, the WorkerSpec on its stdin
as one length-prefixed msgpack message, pagoda.executor.channel: never a pickle) rather than multiprocessing: the
engine core often runs in a daemonic process
(pagoda serve's engine process), and multiprocessing forbids daemonic processes children.

A worker ignores SIGINT/SIGTERM like the engine process (a terminal's Ctrl-C reaches the whole
process group while the server drains); it ends on rank 0's stop message, when rank 0 kills
it, or when rank 0's process dies however it died: its stdin pipe, which rank 0 holds open for
the worker's lifetime, reaches end of file (and a collective in flight fails on the closed
socket), so no worker outlives its engine, not even one still loading its shards.
"""

from __future__ import annotations

import logging
import os
import signal
import struct
import subprocess
import sys
import threading
from collections.abc import Callable
from pathlib import Path
from typing import BinaryIO

from pagoda.executor.channel import MAX_MESSAGE_BYTES, decode, encode
from pagoda.executor.worker import WorkerSpec

logger = logging.getLogger(__name__)

_SPEC_LENGTH = struct.Struct(">I")  # the spec's byte count, before it on the worker's stdin

# rank, why -> None: called once, from a watcher thread, when a worker exits unexpectedly.
OnWorkerExit = Callable[[int, str], None]


def worker_command() -> list[str]:
    """The command line of a worker process (it reads its WorkerSpec from stdin)."""
    return [sys.executable, "-m", "pagoda.executor.process_workers"]


class ProcessWorkers:
    def __init__(self, specs: list[WorkerSpec]) -> None:
        env = dict(os.environ)
        # The child imports this very pagoda, wherever it was imported from.
        root = str(Path(__file__).resolve().parents[2])
        env["PYTHONPATH"] = os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p)
        self.ranks = [spec.rank for spec in specs]
        self.titles = [spec.title for spec in specs]
        self.processes: list[subprocess.Popen] = []
        for spec in specs:
            process = subprocess.Popen(worker_command(), stdin=subprocess.PIPE, env=env)
            assert process.stdin is not None
            try:
                process.stdin.write(spec_frame(spec))
                process.stdin.flush()  # kept open: the worker's lifeline (see the module docstring)
            except BrokenPipeError:
                pass  # it died at once: watch() reports its exit code
            self.processes.append(process)
        self._stopping = threading.Event()

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    def watch(self, on_exit: OnWorkerExit) -> None:
        """Report the first worker that exits before `stop` (one thread per worker)."""

        def wait(rank: int, title: str, process: subprocess.Popen) -> None:
            code = process.wait()
            if not self._stopping.is_set():
                on_exit(rank, f"{title} (pid {process.pid}) exited with code {code}")

        for rank, title, process in zip(self.ranks, self.titles, self.processes):
            threading.Thread(
                target=wait, args=(rank, title, process), name=f"pagoda-tp-watch-{rank}", daemon=True
            ).start()

    def stop(self, timeout: float) -> None:
        """Wait for the workers to leave after the stop message; kill the ones that do not."""
        self._stopping.set()
        for process in self.processes:
            try:
                process.wait(timeout)
            except subprocess.TimeoutExpired:
                process.kill()
                process.wait()
            _close(process)

    def kill(self) -> None:
        self._stopping.set()
        for process in self.processes:
            if process.poll() is None:
                process.kill()
                process.wait()
            _close(process)


def _close(process: subprocess.Popen) -> None:
    assert process.stdin is not None, "every worker is started with stdin=PIPE"
    try:
        process.stdin.close()
    except OSError:  # the pipe was already broken
        pass


def spec_frame(spec: WorkerSpec) -> bytes:
    """The spec as a worker reads it from its stdin."""
    body = encode(spec)
    return _SPEC_LENGTH.pack(len(body)) + body


def read_spec(stream: BinaryIO) -> WorkerSpec:
    """The spec the worker's stdin starts with; ValueError when it holds anything else."""
    header = stream.read(_SPEC_LENGTH.size)
    if len(header) < _SPEC_LENGTH.size:
        raise ValueError("no worker spec on stdin")
    (size,) = _SPEC_LENGTH.unpack(header)
    if size > MAX_MESSAGE_BYTES:
        raise ValueError(f"a worker spec of {size} bytes is not one")
    body = stream.read(size)
    if len(body) < size:
        raise ValueError(f"the worker spec ended after {len(body)} of {size} bytes")
    return decode(body, WorkerSpec)


def _exit_when_stdin_closes() -> None:
    sys.stdin.buffer.read()  # returns at end of file: rank 0's process is gone or gave up on us
    os._exit(1)


def main() -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        spec = read_spec(sys.stdin.buffer)  # one message; the pipe stays open
    except ValueError as error:
        logging.basicConfig(level=logging.INFO, format="%(asctime)s tp-worker %(levelname)s %(message)s")
        logger.error("worker refused its spec: %s", error)
        sys.exit(2)
    threading.Thread(target=_exit_when_stdin_closes, name="pagoda-tp-lifeline", daemon=True).start()
    label = f"pp-stage-{spec.stage.index}" if spec.stage is not None else f"tp-rank-{spec.rank}"
    if spec.stage is not None and spec.stage_ranks > 1:
        label += f"-tp-{spec.rank % spec.stage_ranks}"
    logging.basicConfig(level=logging.INFO, format=f"%(asctime)s {label} %(levelname)s %(message)s")
    from pagoda.executor.worker import run_worker

    try:
        run_worker(spec)
    except RuntimeError as error:  # rank 0 went away mid-collective, or a load failed
        logger.error("%s stopped: %s", spec.title, str(error).splitlines()[0])
        sys.exit(1)
    # Not a normal interpreter exit: the lifeline thread is blocked reading stdin, and
    # finalizing around it aborts ("could not acquire lock ... at interpreter shutdown").
    logging.shutdown()
    os._exit(0)


if __name__ == "__main__":
    main()
