"""CPU seconds of a process or thread from Linux ``/proc`` (the benches' load-robust figures).

On a shared 2-core box wall time moves with other jobs' load, CPU time barely does, so
benches report CPU per call or per window beside wall time.

Example::

    c0 = stat_cpu_s(f"/proc/{pid}/stat"); work(); used = stat_cpu_s(f"/proc/{pid}/stat") - c0
"""

from __future__ import annotations

import os
from pathlib import Path

CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100


def stat_cpu_s(stat_path: str | Path) -> float:
    """utime + stime in seconds from a ``/proc/.../stat`` file (process or thread).

    Args:
        stat_path: ``/proc/PID/stat`` or ``/proc/PID/task/TID/stat``.
    """
    text = Path(stat_path).read_text()
    fields = text[text.rindex(")") + 2:].split()  # after "pid (comm) ": field 3 (state) is fields[0]
    return (int(fields[11]) + int(fields[12])) / CLK_TCK  # fields 14 and 15 of proc(5)
