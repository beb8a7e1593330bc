"""Facts about other processes on this host."""

from __future__ import annotations

import os


def pid_alive(pid: object) -> bool:
    """Whether a process with this pid exists on this host (True when unsure: someone else's).

    Args:
        pid: a pid as read from a file (anything that is not a positive int is no process).
    """
    if not isinstance(pid, int) or isinstance(pid, bool) or pid <= 0:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # someone else's process: it exists
        return True
    return True
