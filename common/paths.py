"""Confine paths that arrive over the wire to a configured root.

A ``Checkpoint``/``Restore`` request to a PS, or a ``CheckpointDone`` report to
the controller, names a directory. Without a check, any caller holding the
token (or any caller at all on an unauthenticated fleet) could make the PS
write an LMDB file anywhere the process may write, or read one from anywhere.
:func:`confine` accepts a path only when it lies strictly under the root after
``os.path.realpath`` (symlinks resolved), and refuses ``..`` outright.

Example::

    d = confine(request.dir, "/runs/x/checkpoints")   # Path, or PathNotAllowed
"""

from __future__ import annotations

import os
from pathlib import Path

from common.errors import MetapsError


class PathNotAllowed(MetapsError):
    """A path from a request lies outside the configured root (or is malformed)."""

    code = "permission_denied"


def confine(path: str | Path, root: str | Path) -> Path:
    """The real path of ``path`` when it lies strictly under ``root``.

    Args:
        path: the requested path (absolute, or relative to this process's cwd).
        root: the only directory tree requests may name.

    Returns:
        ``os.path.realpath(path)`` (symlinks resolved; what the caller must use).

    Raises:
        PathNotAllowed: empty, NUL byte, a ``..`` component, or resolved outside
            ``root`` (including through a symlink); the message names path and root.
    """
    raw = str(path)
    real_root = os.path.realpath(root)
    if not raw:
        raise PathNotAllowed(f"empty path; expected a directory under the checkpoint root {real_root}")
    if "\x00" in raw:
        raise PathNotAllowed(f"path {raw!r} contains a NUL byte; expected a directory under {real_root}")
    if ".." in Path(raw).parts:
        raise PathNotAllowed(f"path {raw!r} contains '..'; expected a directory under the checkpoint root {real_root}")
    real = os.path.realpath(raw)
    if real == real_root or os.path.commonpath([real, real_root]) != real_root:
        raise PathNotAllowed(f"path {raw!r} (resolved {real}) is outside the checkpoint root {real_root}")
    return Path(real)


__all__ = ["PathNotAllowed", "confine"]
