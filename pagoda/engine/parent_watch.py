"""Make a child process end when its parent dies, however the parent died.

The engine process is a child of the server. A parent killed by SIGTERM or SIGKILL runs no
atexit hooks, so multiprocessing's cleanup of daemon children never happens, and an engine that
is busy stepping does not read its pipe and so never sees it close: it would keep running,
orphaned, holding all its memory. Two independent guards:
- Linux: prctl(PR_SET_PDEATHSIG, SIGKILL) asks the kernel to kill us the moment the parent
  thread exits.
- Everywhere: a daemon thread polls os.getppid(); a change (reparenting to init or a
  subreaper) means the parent is gone, and the process exits at once.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading

logger = logging.getLogger(__name__)

PR_SET_PDEATHSIG = 1
POLL_SECONDS = 0.5


def exit_when_parent_dies(parent_pid: int, poll_seconds: float = POLL_SECONDS) -> None:
    """Call first thing in the child; `parent_pid` is the pid the parent had when it started us."""
    _set_parent_death_signal()
    if os.getppid() != parent_pid:  # the parent died before we got here
        os._exit(1)
    thread = threading.Thread(
        target=_poll_parent, args=(parent_pid, poll_seconds), name="pagoda-parent-watch", daemon=True
    )
    thread.start()


def _set_parent_death_signal() -> None:
    if not sys.platform.startswith("linux"):
        return
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        if libc.prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0) != 0:
            logger.debug("prctl(PR_SET_PDEATHSIG) failed: errno %d", ctypes.get_errno())
    except OSError:  # no libc to load: the polling thread still guards
        logger.debug("prctl unavailable; relying on the parent-pid poll")


def _poll_parent(parent_pid: int, poll_seconds: float) -> None:
    stop = threading.Event()
    while not stop.wait(poll_seconds):
        if os.getppid() != parent_pid:
            os._exit(1)
