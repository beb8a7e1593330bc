"""``metaps launch --resume RUN``: an interrupted run continues from its last committed cut.

A real launch is interrupted (SIGINT, as Ctrl-C) after a committed checkpoint cut; the
summary says how to continue; ``--resume RUN`` continues it in its own directory. Judged
on the controller's ledger (every batch of every epoch trained exactly once into the
model: the work after the cut is marked replayed, nothing else is done twice), the event
log (the rollback to the cut), the PS restore and the workers' step numbers.
"""

from __future__ import annotations

import json
import os
import signal
import stat
import subprocess
import sys
from pathlib import Path

import pytest

from controller.state import EventLog, StateStore
from tests.metaps.fleet_data import (fleet_pids, finish_launch, kill_leftovers, make_data, start_launch, wait_for,
                                     write_job_file)

REPO = Path(__file__).resolve().parents[2]


def _state(state: Path, db: str) -> list[dict]:  # type: ignore[type-arg]
    if not (state / "data.mdb").exists():
        return []
    store = StateStore(state)
    try:
        return [b for _, b in store.items(db)]
    finally:
        store.close()


def _committed_cuts(state: Path) -> list[dict]:  # type: ignore[type-arg]
    return [b for b in _state(state, "cuts") if b.get("state") == "committed"]


def _done_after_latest_cut(state: Path) -> list[dict]:  # type: ignore[type-arg]
    """Ledger ``done`` entries recorded after the latest committed cut (work a continuation redoes)."""
    cuts = _committed_cuts(state)
    if not cuts:
        return []
    seq = max(cuts, key=lambda c: c["cut_id"])["dds"]["ledger_seq"]
    return [e for e in _state(state, "ledger") if e["seq"] > seq and e["kind"] == "done"]


def _cli_reaches_the_fleet(run: Path) -> None:
    """`metaps status`, `cut` and `run-report --controller` given the run's files only: no
    $METAPS_TOKEN, no --token-file; the token file is 0600 and named by RUN/job.toml."""
    tok = run / "rpc.token"
    assert stat.S_IMODE(tok.stat().st_mode) == 0o600 and f'token_file = "{tok}"' in (run / "job.toml").read_text()
    env = {k: v for k, v in os.environ.items() if k not in ("METAPS_TOKEN", "METAPS_RUN_DIR", "METAPS_CONTROLLER")}

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "metaps", "--json", *args], cwd=REPO, env=env,
                              capture_output=True, text=True, timeout=120)

    r = cli("status", "--config", str(run / "job.toml"))
    assert r.returncode == 0 and json.loads(r.stdout)["run"] == "running", r.stdout + r.stderr
    r = cli("cut", "--config", str(run / "job.toml"), "--reason", "test: the CLI reaches a launched fleet")
    assert r.returncode == 0 and json.loads(r.stdout)["state"] == "requested", r.stdout + r.stderr
    addr = (run / "controller" / "address").read_text().strip()
    r = cli("run-report", "--run-dir", str(run), "--controller", addr, "--out", str(run.parent / "mid-run.json"))
    assert "controller status unavailable" not in r.stderr, r.stderr
    assert json.loads((run.parent / "mid-run.json").read_text())["controller"]["nodes"], r.stderr


@pytest.mark.timeout(900)
def test_an_interrupted_run_continues_from_its_last_cut(tmp_path: Path) -> None:
    data = make_data(tmp_path / "data")
    cfg = write_job_file(tmp_path / "job.toml", data, workers=2, ps=1, train={"epochs": 4},
                         # slowed 3x: the run is still going when it is interrupted after its first cut
                         faults={"faults": [{"target": "worker", "index": 0, "kind": "slow", "factor": 3.0},
                                            {"target": "worker", "index": 1, "kind": "slow", "factor": 3.0}]},
                         controller={"checkpoint_interval_s": 3.0, "dds": {"batches_per_shard": 2}})
    runs = tmp_path / "runs"  # auto-named under [run] dir: `latest` follows the run and its continuation
    log = tmp_path / "launcher.log"
    proc = start_launch(["--no-progress", "--config", str(cfg)], log)
    run = runs
    try:
        wait_for(lambda: (runs / "latest" / "controller" / "address").is_file() or proc.poll() is not None, 300,
                 "the controller's address file")
        run = (runs / "latest").resolve()
        # the CLI reaches the launched fleet from RUN/job.toml alone (its token: the 0600 file job.toml names)
        _cli_reaches_the_fleet(run)
        # interrupted with work done after its latest cut: that work must be redone, not kept
        wait_for(lambda: _done_after_latest_cut(run / "controller") or proc.poll() is not None, 400,
                 "shards done after a committed cut")
        assert proc.poll() is None, "the run ended before it could be interrupted"
        proc.send_signal(signal.SIGINT)
        out = finish_launch(proc, log, 300)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_leftovers(str(run))
    assert proc.returncode == 130, out[-3000:]
    assert f"metaps launch --resume {run}" in out, out[-2000:]
    assert not (runs / "latest").exists() and os.readlink(runs / "last-failed") == run.name
    # interrupted: its processes stay Prometheus targets (a run that did not end well is worth an alert)
    assert {g["labels"]["process"] for g in json.loads((run / "metrics" / "targets.json").read_text())} >= {
        "controller", "ps-0", "worker-0", "worker-1"}
    first = json.loads((run / "report.json").read_text())
    assert first["status"] == "interrupted" and not first["controller"]["coverage"]["complete"]
    cut = max(_committed_cuts(run / "controller"), key=lambda c: c["cut_id"])
    after = _done_after_latest_cut(run / "controller")
    assert after, "no work after the cut to roll back"

    try:
        log2, out2 = tmp_path / "launcher-resume.log", tmp_path / "launcher-resume.out"
        with log2.open("wb") as err, out2.open("wb") as out_f:  # --json: stdout the object, stderr logs only
            again = subprocess.Popen([sys.executable, "-m", "metaps", "launch", "--json", "--resume", str(run)],
                                     cwd=REPO, stdout=out_f, stderr=err)
        again.wait(timeout=600)
        left = fleet_pids(str(run))
    finally:
        if again.poll() is None:
            again.kill()
            again.wait()
        kill_leftovers(str(run))
    assert again.returncode == 0, log2.read_text()[-3000:]
    assert left == []
    result = json.loads(out2.read_text())  # exactly one JSON object on stdout
    assert result["status"] == "succeeded" and result["run_dir"] == str(run), out2.read_text()
    logs = log2.read_text()
    assert "run succeeded" not in logs and "workers (every incarnation counted)" not in logs, logs[-3000:]
    assert 'msg="run ending" status=succeeded' in logs, logs[-3000:]
    assert os.readlink(runs / "latest") == run.name  # the continued run that succeeded is latest again
    assert json.loads((run / "metrics" / "targets.json").read_text()) == []  # ended well: no targets, no alerts
    rep = json.loads((run / "report.json").read_text())
    assert rep["status"] == "succeeded" and rep["resumed_from"] == cut["dir"]
    # the previous attempt is kept beside the new one
    assert json.loads((run / "report.attempt-1.json").read_text())["status"] == "interrupted"
    assert list((run / "logs" / "attempt-1").glob("worker-*.log"))
    cov = rep["controller"]["coverage"]
    # every batch of every epoch exactly once into the model: what the first attempt did after
    # the cut was rolled back (replayed), nothing done before the cut was done again
    assert cov["complete"] and cov["fraction"] == 1.0, cov["problems"]
    assert cov["duplicate_entries"] == 0 and cov["stale_entries"] == 0, cov
    # exactly the first attempt's work after the cut was rolled back with the PS rows, and redone
    replayed = {e["seq"] for e in _state(run / "controller", "ledger") if e.get("replayed")}
    assert replayed == {e["seq"] for e in after}, (sorted(replayed), sorted(e["seq"] for e in after))
    store = StateStore(run / "controller")
    try:
        events = EventLog(store).list()
    finally:
        store.close()
    cont = [e for e in events if e.kind == "run_continued"]
    assert len(cont) == 1 and cont[0].evidence["cut_id"] == cut["cut_id"]
    # the new attempt's PS restored the cut themselves: no restart recovery ran on top of it
    assert not [e for e in events if e.seq > cont[0].seq and e.kind in ("ps_restarted", "ps_recovery")]
    # the PS restored the cut; the workers numbered their steps on from it
    ps_log = (run / "logs" / "ps-0.log").read_text()
    assert f"dir={cut['dir']}" in ps_log or cut["dir"] in ps_log
    assert all(w["start_step"] >= cut["step"] for w in rep["workers"]), ([w["start_step"] for w in rep["workers"]],
                                                                        cut["step"])


def test_resume_refuses_a_finished_or_foreign_directory(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "controller").mkdir(parents=True)
    (run / "job.toml").write_text("")
    (run / "report.json").write_text(json.dumps({"status": "succeeded"}))
    r = subprocess.run([sys.executable, "-m", "metaps", "launch", "--resume", str(run)], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "the run succeeded; nothing to continue" in r.stderr, r.stderr
    assert len(r.stderr.strip().splitlines()) == 1 and (run / "report.json").exists()
    r = subprocess.run([sys.executable, "-m", "metaps", "launch", "--resume", str(tmp_path)], cwd=REPO,
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "not a run directory" in r.stderr, r.stderr
    r = subprocess.run([sys.executable, "-m", "metaps", "launch", "--resume", str(run), "--run-dir", str(tmp_path / "x")],
                       cwd=REPO, capture_output=True, text=True, timeout=120)
    assert r.returncode == 1 and "takes no --resume-from or --run-dir" in r.stderr, r.stderr


def test_shipped_job_configs_take_cuts_often_enough_to_resume() -> None:
    """An interrupted run of a shipped job file can be continued: `--resume` needs a committed cut,
    and the default period (300 s) leaves a short run without one."""
    from metaps.job import load_job

    jobs = [p for p in sorted((REPO / "configs").glob("*.toml")) if "[controller]" in p.read_text()]
    assert jobs, "no job files in configs/"
    for path in jobs:
        every = load_job(path).controller.checkpoint_interval_s
        assert 0 < every <= 30, f"{path.name}: [controller] checkpoint_interval_s = {every}"


def test_resume_of_a_run_without_a_cut_points_at_its_stop_checkpoint(tmp_path: Path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """A run stopped before its first cut: the refusal says why (the cut period) and, when the
    launcher's stop checkpoint exists, how to start from it (a warm start: model, not data accounting)."""
    import ps.checkpoint
    from common.errors import ConfigError
    from metaps.launch.resume import find_continue_point

    run = tmp_path / "run"
    (run / "controller").mkdir(parents=True)
    (run / "job.toml").write_text("")
    with pytest.raises(ConfigError, match=r"no committed checkpoint cut to continue from .*; start it again$"):
        find_continue_point(run)
    stop = run / "checkpoints" / "ckpt-87"
    monkeypatch.setattr(ps.checkpoint, "latest_checkpoint", lambda root: stop if Path(root) == stop.parent else None)
    with pytest.raises(ConfigError) as err:
        find_continue_point(run)
    assert str(err.value).endswith(f"its checkpoint ckpt-87 (written when it stopped) holds the model but no data "
                                   f"accounting: warm-start a new run from it with --resume-from {run}"), err.value
