"""A real small tmpfs for full-disk tests: a private mount namespace (``unshare -rm``), no root mount.

Where a tmpfs cannot be mounted (no ``unshare``, user namespaces off) the test fails with a
message saying so, as the pods harness does: a skipped full-disk test would prove nothing.
"""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path
from typing import Any


def run_on_tmpfs(mnt: Path, size: str, argv: list[str], **run: Any) -> subprocess.CompletedProcess[str]:
    """Mount a ``size`` tmpfs on ``mnt`` (created) in a new mount namespace and run ``argv`` there.

    Args:
        mnt: the mount point (an empty folder is made).
        size: tmpfs size, e.g. ``512k``, ``8m``.
        argv: the command; it sees the tmpfs at ``mnt``.
        run: extra :func:`subprocess.run` keyword arguments (``cwd``, ``timeout``, ``env``).
    """
    assert shutil.which("unshare"), "full-disk tests mount a tmpfs in a mount namespace: they need unshare"
    mnt.mkdir(parents=True, exist_ok=True)
    probe = subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size={size} tmpfs {mnt}"],
                           capture_output=True, text=True)
    assert probe.returncode == 0, f"cannot mount a tmpfs here (unshare -rm): {probe.stderr.strip()}"
    cmd = " ".join(f"'{a}'" for a in argv)
    return subprocess.run(["unshare", "-rm", "sh", "-c", f"mount -t tmpfs -o size={size} tmpfs {mnt} && exec {cmd}"],
                          capture_output=True, text=True, **run)
