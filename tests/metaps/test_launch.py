"""``metaps launch``: a real fleet (controller, PS and worker agents, gRPC on 127.0.0.1).

* end to end: tiny meta-mode data, 1 PS, 2 workers -> exit 0, report.json with every
  section, TensorBoard logs, non-blank plots, the final checkpoint, nothing left running;
* warm start + SIGINT: resume from that run's checkpoint (the PS restores its rows),
  SIGINT mid-training -> exit 130, a coordinated checkpoint, no process left;
* warm start + a PS lost before the run's own first cut: the warm start is the run's first
  cut, so the fleet is recovered to it (it used to fail the run: no committed cut);
* bad input: clear errors before anything starts.
"""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from common.errors import ConfigError
from metaps.job import load_job
from metaps.launch import (
    LaunchConfig,
    Launcher,
    find_resume_checkpoint,
    parse_override,
)
from metaps.roles.overrides import apply_overrides
from metaps.plots import PLOTS
from ps.checkpoint import latest_checkpoint, read_manifest
from tests.metaps.fleet_data import (
    fleet_pids,
    kill_leftovers,
    make_data,
    reaping,
    role_pid,
    train_shards_done,
    wait_for,
    write_job_file,
)
from tests.metaps.test_plots import assert_png_not_blank

REPO = Path(__file__).resolve().parents[2]


def _launch_cmd(*args: str) -> list[str]:
    return [sys.executable, "-m", "metaps", "launch", *args]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_data(tmp_path_factory.mktemp("launch-data"))


@pytest.fixture(scope="module")
def e2e(data: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    """One full launch: 1 PS, 2 workers, meta mode, train + held-out eval."""
    root = tmp_path_factory.mktemp("launch-e2e")
    # 3 epochs (15 shards of 4 batches): a fleet trains a step per message now, and with one epoch (5 shards)
    # the first worker could take them all before the second one had started
    cfg = write_job_file(root / "job.toml", data, workers=3, ps=2,  # the flags below override both counts
                         run={"plots": True}, train={"epochs": 3})
    run = root / "run"
    try:
        proc = subprocess.run(_launch_cmd("--config", str(cfg), "--workers", "2", "--ps", "1", "--run-dir", str(run),
                                          "--no-progress"),
                              cwd=REPO, check=False, capture_output=True, text=True, timeout=540)
        left = fleet_pids(str(run))
    finally:
        kill_leftovers(str(run))
    return {"proc": proc, "run": run, "left": left, "cfg": cfg}


@pytest.mark.timeout(600)
def test_launch_end_to_end_report(e2e: dict[str, Any]) -> None:
    proc, run = e2e["proc"], e2e["run"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    assert e2e["left"] == [], f"fleet processes left running: {e2e['left']}"
    assert f"run directory: {run}" in proc.stdout
    assert "run succeeded" in proc.stdout

    # the effective config: counts from the flags, every process pointed at it
    job = load_job(run / "job.toml")
    assert (job.ps.shards, job.train.workers) == (1, 2)
    assert Path(job.run.dir) == run and Path(job.controller.state_dir) == run / "controller"

    rep = json.loads((run / "report.json").read_text())
    assert rep["status"] == "succeeded" and rep["exit_code"] == 0 and rep["reason"] == ""
    assert rep["config"] == job.to_dict()
    for lib in ("metaps", "torch", "fbgemm", "grpc", "pyarrow"):
        assert rep["versions"][lib], f"no version for {lib}"
    assert rep["counts"] == {"ps": 1, "workers": 2}

    # per-worker figures from workers/*.json
    assert [w["rank"] for w in rep["workers"]] == [0, 1]
    for w in rep["workers"]:
        assert w["source"] == "report"
        assert w["steps"] > 0 and w["samples"] > 0 and w["samples_per_s"] > 0
        assert w["history"] and all("loss" in h and "samples_per_s" in h for h in w["history"])

    # the controller's ledger: every train batch done exactly once, samples add up
    cov = rep["controller"]["coverage"]
    assert cov["complete"], cov["problems"]
    assert rep["controller"]["finished"] is True
    train = [e for e in rep["shards"] if e["dataset"] == "train" and e["kind"] == "done"]
    assert sorted({e["epoch"] for e in train}) == [0, 1, 2]
    for epoch in range(3):  # each epoch's done shards tile the fixture's 17 meta-batches
        batches = sorted((e["start"], e["stop"]) for e in train if e["epoch"] == epoch)
        assert batches[0][0] == 0 and all(a[1] == b[0] for a, b in itertools.pairwise(batches)), (epoch, batches)
        assert batches[-1][1] == 17, (epoch, batches)
    assert sum(e["samples"] for e in train) == sum(w["samples"] for w in rep["workers"])
    assert {e["worker"] for e in rep["shards"]} <= {0, 1}
    kinds = {e["kind"] for e in rep["controller"]["events"]}
    assert "epoch_done" in kinds
    # the final checkpoint is the newest committed cut, of the finished run (a PS restarted now
    # would be restored to it, and the rollback would requeue nothing)
    cuts = [c for c in rep["controller"]["checkpoints"] if c["state"] == "committed"]
    assert cuts and cuts[-1].get("final") and cuts[-1]["dir"] == rep["checkpoint"], cuts
    assert cuts[-1]["dds"]["ledger_seq"] == max(e["seq"] for e in rep["shards"]), (cuts[-1], len(rep["shards"]))

    # per-PS figures, taken before the PS stopped
    assert len(rep["ps"]) == 1 and rep["ps"][0]["shard"] == 0
    assert sum(t["rows"] for t in rep["ps"][0]["store"]["tables"].values()) > 0

    # final metrics: rank 0's merged eval on the held-out set
    assert rep["final_metrics"]["files"] > 0
    assert {"base/click/auc", "adapted/click/auc"} <= set(rep["final_auc"])
    assert all(0.0 <= v <= 1.0 for k, v in rep["final_auc"].items() if k.endswith("/auc"))

    # the final checkpoint (rank 0) is the newest committed one
    assert rep["checkpoint"] and Path(rep["checkpoint"]) == latest_checkpoint(run / "checkpoints")
    assert read_manifest(rep["checkpoint"])["info"]["metrics"]

    # metrics ports of every process (the PS one matches its ready file)
    ports = rep["metrics_ports"]
    assert ports["ps-0"] == json.loads((run / "ps" / "ps-0.ready").read_text())["metrics_port"]
    assert isinstance(ports["worker-0"], int) and isinstance(ports["worker-1"], int)
    assert isinstance(ports["controller"], int)  # the controller and every agent serve /metrics too
    assert all(isinstance(ports[f"agent-{n}"], int) for n in ("ps-0", "worker-0", "worker-1"))
    # it succeeded: its Prometheus targets file is empty (no MetapsTargetDown for processes that ended well)
    assert json.loads((run / "metrics" / "targets.json").read_text()) == []
    assert {p["exit_code"] for p in rep["processes"].values()} == {0}


@pytest.mark.timeout(600)
def test_launch_writes_plots_and_tensorboard(e2e: dict[str, Any]) -> None:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    run = e2e["run"]
    assert e2e["proc"].returncode == 0, e2e["proc"].stderr[-3000:]
    for name in PLOTS:
        assert_png_not_blank(run / "plots" / name)
    for rank in (0, 1):
        acc = EventAccumulator(str(run / "tb" / f"worker-{rank}.inc-1"))  # written live by the worker
        acc.Reload()
        tags = acc.Tags()["scalars"]
        assert {"train/loss", "train/samples_per_s"} <= set(tags), tags
        # the incarnation's first step and its last one: a worker that joins late (it starts at the
        # fleet's clock, and rejoins it after a WAIT, skipping step numbers) may run a single step, so
        # the points are judged against its own report
        rep = json.loads((run / "workers" / f"worker-{rank}.json").read_text())
        steps = [e.step for e in acc.Scalars("train/loss")]
        assert rep["steps_run"] >= 1 and rep["first_step"] > rep["start_step"], rep
        assert steps[0] == rep["first_step"] and steps[-1] == rep["steps"], (steps, rep["first_step"], rep["steps"])
        assert steps == sorted(set(steps)), steps
    acc = EventAccumulator(str(run / "tb" / "fleet"))
    acc.Reload()
    assert "eval/adapted/click/auc" in acc.Tags()["scalars"]


@pytest.mark.timeout(600)
def test_sigint_after_warm_start_stops_cleanly_with_checkpoint(
        e2e: dict[str, Any], data: dict[str, Path], tmp_path: Path) -> None:
    """Resume from the e2e run, then Ctrl-C mid-training: exit 130, checkpoint, no process left."""
    assert e2e["proc"].returncode == 0, e2e["proc"].stderr[-3000:]
    source = latest_checkpoint(e2e["run"] / "checkpoints")
    cfg = write_job_file(tmp_path / "job.toml", data, workers=1, ps=1,
                         train={"epochs": 50},  # far more than the test waits for
                         faults={"faults": [{"target": "worker", "index": 0, "kind": "slow", "factor": 3.0}]},
                         run={"plots": True})  # an interrupted run is drawn too
    run = tmp_path / "run"
    proc = subprocess.Popen(_launch_cmd("--config", str(cfg), "--run-dir", str(run), "--resume-from",
                                        str(e2e["run"]), "--no-progress"),
                            cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    with reaping(proc, run):
        wait_for(lambda: 'msg="step"' in _read(run / "logs" / "worker-0.log"), 400, "the first training step")
        ps_log = _read(run / "logs" / "ps-0.log")
        assert f"dir={source}" in ps_log and 'msg="restored"' in ps_log, ps_log[-2000:]
        restored = next(line for line in ps_log.splitlines() if 'msg="restored"' in line)
        assert int(restored.split("rows=")[1].split()[0]) > 0  # the warm start brought rows back
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        out, _ = proc.communicate(timeout=180)
        left = fleet_pids(str(run))
    assert proc.returncode == 130, out[-5000:]
    assert left == [], f"fleet processes left running after SIGINT: {left}"
    ckpt = latest_checkpoint(run / "checkpoints")
    assert ckpt is not None, out[-3000:]
    man = read_manifest(ckpt)
    assert man["info"]["metrics"] == {"stopped": "stopped by SIGINT"}
    rep = json.loads((run / "report.json").read_text())
    assert rep["status"] == "interrupted" and rep["exit_code"] == 130
    assert rep["checkpoint"] == str(ckpt) and rep["resumed_from"] == str(source)
    assert rep["workers"][0]["source"] in ("log", "report") and rep["workers"][0]["steps"] >= 1
    for name in PLOTS:
        assert (run / "plots" / name).is_file()


@pytest.mark.timeout(600)
def test_a_ps_lost_before_a_warm_started_runs_first_cut_is_recovered_to_the_warm_start(
        e2e: dict[str, Any], data: dict[str, Path], tmp_path: Path) -> None:
    assert e2e["proc"].returncode == 0, e2e["proc"].stderr[-3000:]
    source = latest_checkpoint(e2e["run"] / "checkpoints")
    cfg = write_job_file(tmp_path / "job.toml", data, workers=2, ps=1, train={"epochs": 2},
                         controller={"checkpoint_interval_s": 0.0},  # no cut of its own: the warm start is the only one
                         faults={"faults": [{"target": "worker", "index": 0, "kind": "slow", "factor": 3.0},
                                            {"target": "worker", "index": 1, "kind": "slow", "factor": 3.0}]})
    run = tmp_path / "run"
    log = tmp_path / "launcher.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(_launch_cmd("--config", str(cfg), "--run-dir", str(run), "--resume-from",
                                            str(e2e["run"]), "--no-progress"), cwd=REPO, stdout=out,
                                stderr=subprocess.STDOUT)
    with reaping(proc, run):
        wait_for(lambda: train_shards_done(run / "controller") >= 2 or proc.poll() is not None, 400, "2 train shards done")
        assert proc.poll() is None, "the run ended before the strike"
        pid = role_pid(str(run), "ps", "--shard", 0)
        assert pid is not None, "PS 0 not found"
        os.kill(pid, signal.SIGKILL)
        proc.wait(timeout=400)
    out_text = log.read_text(errors="replace")
    assert proc.returncode == 0, out_text[-5000:]
    rep = json.loads((run / "report.json").read_text())
    assert rep["status"] == "succeeded" and rep["controller"]["coverage"]["complete"], rep["controller"]["coverage"]
    rec = [e for e in rep["controller"]["events"] if e["kind"] == "ps_recovery"]
    assert len(rec) == 1 and rec[0]["evidence"]["dir"] == str(source), rec
    assert rep["controller"]["coverage"]["replayed_entries"] >= 2, rep["controller"]["coverage"]
    cut0 = [c for c in rep["controller"]["checkpoints"] if c.get("warm_start")]
    assert len(cut0) == 1 and cut0[0]["dir"] == str(source) and cut0[0]["state"] == "committed", cut0


def _read(path: Path) -> str:
    try:
        return path.read_text(errors="replace")
    except OSError:
        return ""


# ---------------------------------------------------------------- bad input, helpers
def test_launch_refuses_a_non_empty_run_dir(data: dict[str, Path], tmp_path: Path) -> None:
    cfg = write_job_file(tmp_path / "job.toml", data)
    run = tmp_path / "run"
    run.mkdir()
    (run / "report.json").write_text("{}")
    with pytest.raises(ConfigError, match="not empty"):
        Launcher(LaunchConfig(config=str(cfg), run_dir=str(run), progress=False))
    assert fleet_pids(str(run)) == []


def test_launch_config_validation() -> None:
    for kw, msg in (({"workers": 0}, "--workers"), ({"ps": 0}, "--ps"), ({"timeout_s": -1.0}, "--timeout"),
                    ({"config": ""}, "--config"), ({"stop_grace_s": 0.0}, "stop_grace_s")):
        with pytest.raises(ValueError, match=msg):
            LaunchConfig(**{"config": "job.toml", **kw}).validate()


def test_launch_cli_reports_a_missing_config(tmp_path: Path) -> None:
    proc = subprocess.run(_launch_cmd("--config", str(tmp_path / "nope.toml"), "--run-dir", str(tmp_path / "r")),
                          cwd=REPO, check=False, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert "config file not found" in proc.stderr and "nope.toml" in proc.stderr
    assert not (tmp_path / "r").exists()


def test_resume_from_needs_a_committed_checkpoint(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="no such file"):
        find_resume_checkpoint(tmp_path / "missing")
    (tmp_path / "run" / "checkpoints" / "ckpt-3.tmp").mkdir(parents=True)
    with pytest.raises(ConfigError, match="no committed checkpoint"):
        find_resume_checkpoint(tmp_path / "run")


def test_overrides_parse_toml_values_and_name_bad_keys() -> None:
    assert parse_override("train.workers=4") == (["train", "workers"], 4)
    assert parse_override('ps.host="10.0.0.2"') == (["ps", "host"], "10.0.0.2")
    assert parse_override("ps.host=10.0.0.2") == (["ps", "host"], "10.0.0.2")  # bare word -> string
    assert parse_override("controller.dds.lease_s=2.5") == (["controller", "dds", "lease_s"], 2.5)
    for bad in ("workers=4", "train.workers", ".x=1", "train.=1"):
        with pytest.raises(ConfigError, match="SECTION.KEY=VALUE"):
            parse_override(bad)
    data: dict[str, Any] = {"ps": {"shards": 2}, "data": {"train": "x"}}
    apply_overrides(data, [(["ps", "host"], "h"), (["train", "workers"], 3)])
    assert data == {"ps": {"shards": 2, "host": "h"}, "data": {"train": "x"}, "train": {"workers": 3}}
    with pytest.raises(ConfigError, match="not a table"):
        apply_overrides(data, [(["data", "train", "x"], 1)])


def test_config_write_round_trips_and_validates(data: dict[str, Path], tmp_path: Path) -> None:
    cfg = write_job_file(tmp_path / "job.toml", data)
    out = tmp_path / "host" / "job.toml"
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    ok = subprocess.run([sys.executable, "-m", "metaps", "config-write", "--config", str(cfg), "--set",
                         "ps.host=127.0.0.9", "--set", "train.workers=5", "--out", str(out)],
                        cwd=REPO, check=False, capture_output=True, text=True, timeout=120, env=env)
    assert ok.returncode == 0, ok.stderr
    job = load_job(out)
    assert job.ps.host == "127.0.0.9" and job.train.workers == 5
    assert job.model.hidden == load_job(cfg).model.hidden
    bad = subprocess.run([sys.executable, "-m", "metaps", "config-write", "--config", str(cfg), "--set",
                          "train.workers=0", "--out", str(tmp_path / "bad.toml")],
                         cwd=REPO, check=False, capture_output=True, text=True, timeout=120, env=env)
    assert bad.returncode == 1 and "workers must be >= 1" in bad.stderr
    assert not (tmp_path / "bad.toml").exists()


# ---------------------------------------------------------------- failures
def _corrupt_copy(src: Path, dst: Path) -> Path:
    """A copy of a Meta-IO dataset with bytes inside a record batch flipped (same size, footer intact).

    The launch preflight checks sizes, footers and frames only (it reads no batch),
    so the fleet starts; the worker's reader finds the checksum mismatch when it
    reads that batch and exits.
    """
    import shutil

    shutil.copytree(src, dst)
    part = min(dst.glob("part-*.arrow"))
    data = bytearray(part.read_bytes())
    mid = len(data) // 3
    data[mid : mid + 64] = bytes(b ^ 0xFF for b in data[mid : mid + 64])
    part.write_bytes(bytes(data))
    return dst


@pytest.mark.timeout(600)
def test_worker_failing_beyond_its_restart_limit_fails_the_run(data: dict[str, Path], tmp_path: Path) -> None:
    """Corrupt training data: the controller and PS start, the worker crashes, its agent gives up -> exit 1."""
    bad = {"train": _corrupt_copy(data["train"], tmp_path / "bad-train"), "eval": data["eval"]}
    cfg = write_job_file(tmp_path / "job.toml", bad, workers=1, ps=1,
                         controller={"agent": {"heartbeat_s": 0.5, "restart_limit": 1, "backoff_s": 0.1}})
    run = tmp_path / "run"
    try:
        proc = subprocess.run(_launch_cmd("--config", str(cfg), "--run-dir", str(run), "--no-progress"),
                              cwd=REPO, check=False, capture_output=True, text=True, timeout=540)
        left = fleet_pids(str(run))
    finally:
        kill_leftovers(str(run))
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert left == [], f"fleet processes left running: {left}"
    rep = json.loads((run / "report.json").read_text())
    assert rep["status"] == "failed" and rep["exit_code"] == 1
    assert "worker-0's agent exited with code 1" in rep["reason"]
    assert rep["processes"]["worker-0"]["exit_code"] == 1
    log = _read(run / "logs" / "worker-0.log")
    assert log.count('msg="child started"') == 2 and "restart limit reached" in log  # 1 restart, then gave up
    down = [e for e in rep["controller"]["events"] if e["kind"] == "node_down" and e["node"] == "worker:0"]
    assert down, rep["controller"]["events"]
    assert rep["checkpoint"] and latest_checkpoint(run / "checkpoints") == Path(rep["checkpoint"])
    # [run] plots = false (the test jobs' default): no PNGs, and the log says how to draw them
    assert not (run / "plots").exists() and (run / "tb").is_dir()
    assert f'msg="plots not drawn ([run] plots = false)" draw="metaps run-report --run-dir {run}"' in proc.stderr


def test_missing_eval_dataset_fails_before_any_process_starts(data: dict[str, Path], tmp_path: Path) -> None:
    """The eval dataset is missing: the launch preflight says so in one line; nothing starts, no run dir.

    (This used to be found by the controller at its start, after the launcher had
    created the run directory; see tests/metaps/test_preflight.py for the other cases.)
    """
    cfg = write_job_file(tmp_path / "job.toml", {"train": data["train"], "eval": tmp_path / "no-such-eval"})
    run = tmp_path / "run"
    try:
        proc = subprocess.run(_launch_cmd("--config", str(cfg), "--run-dir", str(run), "--no-progress"),
                              cwd=REPO, check=False, capture_output=True, text=True, timeout=300)
        left = fleet_pids(str(run))
    finally:
        kill_leftovers(str(run))
    assert proc.returncode == 1, proc.stderr[-3000:]
    assert left == []
    errors = [ln for ln in proc.stderr.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and errors[0].startswith("metaps launch: error: preflight: data.eval = "), proc.stderr
    assert "no-such-eval: no such directory" in errors[0]
    assert not run.exists()


def test_fleet_processes_log_at_the_file_level_not_the_consoles() -> None:
    """``--log-level`` is the launcher's console; its fleet logs into RUN/logs at ``--file-log-level`` (INFO)."""
    import logging

    from metaps.launch.config import LaunchConfig, _metaps

    root = logging.getLogger()
    before = root.level
    root.setLevel(logging.WARNING)  # the console's level (launch --log-level WARNING) ...
    try:
        assert _metaps("ps", "--shard", "0")[3:6] == ["--log-level", "INFO", "ps"]  # ... is not the files'
    finally:
        root.setLevel(before)
    assert _metaps("ps", level="DEBUG")[4] == "DEBUG"
    with pytest.raises(ValueError, match="--file-log-level must be one of DEBUG, INFO, WARNING, ERROR, got 'LOUD'"):
        LaunchConfig(config="job.toml", file_log_level="LOUD").validate()
