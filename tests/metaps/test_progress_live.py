"""The launcher's live view reads what the workers publish, not their log lines (issue 14).

Snapshots are written by the real :class:`workers.telemetry.Telemetry` (the code a
worker process runs), ``/metrics`` is served over real HTTP on 127.0.0.1 from this
process's registry; :class:`metaps.progress.LiveWorkers` reads both.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from common.metrics import serve_metrics
from metaps.progress import LiveWorkers, StepLogTail
from workers.telemetry import Telemetry


def _report(steps: int, start: int, samples: int, state: str = "running") -> dict[str, Any]:
    """What a worker's snapshot carries (``workers.worker.Worker._report_dict``)."""
    return {"state": state, "time": time.time(), "steps": steps, "start_step": start, "steps_run": steps - start,
            "samples": samples, "history": [{"step": start + 1, "loss": 9.0, "samples_per_s": 1.0}]}


def _step(tel: Telemetry, step: int, loss: float, samples: int = 10) -> None:
    tel.on_step(step, samples, loss, {"total": 0.5}, {"loss/click": loss / 2, "loss/conversion": loss / 2})


def test_view_step_is_the_latest_snapshots_step_summed_over_incarnations(tmp_path: Path) -> None:
    run = tmp_path / "run"
    first = Telemetry(run, rank=60, every=2)
    for s in range(1, 9):
        _step(first, s, 0.9)
    first.snapshot(_report(8, 0, 80))  # killed after this snapshot
    second = Telemetry(run, rank=60, every=2)  # the restart: incarnation 2, resumes at step 8
    assert second.incarnation == 2
    live = LiveWorkers(run)
    live.poll()
    w = live.latest()[60]
    assert (w["step"], w["samples"], w["incarnations"]) == (8, 80, 2)
    assert w["loss"] == 0.9  # the killed incarnation's last step: the new one has not stepped yet
    for s in range(9, 15):
        _step(second, s, 0.5 + s / 100)
    second.snapshot(_report(14, 8, 60))
    # the log lags behind (its last line is step 10): the view follows the snapshot
    log = tmp_path / "worker-60.log"
    log.write_text('2026-01-01T00:00:00 INFO workers.worker msg="step" rank=60 step=10 loss=0.6 samples_per_s=5\n')
    tail = StepLogTail({60: log, 61: tmp_path / "worker-61.log"})
    tail.poll()
    (tmp_path / "worker-61.log").write_text(
        '2026-01-01T00:00:00 INFO workers.worker msg="step" rank=61 step=3 loss=0.7 samples_per_s=5\n')
    tail.poll()
    live.poll()
    view = live.latest(fallback=tail.latest())
    w = view[60]
    assert w["step"] == 14 and w["source"] == "snapshot"
    assert w["samples"] == 140 and w["incarnations"] == 2
    assert w["loss"] == second.last["loss"] and w["samples_per_s"] == second.last["samples_per_s"]
    # a rank with no snapshot yet falls back to its log lines, and says so
    assert view[61]["step"] == 3 and view[61]["source"] == "log"
    assert live.max_step() == 14


def test_view_follows_the_running_incarnations_metrics_between_snapshots(tmp_path: Path) -> None:
    run = tmp_path / "run"
    port = serve_metrics()
    Telemetry(run, rank=62, every=5).snapshot(_report(5, 0, 50))  # incarnation 1, killed
    cur = Telemetry(run, rank=62, every=5)
    for s in range(6, 11):
        _step(cur, s, 0.4)
    cur.snapshot(_report(10, 5, 50))
    for s in range(11, 14):  # three more steps: not in any snapshot yet
        _step(cur, s, 0.3)
    live = LiveWorkers(run, ports={62: port})
    live.poll()
    w = live.latest()[62]
    assert w["source"] == "metrics" and w["step"] == 13
    assert w["samples"] == 50 + 8 * 10  # incarnation 1's snapshot + the running process's counter
    assert w["loss"] == 0.3
    # an endpoint that does not answer leaves the snapshot figures
    live.ports = {62: 1}
    live.poll()
    w = live.latest()[62]
    assert w["source"] == "snapshot" and w["step"] == 10 and w["samples"] == 100
