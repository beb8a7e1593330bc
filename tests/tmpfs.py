"""A real small tmpfs for full-disk tests: a private mount namespace (``unshare -rm``), no root mount.

Where a tmpfs cannot be mounted (no ``unshare``, user namespaces off) the test fails with a
message saying so, as the pods harness does: a skipped full-disk test would prove nothing.
"""

from __future__ import annotations

import shlex
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


LEFT_MARK = "@@tmpfs-left:"
"""The line :func:`tmpfs_once_made` prints, after the command, with what the tmpfs holds then."""


def tmpfs_once_made(mnt: Path, size: str, argv: list[str]) -> list[str]:
    """A command line that runs ``argv`` in a new mount namespace and, as soon as ``argv`` has made
    the directory ``mnt``, mounts a ``size`` tmpfs on it (as ``bench.chaos``'s ``disk_full``: a run
    directory must be new, so the mount point cannot be made beforehand). After ``argv`` exits it
    prints ``@@tmpfs-left: <names>`` (what the tmpfs holds, as its processes left it: the mount
    is gone with the namespace) and exits with ``argv``'s code; ``@@tmpfs-mount-failed`` if the
    mount failed.

    Args:
        mnt: the directory ``argv`` makes (e.g. ``RUN/checkpoints``).
        size: tmpfs size, e.g. ``64k``.
        argv: the command.
    """
    assert shutil.which("unshare"), "full-disk tests mount a tmpfs in a mount namespace: they need unshare"
    m = shlex.quote(str(mnt))
    script = (f"{shlex.join(argv)} & P=$!; "
              f"while [ ! -d {m} ] && kill -0 $P 2>/dev/null; do sleep 0.05; done; "
              f"mount -t tmpfs -o size={size} tmpfs {m} || echo @@tmpfs-mount-failed; "
              f"wait $P; rc=$?; echo \"{LEFT_MARK} $(ls -A {m} | tr '\\n' ' ')\"; exit $rc")
    return ["unshare", "-rm", "sh", "-c", script]
