"""The processes a test started: a process's descendants with their command lines, and whether
one is still alive (a zombie is not). Shared by the tensor- and pipeline-parallel tests."""

from __future__ import annotations

import os


def process_tree(root: int) -> dict[int, str]:
    """pid -> command line of `root` and its descendants."""
    children: dict[int, list[int]] = {}
    commands: dict[int, str] = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                parent = int(stat.read().rsplit(")", 1)[1].split()[1])
            with open(f"/proc/{entry}/cmdline", "rb") as cmdline:
                commands[int(entry)] = cmdline.read().replace(b"\0", b" ").decode()
        except (OSError, ValueError, IndexError):
            continue
        children.setdefault(parent, []).append(int(entry))
    tree, stack = {}, [root]
    while stack:
        pid = stack.pop()
        if pid in commands:
            tree[pid] = commands[pid]
        stack.extend(children.get(pid, []))
    return tree


def process_alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as stat:
            return stat.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False
