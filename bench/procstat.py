"""CPU seconds of a process, a thread or a process tree from Linux ``/proc`` (the benches' load-robust figures).

On a shared 2-core box wall time moves with other jobs' load, CPU time barely does, so
benches report CPU per call or per window beside wall time.

A process tree's CPU (a fleet: launcher, controller, agents, PS shards, workers) is the sum
over its live processes of ``utime + stime + cutime + cstime``: a live process's own time,
plus what its children that already exited and were waited for used (the kernel adds a
reaped child's total, its own reaped children included, to its parent's ``c*time``). Each
CPU-second of the tree then counts once, whichever of its processes has exited, as long as
every exit is reaped inside the tree (``subprocess``'s ``wait`` does; an orphan re-parented
to init is lost).

Example::

    c0 = stat_cpu_s(f"/proc/{pid}/stat"); work(); used = stat_cpu_s(f"/proc/{pid}/stat") - c0
    per_pid = tree_cpu_s(launcher.pid)  # {pid: CPU seconds, reaped children included}
"""

from __future__ import annotations

import os
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def _fields(stat_path: str | Path) -> list[str]:
    text = Path(stat_path).read_text()
    return text[text.rindex(")") + 2:].split()  # after "pid (comm) ": field 3 (state) is fields[0]


def stat_cpu_s(stat_path: str | Path, reaped_children: bool = False) -> float:
    """utime + stime in seconds from a ``/proc/.../stat`` file (process or thread).

    Args:
        stat_path: ``/proc/PID/stat`` or ``/proc/PID/task/TID/stat``.
        reaped_children: add cutime + cstime (the process's exited and waited-for children).
    """
    f = _fields(stat_path)
    ticks = int(f[11]) + int(f[12])  # fields 14 and 15 of proc(5)
    if reaped_children:
        ticks += int(f[13]) + int(f[14])  # fields 16 and 17
    return ticks / CLK_TCK


def children(pid: int) -> list[int]:
    """The live (or not yet reaped) children of every thread of ``pid``; [] once it is gone."""
    out: list[int] = []
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            out += [int(c) for c in Path(f"/proc/{pid}/task/{tid}/children").read_text().split()]
        except OSError:
            continue
    return out


def process_tree(root: int) -> list[int]:
    """``root`` and its descendants now in ``/proc`` (depth first)."""
    out, todo = [], [root]
    while todo:
        pid = todo.pop()
        out.append(pid)
        todo += children(pid)
    return out


def tree_cpu_s(root: int) -> dict[int, float]:
    """Per process of ``root``'s tree: utime + stime + cutime + cstime in seconds (see the module doc).

    The values add up to the tree's CPU time so far; a process that exits between the
    listing and the read is left out (its time moves to its parent at the next read).
    """
    out: dict[int, float] = {}
    for pid in process_tree(root):
        try:
            out[pid] = stat_cpu_s(f"/proc/{pid}/stat", reaped_children=True)
        except (OSError, ValueError, IndexError):
            continue
    return out


def sched_cpu_s(pid: int) -> float:
    """CPU seconds of a live process's live threads at nanosecond resolution (``/proc/PID/task/*/schedstat``).

    ``stat_cpu_s`` counts clock ticks (10 ms here): too coarse for a few-ms call measured over
    tens of calls. Threads that exited are not counted: use it across windows in which a server's
    threads stay up (a gRPC server's pool).

    Args:
        pid: the process.
    """
    total = 0
    for task in Path(f"/proc/{pid}/task").iterdir():
        try:
            total += int((task / "schedstat").read_text().split()[0])
        except (FileNotFoundError, ProcessLookupError):  # a thread that just exited
            continue
    return total / 1e9
