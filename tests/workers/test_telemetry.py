"""Live telemetry of a real worker process, and a restarted worker counted in full.

One scenario, real parts: an in-process PS shard on loopback, ``metaps worker``
processes with ``--metrics-port``. Incarnation 1 trains a long job; while it
runs the test scrapes its ``/metrics`` (the step counter advances) and reads its
TensorBoard event files (train scalars and a periodic-eval AUC, written before
the run ends). Then it is SIGKILLed, incarnation 2 of the same rank trains one
epoch to the end, and the run report built from the files both wrote counts
both incarnations.
"""

from __future__ import annotations

import io
import os
import signal
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from typing import Any

import pytest
from prometheus_client.parser import text_string_to_metric_families
from rich.console import Console

from common.metrics import free_port
from metaps.run_report import build_report, print_summary, read_incarnations
from tests.workers.conftest import make_job
from tests.workers.procs import REPO, TOKEN, wait_exit, write_job

DEADLINE_S = 240.0


def _start(config: Path, run_dir: Path, log_path: Path, metrics_port: int) -> subprocess.Popen[bytes]:
    cmd = [sys.executable, "-m", "metaps", "worker", "--config", str(config), "--rank", "0",
           "--ps", PS_ADDR[0], "--run-dir", str(run_dir), "--metrics-port", str(metrics_port)]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", METAPS_TOKEN=TOKEN)
    return subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log_path.open("w"), stderr=subprocess.STDOUT)


PS_ADDR: list[str] = []


def _scrape(port: int) -> dict[str, float]:
    """Sample name{labels} -> value of the worker's /metrics (rank 0's series)."""
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = ",".join(f"{k}={v}" for k, v in sorted(s.labels.items()) if k != "rank")
            out[f"{s.name}{{{labels}}}" if labels else s.name] = float(s.value)
    return out


def _poll(what: str, fn: Any, proc: subprocess.Popen[bytes], log_path: Path) -> Any:
    deadline = time.monotonic() + DEADLINE_S
    last: Any = None
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"worker exited ({proc.returncode}) before {what}:\n{log_path.read_text()[-3000:]}"
        try:
            last = fn()
        except (OSError, ValueError, KeyError) as exc:  # endpoint not up yet, event file half written
            last = exc
        else:
            if last:
                return last
        time.sleep(0.2)
    raise AssertionError(f"no {what} after {DEADLINE_S}s (last: {last}):\n{log_path.read_text()[-3000:]}")


def _scalars(tb_dir: Path, tag: str) -> list[Any]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not tb_dir.is_dir():
        return []
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return list(acc.Scalars(tag)) if tag in acc.Tags()["scalars"] else []


def _tags(tb_dir: Path, prefix: str) -> list[str]:
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    if not tb_dir.is_dir():
        return []
    acc = EventAccumulator(str(tb_dir))
    acc.Reload()
    return sorted(t for t in acc.Tags()["scalars"] if t.startswith(prefix))


@pytest.fixture(scope="module")
def scenario(worker_data: dict[str, Path], tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    from ps.factory import build_server

    tmp = tmp_path_factory.mktemp("telemetry")
    run_dir = tmp / "run"
    train = {"log_every": 2, "tb_every_steps": 2, "eval_every_steps": 3, "eval_max_rows": 64}
    long_job = make_job(worker_data["meta"], tmp, eval_path=worker_data["meta"], train={**train, "epochs": 200})
    long_cfg = write_job(long_job, tmp / "long.toml")
    server = build_server(long_job.ps, long_job.rpc, long_job.table_configs(), 0, wait_timeout_s=10.0)
    PS_ADDR[:] = [f"127.0.0.1:{server.start('127.0.0.1:0')}"]
    out: dict[str, Any] = {"run_dir": run_dir}
    try:
        # -- incarnation 1: watched live, then killed
        log1, port1 = tmp / "worker-inc1.log", free_port()
        proc = _start(long_cfg, run_dir, log1, port1)
        try:
            first = _poll("a step on /metrics", lambda: _scrape(port1).get("metaps_worker_steps_total", 0) >= 1,
                          proc, log1) and _scrape(port1)
            out["first"] = first
            out["later"] = _poll(
                "the step counter advancing",
                lambda: (m := _scrape(port1))["metaps_worker_steps_total"] > first["metaps_worker_steps_total"] and m,
                proc, log1)
            tb1 = run_dir / "tb" / "worker-0.inc-1"
            out["tb_loss"] = _poll("live TensorBoard train/loss", lambda: len(_scalars(tb1, "train/loss")) >= 2
                                   and _scalars(tb1, "train/loss"), proc, log1)
            out["tb_head_loss"] = _poll("live TensorBoard train/loss/<head>", lambda: _tags(tb1, "train/loss/"),
                                        proc, log1)
            out["tb_auc"] = _poll("a periodic-eval AUC in TensorBoard",
                                  lambda: _scalars(tb1, "eval/adapted/click/auc"), proc, log1)
            out["snapshot"] = _poll("a running snapshot with steps and a periodic evaluation",
                                    lambda: [r for r in read_incarnations(run_dir).get(0, [])
                                             if r.get("state") == "running" and r.get("steps_run", 0) >= 2
                                             and r.get("eval_history")],
                                    proc, log1)
            out["alive_while_read"] = proc.poll() is None
        finally:
            proc.send_signal(signal.SIGKILL)
            proc.wait(timeout=30)
        # -- incarnation 2: the restart (it resumes its step numbering from its PS clock), a few
        # more steps to its end; no eval set, so its end is quick
        reached = max(int(r.get("steps") or 0) for r in read_incarnations(run_dir)[0])
        short_job = make_job(worker_data["meta"], tmp, train={**train, "epochs": 1, "eval_every_steps": 0,
                                                              "max_steps": reached + 5})
        short_cfg = write_job(short_job, tmp / "short.toml")
        out["job"] = short_job
        log2 = tmp / "worker-inc2.log"
        proc2 = _start(short_cfg, run_dir, log2, free_port())
        try:
            out["rc2"] = wait_exit(proc2, log2, timeout_s=DEADLINE_S)
        finally:
            if proc2.poll() is None:
                proc2.kill()
        out["log2"] = log2.read_text()
    finally:
        server.stop(0)
    return out


@pytest.mark.timeout(900)
def test_worker_metrics_advance_while_it_trains(scenario: dict[str, Any]) -> None:
    first, later = scenario["first"], scenario["later"]
    assert later["metaps_worker_steps_total"] > first["metaps_worker_steps_total"] >= 1
    assert later["metaps_worker_samples_total"] > first["metaps_worker_samples_total"] > 0
    assert later["metaps_worker_rows_pulled_total"] > 0 and later["metaps_worker_rows_pushed_total"] > 0
    assert later["metaps_worker_incarnation"] == 1
    assert "metaps_worker_loss{head=all,kind=total}" in later
    # loss per head (meta mode: the query loss of each head is the step's loss of that head)
    heads = {k.split("head=")[1].split(",")[0] for k in later if k.startswith("metaps_worker_loss{")} - {"all"}
    assert len(heads) >= 2, sorted(later)
    for h in heads:
        assert f"metaps_worker_loss{{head={h},kind=total}}" in later and f"metaps_worker_loss{{head={h},kind=query}}" in later
    for phase in ("data_wait", "pull", "compute", "push", "dense_sync", "total"):
        assert later[f"metaps_worker_step_seconds_count{{phase={phase}}}"] >= 1, phase


@pytest.mark.timeout(900)
def test_tensorboard_written_before_the_run_ends(scenario: dict[str, Any]) -> None:
    assert scenario["alive_while_read"]
    steps = [e.step for e in scenario["tb_loss"]]
    # the incarnation's first step, then every tb_every_steps (2)
    assert len(steps) >= 2 and all(s % 2 == 0 for s in steps[1:]) and steps == sorted(steps), steps
    assert len(scenario["tb_head_loss"]) >= 2, scenario["tb_head_loss"]  # train/loss/click, train/loss/conversion
    auc = scenario["tb_auc"]
    assert auc and all(0.0 <= e.value <= 1.0 for e in auc) and all(e.step % 3 == 0 for e in auc)
    # the periodic evaluation runs off the training path (workers.evaluation.PeriodicEval): scored
    # on its own thread over a copy of the model while the worker trains on, and handed over at a
    # later step (inline, it was recorded at the step it scored, with no step done meanwhile)
    points = [p for r in scenario["snapshot"] for p in r["eval_history"]]
    assert points and all(p["thread"] == "periodic-eval" for p in points), points
    assert all(p["recorded_at_step"] > p["step"] and p["steps_during"] >= 0 and p["rows"] > 0 for p in points), points


@pytest.mark.timeout(900)
def test_restarted_worker_counts_every_incarnation(scenario: dict[str, Any]) -> None:
    assert scenario["rc2"] == 0, scenario["log2"][-3000:]
    run_dir, job = scenario["run_dir"], scenario["job"]
    incs = read_incarnations(run_dir)[0]
    assert [r["incarnation"] for r in incs] == [1, 2]
    assert incs[0]["state"] == "running" and incs[1]["state"] == "finished"
    inc1_steps, inc2_steps = incs[0]["steps_run"], incs[1]["steps_run"]
    assert inc1_steps >= 2 and inc2_steps >= 1
    assert (run_dir / "tb" / "worker-0.inc-2").is_dir()

    rep = build_report(run_dir, job, status="succeeded")
    w = rep["workers"][0]
    assert w["steps"] == inc1_steps + inc2_steps
    assert w["samples"] == incs[0]["samples"] + incs[1]["samples"]
    assert {h["incarnation"] for h in w["history"]} == {1, 2}
    assert [i["incarnation"] for i in w["incarnations"]] == [1, 2]
    assert rep["totals"]["steps"] == inc1_steps + inc2_steps and rep["totals"]["incarnations"] == 2
    assert w["eval_history"] and {h["incarnation"] for h in w["eval_history"]} == {1}

    buf = io.StringIO()
    print_summary(Console(file=buf, width=200), rep)
    text = buf.getvalue()
    assert f"steps {inc1_steps + inc2_steps} " in text and "over 2 incarnations" in text, text
    assert "last checkpoint at step" in text, text
