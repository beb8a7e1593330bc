"""Write files so that a reader sees the old content or the new one, never half.

Ready files, manifests, reports and job files are polled by other processes;
each is written to ``<name>.tmp`` and renamed over the target (atomic on POSIX).
Files are created mode 0600 unless a caller asks for another ``mode``: run
files may hold paths, metrics and (redacted) configs that are nobody else's
business. Dataclasses encoded by :func:`json_default` have their secrets
blanked (:func:`common.security.redact`).

Example::

    write_json_atomic(run_dir / "report.json", report)
    write_text_atomic(state_dir / "address", "127.0.0.1:5000\\n")
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from common.security import redact

PRIVATE_FILE_MODE = 0o600
"""A secret's mode: the owner only."""
RUN_FILE_MODE = 0o640
"""A run's file (reports, manifests, job files): the group reads (``common.security.RUN_UMASK``)."""


def json_default(o: Any) -> Any:
    """``json.dumps(default=...)`` for numpy scalars/arrays and dataclasses (secrets redacted); else ``str``."""
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if is_dataclass(o) and not isinstance(o, type):
        return redact(asdict(o))
    return str(o)


def write_text_atomic(path: str | Path, text: str, fsync: bool = False, mode: int = RUN_FILE_MODE) -> Path:
    """Write ``text`` to ``path`` via ``path.tmp`` + rename.

    Args:
        path: the target file (its folder must exist).
        text: the whole content.
        fsync: flush to disk before the rename (for data that must survive a crash).
        mode: permission bits of the file (default 0640, whatever the umask; a secret passes
            :data:`PRIVATE_FILE_MODE`).
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, mode)
    with os.fdopen(fd, "w") as fh:
        os.fchmod(fh.fileno(), mode)  # O_CREAT's mode is masked by the umask, and ignored for an old tmp
        fh.write(text)
        if fsync:
            fh.flush()
            os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def write_json_atomic(path: str | Path, obj: Any, indent: int | None = 1, fsync: bool = False,
                      sort_keys: bool = False, mode: int = RUN_FILE_MODE) -> Path:
    """``obj`` as JSON (numpy and dataclasses encoded) via :func:`write_text_atomic`."""
    text = json.dumps(obj, indent=indent, default=json_default, sort_keys=sort_keys) + "\n"
    return write_text_atomic(path, text, fsync=fsync, mode=mode)


@contextlib.contextmanager
def atomic_output(path: str | Path) -> Iterator[Path]:
    """Yield a temporary path beside ``path``; rename it over ``path`` only if the block succeeds.

    For files written by a library that wants a path (Parquet writers, ...): on
    any exception the temporary file is removed and ``path`` is left as it was
    (absent, or its previous content).

    Example::

        with atomic_output("scores.parquet") as tmp:
            write_parquet(tmp)          # a failure here leaves no scores.parquet
    """
    path = Path(path)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        yield tmp
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
