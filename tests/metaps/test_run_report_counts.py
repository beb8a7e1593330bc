"""The summary's counts say what they count: every incarnation, which step, why shards grew; epochs agree.

Built from real incarnation report files in a run directory (the files a worker
writes: ``workers/worker-R.inc-N.json``), through :func:`build_report` and
:func:`print_summary` as ``metaps launch`` calls them.
"""

from __future__ import annotations

import io
import json
from pathlib import Path
from typing import Any

import pytest
from rich.console import Console

from metaps.job import job_from_mapping
from metaps.progress import epoch_text, render
from metaps.run_report import build_report, print_summary, read_worker_reports


def _write(run: Path, name: str, rep: dict[str, Any]) -> None:
    (run / "workers").mkdir(parents=True, exist_ok=True)
    (run / "workers" / name).write_text(json.dumps(rep))


def _inc(rank: int, start: int, end: int, samples: int, state: str, t: float) -> dict[str, Any]:
    return {"rank": rank, "state": state, "steps": end, "start_step": start, "steps_run": end - start,
            "samples": samples, "wall_s": 0.0 if state == "running" else 10.0, "train_start": t, "time": t + 10.0,
            "history": [{"step": s, "time": t + s, "loss": 0.7, "samples_per_s": 50.0} for s in range(start + 1, end + 1)]}


def _run(tmp_path: Path) -> tuple[Path, Any]:
    run = tmp_path / "run"
    _write(run, "worker-0.inc-1.json", {**_inc(0, 0, 40, 4000, "finished", 1000.0),
                                        "checkpoint": str(run / "checkpoints" / "ckpt-63")})
    _write(run, "worker-1.inc-1.json", _inc(1, 0, 20, 2000, "running", 1000.0))  # slowed, then restarted
    _write(run, "worker-1.inc-2.json", _inc(1, 20, 30, 1000, "finished", 1030.0))
    _write(run, "worker-1.json", _inc(1, 20, 30, 1000, "finished", 1030.0))  # the legacy copy is not counted twice
    job = job_from_mapping({"data": {"train": "x"}, "train": {"workers": 2}, "run": {"dir": str(tmp_path)}})
    return run, job


def test_summary_counts_every_incarnation_and_names_the_checkpoint_step(tmp_path: Path) -> None:
    run, job = _run(tmp_path)
    reps = read_worker_reports(run)
    assert reps[1]["steps"] == 30 and reps[1]["samples"] == 3000 and reps[1]["last_step"] == 30
    assert [i["incarnation"] for i in reps[1]["incarnations"]] == [1, 2]
    status = {"datasets": [{"dataset": "train", "shards_total": 36, "epoch": 0, "epochs": 1, "finished": True}],
              "events": [{"kind": "shrink_shards", "node": "worker:1", "time": 1012.0},
                         {"kind": "shards_requeued", "node": "worker:1", "time": 1020.0}]}
    rep = build_report(run, job, status="succeeded", controller_status=status)
    assert rep["totals"]["steps"] == 70 and rep["totals"]["samples"] == 7000
    assert rep["totals"]["checkpoint_step"] == 63 and rep["totals"]["incarnations"] == 3
    buf = io.StringIO()
    print_summary(Console(file=buf, width=220), rep)
    text = buf.getvalue()
    assert "steps 70 (all workers, every incarnation) over 3 incarnations" in text, text
    assert "last checkpoint at step 63" in text, text
    assert "train 36" in text and "shrink_shards" in text and "requeue" in text, text
    rows = [[c.strip() for c in ln.split("│")[1:-1]] for ln in text.splitlines() if ln.count("│") > 3]
    assert [r[1:3] for r in rows if r[0] == "1"] == [["1", "20"], ["2", "10"], ["all", "30"]], text


def test_a_killed_incarnation_counts_what_its_log_says(tmp_path: Path) -> None:
    """Killed between two snapshots (or before its first): the step log lines fill in the rest."""
    run, job = _run(tmp_path)
    _write(run, "worker-2.inc-1.json", {"rank": 2, "incarnation": 1, "state": "starting", "time": 1000.0})
    _write(run, "worker-1.inc-3.json", _inc(1, 30, 34, 400, "running", 1060.0))
    logs = {1: [{"step": s, "time": 1060.0 + s, "loss": 0.6} for s in (32, 34, 36, 38)],
            2: [{"step": 1, "time": 1001.0, "loss": 0.7}, {"step": 2, "time": 1002.0, "loss": 0.7}]}
    job = job_from_mapping({"data": {"train": "x"}, "train": {"workers": 3}, "run": {"dir": str(tmp_path)}})
    rep = build_report(run, job, status="interrupted", log_histories=logs)
    w1, w2 = rep["workers"][1], rep["workers"][2]
    assert w1["steps"] == 20 + 10 + 8 and w1["last_step"] == 38 and w1["source"] == "report"
    assert w2["source"] == "log" and w2["steps"] == 2


def test_epoch_column_is_the_same_running_and_finished() -> None:
    running = {"dataset": "train", "epoch": 0, "epochs": 1, "finished": False}
    finished = {**running, "finished": True}
    assert epoch_text(running) == epoch_text(finished) == "1/1"
    assert epoch_text({"epoch": 1, "epochs": 2, "finished": False}) == "2/2"
    assert epoch_text({"epoch": 1, "epochs": 2, "finished": True}) == "2/2"
    row = {**finished, "shards_done": 3, "shards_total": 3, "shards_doing": 0, "batches_done": 9, "batches_total": 9}
    buf = io.StringIO()
    Console(file=buf, width=200).print(render({"datasets": [row]}, {}, 1.0))
    assert " 1/1 " in buf.getvalue() and " 0/1 " not in buf.getvalue()


def test_a_dead_incarnation_says_dead_with_its_last_real_rate(tmp_path: Path) -> None:
    """Killed 2 ms into training: its snapshot still says ``running``; the report says
    ``dead`` (a newer incarnation replaced it, or its pid is gone) and gives its last measured
    step rate, not samples over a 2 ms wall (~10^12 samples/s)."""
    import subprocess
    import sys

    run = tmp_path / "run"
    gone = subprocess.run([sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True,
                          check=True)
    dead_pid = int(gone.stdout)  # a process that has exited
    killed = {**_inc(0, 0, 5, 2_000_000_000, "running", 1000.0), "pid": dead_pid, "time": 1000.002,
              "last": {"step": 5, "samples_per_s": 480.0}}
    _write(run, "worker-0.inc-1.json", killed)
    _write(run, "worker-0.inc-2.json", {**_inc(0, 5, 9, 400, "running", 1010.0), "pid": dead_pid})
    _write(run, "worker-1.inc-1.json", {**_inc(1, 0, 9, 900, "running", 1000.0), "pid": __import__("os").getpid()})
    reps = read_worker_reports(run)
    first, second = reps[0]["incarnations"]
    assert first["state"] == "dead" and second["state"] == "dead" and reps[0]["state"] == "dead"
    assert first["samples_per_s"] == 480.0  # its last measured rate
    assert reps[1]["incarnations"][0]["state"] == "running" and reps[1]["state"] == "running"  # this pid lives
    job = job_from_mapping({"data": {"train": "x"}, "train": {"workers": 2}, "run": {"dir": str(tmp_path)}})
    buf = io.StringIO()
    print_summary(Console(file=buf, width=220), build_report(run, job, status="interrupted"))
    text = buf.getvalue()
    assert "dead" in text and "480.0" in text and "000,000" not in text, text


def test_the_summary_says_plainly_what_adaptation_bought(tmp_path: Path) -> None:
    """Base vs adapted AUC per head of the held-out users, the gain with its sign, the Bayes
    oracle where the data has one, and a plain line when adaptation helped no head."""
    from metaps.run_report import cold_start

    def head(auc: float, oracle: float | None = None) -> dict[str, Any]:
        return {"rows": 2187, "auc": auc, **({"oracle_auc": oracle} if oracle is not None else {})}

    hurt = {"base": {"click": head(0.7942, 0.8521), "conversion": head(0.8479, 0.9190)},
            "adapted": {"click": head(0.7921, 0.8521), "conversion": head(0.8485, 0.9190)}}
    table = cold_start(hurt)
    assert table["click"] == {"base": 0.7942, "adapted": 0.7921, "gain": -0.0021, "oracle": 0.8521, "verdict": "hurts"}
    assert table["conversion"]["verdict"] == "no clear change"
    run, job = _run(tmp_path)
    (run / "workers" / "worker-0.inc-1.json").write_text(json.dumps({
        **_inc(0, 0, 40, 4000, "finished", 1000.0), "eval": hurt}))
    rep = build_report(run, job, status="succeeded")
    assert rep["cold_start"] == table
    buf = io.StringIO()
    print_summary(Console(file=buf, width=220), rep)
    text = buf.getvalue()
    assert "click: base 0.7942 -> adapted 0.7921 (-0.0021: hurts); Bayes oracle 0.8521" in text, text
    assert "adaptation did not improve any head on these held-out users" in text
    helped = {"base": {"click": head(0.70)}, "adapted": {"click": head(0.72)}}
    assert cold_start(helped)["click"]["verdict"] == "helps" and cold_start(helped)["click"]["oracle"] is None
    assert cold_start({"base": {"click": head(0.7)}}) == {}  # no adapted eval: nothing claimed


def test_the_report_names_only_faults_that_fired(tmp_path: Path) -> None:
    """Faults the injectors recorded (RUN/faults/) are named with when they fired; a scheduled
    fault that never fired is named nowhere: report, console summary, summary.png's text."""
    from common.config import from_mapping
    from common.faults import FaultConfig, FaultInjector
    from metaps.plots import summary_lines

    run, _ = _run(tmp_path)
    faults = {"faults": [{"target": "worker", "index": 1, "kind": "slow", "factor": 3.0, "basis": "step",
                          "start_step": 5, "end_step": 8},
                         {"target": "worker", "index": 0, "kind": "kill", "at_step": 999}]}
    job = job_from_mapping({"data": {"train": "x"}, "train": {"workers": 2}, "run": {"dir": str(tmp_path)},
                            "faults": faults})
    cfg = from_mapping(FaultConfig, faults, where="t", prefix="faults")
    w1 = FaultInjector(cfg, "worker", 1, t0=1000.0, record_dir=run / "faults")
    w0 = FaultInjector(cfg, "worker", 0, t0=1000.0, record_dir=run / "faults")
    delays = {s: w1.step_delay(0.1, 0.5, now=1000.0 + s, step=s) for s in range(1, 12)}
    assert [s for s, d in delays.items() if d > 0] == [5, 6, 7] and delays[5] == pytest.approx(1.0)
    assert not any(w0.kill_due(now=1000.0 + s, step=s, start_step=0) for s in range(1, 40))
    w1.flush()
    w0.flush()
    rep = build_report(run, job, status="succeeded", started=1000.0,
                       controller_status={"events": [{"kind": "slow_detected", "node": "worker:1", "time": 1006.5}]})
    fired = rep["faults"]["fired"]
    assert rep["faults"]["scheduled"] == 2 and len(fired) == 1, rep["faults"]
    assert fired[0]["first_step"] == 5 and fired[0]["last_step"] == 7 and fired[0]["count"] == 3, fired
    assert fired[0]["start_s"] == 5.0 and fired[0]["end_s"] == 7.0 and fired[0]["sleep_s"] == pytest.approx(3.0)
    buf = io.StringIO()
    print_summary(Console(file=buf, width=220), rep)
    text = buf.getvalue() + "\n".join(summary_lines(rep))
    assert "faults fired: worker 1 slow x3 (step) at steps 5-7 (3 steps), 5.0-7.0 s after launch, slept 3.0 s" in text
    assert "controller: worker 1 flagged slow at 6.5 s" in text, text
    assert "kill" not in text and "999" not in text, text  # scheduled, never fired: named nowhere
    # nothing fired: the summary says so without naming what was scheduled
    for p in (run / "faults").glob("*.json"):
        p.unlink()
    quiet = build_report(run, job, status="succeeded", started=1000.0)
    buf = io.StringIO()
    print_summary(Console(file=buf, width=220), quiet)
    text = buf.getvalue() + "\n".join(summary_lines(quiet))
    assert "faults fired: none (2 scheduled in [faults], none applied)" in text and "controller: flagged no node slow" in text
    assert "slow x3" not in text and "kill" not in text, text
