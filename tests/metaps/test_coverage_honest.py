"""Honest coverage (issue 10 point 3): "complete" only when every shard of every
requested epoch is DONE; otherwise the fraction covered and why the run stopped.

* DDS on a real LMDB: epoch 0 fully done, epoch 1 half done -> not complete,
  ``in_progress``, the exact fraction; after the last shard -> complete;
* the one-line text the report and summary print;
* a real ``metaps launch`` stopped by SIGTERM mid-run -> exit 143, report.json
  and the printed summary say ``NN% (stopped: launcher SIGTERM)``.
"""

from __future__ import annotations

import json
import re
import signal
from pathlib import Path

import pytest

from controller.config import DdsConfig
from controller.dds import DatasetKind, DatasetSpec, DynamicDataSharding, GetStatus
from controller.state import EventLog, StateStore
from metaps.run_report import coverage_text, replay_text
from tests.metaps.fleet_data import (fleet_pids, finish_launch, make_data, reaping, start_launch, wait_for,
                                     write_job_file)

TRAIN = DatasetSpec("train", (8, 8), DatasetKind.TRAIN, epochs=2)  # 4 shards of 4 batches per epoch


def _take(dds: DynamicDataSharding, n: int) -> None:
    for _ in range(n):
        got = dds.get_shard(0, "train")
        assert got.status is GetStatus.SHARD
        assert dds.report(0, got.lease.shard_id, got.lease.attempt, "done", samples=4).kind == "done"


def test_a_run_stopped_mid_epoch_is_not_complete(tmp_path: Path) -> None:
    store = StateStore(tmp_path / "state")
    dds = DynamicDataSharding(store, DdsConfig(batches_per_shard=4), [TRAIN], EventLog(store))
    _take(dds, 4)  # all of epoch 0
    _take(dds, 2)  # half of epoch 1
    cov = dds.coverage()
    assert not cov.complete and cov.state == "in_progress" and not cov.problems
    assert (cov.done_batches, cov.total_batches) == (24, 32) and cov.fraction == 0.75
    st = cov.to_status()
    assert st["state"] == "in_progress" and st["fraction"] == 0.75 and st["by_dataset"] == {"train": [24, 32]}
    assert coverage_text(st, "running") == "in progress: 75%"
    assert coverage_text(st, "interrupted", "stopped by SIGTERM") == "75% (stopped: launcher SIGTERM)"
    _take(dds, 2)
    cov = dds.coverage()
    assert cov.complete and cov.state == "complete" and cov.fraction == 1.0
    assert coverage_text(cov.to_status(), "succeeded") == "complete"
    # batches trained twice are said on their own line, abandoned leases as an upper bound
    assert replay_text(cov.to_status()) == "none"
    assert replay_text({**cov.to_status(), "duplicate_batches": 3, "abandoned_batches": 4}) == \
        "3 batches trained twice; at most 4 more batches of abandoned leases trained twice (at-least-once)"
    assert replay_text({**cov.to_status(), "abandoned_batches": 2}) == \
        "at most 2 batches of abandoned leases trained twice (at-least-once)"
    store.close()


def test_ledger_alone_needs_every_requested_epoch(tmp_path: Path) -> None:
    """Checked epochs clean but the last epoch never started: still not complete (ledger view)."""
    store = StateStore(tmp_path / "state")
    dds = DynamicDataSharding(store, DdsConfig(batches_per_shard=4), [TRAIN], EventLog(store))
    _take(dds, 4)
    cov = dds.ledger.coverage(dds.specs, {"train": 1})
    assert not cov.complete and not cov.problems and cov.fraction == 0.5
    assert not cov.finished and cov.state == "in_progress"
    store.close()


def test_coverage_text_when_the_controller_failed_the_run() -> None:
    st = {"complete": False, "fraction": 0.4, "problems": []}
    assert coverage_text(st, "failed", "PS recovery failed: no committed checkpoint") == \
        "40% (stopped: PS recovery failed: no committed checkpoint)"
    assert coverage_text({}, "failed", "x") == "unknown (no controller status)"
    assert coverage_text({**st, "problems": ["dataset train epoch 0 file 0: batches [0, 4) never done"]},
                         "succeeded").startswith("40% (stopped: every worker exited before every shard was done); problems:")


def _every_target_answers(run: Path) -> None:
    """Mid-run, RUN/metrics/targets.json (Prometheus file_sd) names every process's /metrics, and each answers."""
    import urllib.request

    groups = json.loads((run / "metrics" / "targets.json").read_text())
    procs = {g["labels"]["process"]: g["targets"][0] for g in groups}
    assert {"controller", "ps-0", "worker-0", "agent-ps-0", "agent-worker-0"} <= set(procs), procs
    for name, address in procs.items():
        body = urllib.request.urlopen(f"http://{address}/metrics", timeout=10).read().decode()
        assert "metaps_" in body, (name, body[:300])
    assert "metaps_worker_step" in urllib.request.urlopen(f"http://{procs['worker-0']}/metrics", timeout=10).read().decode()


@pytest.mark.timeout(600)
def test_launch_stopped_by_sigterm_reports_the_fraction_and_why(tmp_path: Path) -> None:
    data = make_data(tmp_path / "data")
    cfg = write_job_file(tmp_path / "job.toml", data, workers=1, ps=1, train={"epochs": 50},  # never finishes here
                         # slowed 3x (a third of the CPU): the test only needs it mid-run
                         faults={"faults": [{"target": "worker", "index": 0, "kind": "slow", "factor": 3.0}]})
    run = tmp_path / "run"
    log = tmp_path / "launcher.log"
    proc = start_launch(["--config", str(cfg), "--run-dir", str(run), "--no-progress"], log)
    with reaping(proc, run):
        wait_for(lambda: _steps(run) >= 2, 400, "training steps")  # mid-run: far from 50 epochs
        assert proc.poll() is None
        _every_target_answers(run)
        proc.send_signal(signal.SIGTERM)
        out = finish_launch(proc, log, 240)
        left = fleet_pids(str(run))
    assert proc.returncode == 143, out[-4000:]
    assert left == []
    rep = json.loads((run / "report.json").read_text())
    cov = rep["controller"]["coverage"]
    assert rep["status"] == "interrupted" and not cov["complete"] and cov["state"] != "complete", cov
    assert 0.0 <= cov["fraction"] < 1.0
    assert re.fullmatch(r"\d+% \(stopped: launcher SIGTERM\)", rep["coverage_summary"]), rep["coverage_summary"]
    assert f"coverage: {rep['coverage_summary']}" in out, out[-3000:]
    assert "coverage complete" not in out and "complete" not in rep["coverage_summary"]


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


def _steps(run: Path) -> int:
    return _read(run / "logs" / "worker-0.log").count('msg="step"')


def test_the_launcher_reads_the_controllers_run_failed_event() -> None:
    from metaps.launch import EXIT_FAILED, controller_failed

    st = {"events": [{"kind": "ps_recovery_failed", "evidence": {"fatal": True}},
                     {"kind": "run_failed", "evidence": {"reason": "PS recovery after the restart of ps:1 failed: x"}}]}
    out = controller_failed(st)
    assert out is not None and out.status == "failed" and out.code == EXIT_FAILED
    assert out.reason == "PS recovery after the restart of ps:1 failed: x" and out.final_checkpoint is False
    assert controller_failed({"events": [{"kind": "ps_recovery", "evidence": {}}]}) is None
    assert controller_failed(None) is None
    from controller.ps_recovery import RUN_FAILED
    from metaps.run_report import RUN_FAILED_EVENT

    assert RUN_FAILED == RUN_FAILED_EVENT  # the controller's event kind and what the launcher looks for


def test_the_launcher_never_says_succeeded_below_full_coverage() -> None:
    """Every worker exited, but the controller's coverage is short (a rollback reopened finished
    training after the workers had gone): the launch fails, naming the coverage; complete and
    closed-on-request coverage stay a success."""
    from metaps.launch.launcher import coverage_short

    short = {"coverage": {"complete": False, "state": "incomplete", "fraction": 0.18,
                          "problems": ["dataset train epoch 0 file 0: batches [4, 17) never done"]}}
    out = coverage_short(short)
    assert out is not None and out.status == "failed" and out.code != 0
    assert out.reason == ("every worker exited with the coverage incomplete at 18%: "
                          "['dataset train epoch 0 file 0: batches [4, 17) never done']")
    assert coverage_short({"coverage": {**short["coverage"], "state": "in_progress", "problems": []}}) is not None
    for ok in ("complete", "partial_by_request"):
        assert coverage_short({"coverage": {"state": ok, "fraction": 1.0}}) is None
    assert coverage_short({}) is None  # no status: the controller's failure is said elsewhere
