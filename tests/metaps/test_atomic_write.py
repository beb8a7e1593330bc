"""Atomic file writes: whole content or the previous one; numpy and dataclasses encode."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from common.atomic_write import json_default, write_json_atomic, write_text_atomic


@dataclass
class _Point:
    x: int


def test_text_replaces_whole_and_leaves_no_tmp(tmp_path: Path) -> None:
    p = tmp_path / "address"
    write_text_atomic(p, "old\n")
    write_text_atomic(p, "new\n", fsync=True)
    assert p.read_text() == "new\n"
    assert [q.name for q in tmp_path.iterdir()] == ["address"]


def test_json_encodes_numpy_and_dataclasses(tmp_path: Path) -> None:
    p = write_json_atomic(tmp_path / "r.json", {"a": np.float32(0.5), "b": np.arange(3), "c": _Point(2)})
    assert json.loads(p.read_text()) == {"a": 0.5, "b": [0, 1, 2], "c": {"x": 2}}
    assert json_default(object()).startswith("<object")
