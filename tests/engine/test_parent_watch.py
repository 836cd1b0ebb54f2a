"""A child that watches its parent exits when the parent is SIGKILLed, even while busy."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path


def test_busy_child_exits_when_parent_is_killed(tmp_path: Path) -> None:
    pid_file = tmp_path / "child.pid"
    parent = textwrap.dedent(f"""
        import multiprocessing, os, sys, time

        def child(parent_pid):
            from pagoda.engine.parent_watch import exit_when_parent_dies
            exit_when_parent_dies(parent_pid, poll_seconds=0.1)
            open({str(pid_file)!r}, "w").write(str(os.getpid()))
            while True:  # busy, never reads anything
                sum(range(10000))

        if __name__ == "__main__":
            ctx = multiprocessing.get_context("spawn")
            proc = ctx.Process(target=child, args=(os.getpid(),), daemon=True)
            proc.start()
            time.sleep(600)
    """)
    script = tmp_path / "parent.py"
    script.write_text(parent)
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join([str(Path(__file__).resolve().parents[2]), os.environ.get("PYTHONPATH", "")]),
    }
    proc = subprocess.Popen([sys.executable, str(script)], env=env)
    child_pid = None
    try:
        deadline = time.monotonic() + 60
        while not pid_file.exists() or not pid_file.read_text():
            assert time.monotonic() < deadline, "the child never started"
            time.sleep(0.05)
        child_pid = int(pid_file.read_text())
        os.kill(proc.pid, signal.SIGKILL)  # no atexit, no multiprocessing cleanup
        proc.wait(10)
        deadline = time.monotonic() + 10
        while _alive(child_pid):
            assert time.monotonic() < deadline, "the child outlived its parent"
            time.sleep(0.05)
    finally:
        if proc.poll() is None:
            proc.kill()
        if child_pid is not None and _alive(child_pid):
            os.kill(child_pid, signal.SIGKILL)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie is dead for our purpose (its parent, now init, reaps it later).
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().split(")")[-1].split()[0] != "Z"
    except FileNotFoundError:
        return False
