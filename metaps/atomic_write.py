"""Write files so that a reader sees the old content or the new one, never half.

Ready files, manifests, reports and job files are polled by other processes;
each is written to ``<name>.tmp`` and renamed over the target (atomic on POSIX).

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


def json_default(o: Any) -> Any:
    """``json.dumps(default=...)`` for numpy scalars/arrays and dataclasses; else ``str``."""
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if is_dataclass(o) and not isinstance(o, type):
        return asdict(o)
    return str(o)


def write_text_atomic(path: str | Path, text: str, fsync: bool = False) -> Path:
    """Write ``text`` to ``path`` via ``path.tmp`` + rename.

    Args:
        path: the target file (its folder must exist).
        text: the whole content.
        fsync: flush to disk before the rename (for data that must survive a crash).
    """
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    with tmp.open("w") as fh:
        fh.write(text)
        if fsync:
            fh.flush()
            os.fsync(fh.fileno())
    os.replace(tmp, path)
    return path


def write_json_atomic(path: str | Path, obj: Any, indent: int | None = 1, fsync: bool = False,
                      sort_keys: bool = False) -> Path:
    """``obj`` as JSON (numpy and dataclasses encoded) via :func:`write_text_atomic`."""
    text = json.dumps(obj, indent=indent, default=json_default, sort_keys=sort_keys) + "\n"
    return write_text_atomic(path, text, fsync=fsync)


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
