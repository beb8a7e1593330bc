"""A worker's incarnation snapshot encodes each history record once, and still reads back whole.

The snapshot (``workers/worker-R.inc-N.json``) is rewritten every ``tb_every_steps`` with the
whole history; encoding it all each time made a long run's snapshots cost O(steps) each.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from workers.telemetry import Telemetry


def test_snapshot_reads_back_as_the_report_with_every_record(tmp_path: Path) -> None:
    tel = Telemetry(tmp_path, rank=0, every=0)
    hist = [{"step": i, "loss": 0.5 / (i + 1), "samples": 256 * i} for i in range(5)]
    report = {"rank": 0, "state": "running", "steps": 5, "history": hist, "eval": {}}
    for k in range(3):
        tel.snapshot(report)
        got = json.loads(tel.report_path.read_text())
        assert got == {**report, "incarnation": tel.incarnation, "pid": os.getpid(), "eval_history": [], "last": {}}
        hist.append({"step": 5 + k, "loss": 0.1, "samples": 9})  # the history grows between snapshots
    assert len(tel._history_json) == 7  # encoded once each, not per snapshot
    tel.snapshot({"rank": 0, "history": [{"step": 1}]})  # another (shorter) history: encoded afresh
    assert json.loads(tel.report_path.read_text())["history"] == [{"step": 1}]
