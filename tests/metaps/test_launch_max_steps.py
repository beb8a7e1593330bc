"""``metaps launch --set train.max_steps=N``: the fleet ends when every worker reached its
step limit, with coverage partial by request -- not a wait of up to an hour for shards no
worker will take -- and the ledger claims exactly the batches that were trained.

A real launch (controller, agents, PS, workers on 127.0.0.1), judged on the controller's
ledger and the workers' own step counts. It goes through the Python API (``metaps.api.launch``,
the Launcher ``metaps launch`` runs, with ``overrides`` as ``--set``), so the same fleet also
checks the API's result: the report it returns is report.json, the checkpoint, the umask kept,
and its callbacks and progress lines (issue 38 item 2; a stop asked by one is test_api_notebook's).

The same fleet checks the launch's ports (issue 37, item 6; tests/metaps/test_launch_ports.py
has the refusals): it runs on a busy box where every port picked with
``common.metrics.free_port`` is taken by another process right after the pick (the race
that failed ``test_launch_continue``: "cannot bind gRPC to 127.0.0.1:58561: the port is in
use"), with ``ps.base_port`` set: the shard listens there, and every other server binds a port
of its own and publishes it.
"""

from __future__ import annotations

import contextlib
import io
import json
import os
import socket
from pathlib import Path
from typing import Any, Iterator

import pytest

from metaps import api
from tests.metaps.fleet_data import fleet_pids, kill_leftovers, make_data, write_job_file


@pytest.fixture(scope="module")
def fleet(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    import common.metrics

    tmp = tmp_path_factory.mktemp("max-steps")
    data = make_data(tmp / "data")
    # the fleet trains a model metaps does not ship (docs/examples/two_tower.py, by class_dir): the API's
    # launch, every process's import of the class, the result's in-memory model are the custom model's
    cfg = write_job_file(tmp / "job.toml", data, workers=2, ps=1, train={"epochs": 3},
                         controller={"dds": {"batches_per_shard": 2}},
                         model={"kind": "custom", "class": "two_tower:TwoTower", "hidden": [8],
                                "class_dir": str(Path(__file__).resolve().parents[2] / "docs" / "examples")})
    run = tmp / "run"
    umask = os.umask(0o022)
    os.umask(umask)
    stolen: list[socket.socket] = []

    def pick_then_taken(host: str = "127.0.0.1") -> int:
        """free_port on a busy box: another process takes the port between the pick and the bind."""
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        s.bind((host, 0))
        s.listen()
        stolen.append(s)
        return int(s.getsockname()[1])

    mp = pytest.MonkeyPatch()
    mp.setattr(common.metrics, "free_port", pick_then_taken)
    # held bound (SO_REUSEADDR, not listening: common.ports) so no other process takes it; gRPC can bind it
    base = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    base.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    base.bind(("127.0.0.1", 0))
    base_port = int(base.getsockname()[1])
    events: dict[str, list[Any]] = {"step": [], "eval": [], "checkpoint": []}  # the API's callbacks (issue 38 item 2)
    printed = io.StringIO()
    try:
        with contextlib.redirect_stderr(printed):
            res = api.launch(cfg, overrides={"train.max_steps": 5, "ps.base_port": base_port}, run_dir=run,
                             timeout_s=400, on_step=events["step"].append, on_eval=events["eval"].append,
                             on_checkpoint=events["checkpoint"].append, progress="lines")
        left = fleet_pids(str(run))
    finally:
        mp.undo()
        base.close()
        for s in stolen:
            s.close()
        kill_leftovers(str(run))
    yield {"res": res, "run": run, "left": left, "umask": umask, "base_port": base_port,
           "stolen": len(stolen), "events": events, "printed": printed.getvalue()}


@pytest.mark.timeout(600)
def test_the_api_callbacks_and_progress_follow_the_fleet(fleet: dict[str, Any]) -> None:
    """api.launch's callbacks, driven by the launcher's polls: steps that only advance, every committed
    checkpoint once (the final one last), the final evaluation once; progress lines, then a summary."""
    from metaps.progress import parse_kv_line
    from ps.checkpoint import checkpoint_step

    res, ev, rep = fleet["res"], fleet["events"], fleet["res"].report
    steps = [e.step for e in ev["step"]]
    assert steps and steps == sorted(set(steps)), steps
    assert steps[-1] <= max(w["last_step"] for w in rep["workers"])
    assert all(e.total_steps == 5 and e.fraction is not None and 0.0 <= e.fraction <= 1.0 for e in ev["step"])
    ckpts = [(e.step, e.path) for e in ev["checkpoint"]]
    assert ckpts and ckpts[-1][1] == res.checkpoint, ckpts
    assert all(s == checkpoint_step(p) and (p / "manifest.json").is_file() for s, p in ckpts)
    assert len({p for _, p in ckpts}) == len(ckpts)
    assert [(e.final, dict(e.metrics)) for e in ev["eval"]] == [(True, dict(res.auc))] and res.auc
    lines = [ln for ln in fleet["printed"].splitlines() if parse_kv_line(ln) is None]
    assert lines and all(ln.startswith("launch") for ln in lines), lines
    assert any(" batches (" in ln for ln in lines[:-1]), lines
    assert lines[-1].startswith("launch succeeded: ") and f"checkpoint {res.checkpoint}" in lines[-1], lines[-1]


@pytest.mark.timeout(600)
def test_max_steps_ends_the_fleet_with_partial_coverage_by_request(fleet: dict[str, Any]) -> None:
    res, run, left, umask = fleet["res"], fleet["run"], fleet["left"], fleet["umask"]
    assert res.ok and res.status == "succeeded" and res.exit_code == 0, res.reason
    assert left == []
    assert os.umask(umask) == umask  # the run's 0600/0700 rule was for the call only
    rep = json.loads((run / "report.json").read_text())
    assert res.report == rep and res.run_dir == run.resolve()
    assert rep["config"]["model"]["class"] == "two_tower:TwoTower"
    assert type(res.model).__name__ == "CustomModel" and type(res.model.net).__name__ == "TwoTower"
    assert res.checkpoint is not None and (res.checkpoint / "manifest.json").is_file()
    assert "max_steps" in res.coverage
    assert rep["status"] == "succeeded", rep["reason"]
    # every worker stopped at its limit (step numbers follow the fleet's clock: a worker that
    # joined it late numbers its steps from there)
    assert all(w["last_step"] >= 5 for w in rep["workers"]), [(w["last_step"], w["start_step"]) for w in rep["workers"]]
    cov = rep["controller"]["coverage"]
    assert cov["state"] == "partial_by_request", cov
    assert cov["closed"]["train"] == "every worker stopped training early: max_steps"
    done, total = cov["by_dataset"]["train"]
    assert 0 < done < total == 3 * 17
    # the ledger claims what was trained: a lease cut by the step limit reports where it stopped
    assert cov["samples"] == sum(w["samples"] for w in rep["workers"]), (cov["samples"], rep["workers"])
    assert not cov["problems"] and cov["duplicate_batches"] == 0
    assert cov["by_dataset"]["eval"][0] == cov["by_dataset"]["eval"][1]  # evaluation still covered everything
    assert "train closed: every worker stopped training early: max_steps" in rep["coverage_summary"]
    assert rep["checkpoint"]  # the leader's final checkpoint


@pytest.mark.timeout(600)
def test_every_server_binds_its_own_port_and_a_base_port_is_honoured(fleet: dict[str, Any]) -> None:
    res, run, base_port = fleet["res"], fleet["run"], fleet["base_port"]
    # ports picked up front were taken before the roles bound them: the run did not notice
    assert res.ok, f"{res.reason} (ports taken after a free_port pick: {fleet['stolen']})"
    rep = json.loads((run / "report.json").read_text())
    # [ps] base_port honoured, and job.toml says what was used
    assert rep["config"]["ps"]["base_port"] == base_port
    assert json.loads((run / "ps" / "ps-0.ready").read_text())["port"] == base_port
    ps_nodes = [n for n in rep["controller"]["nodes"] if n["role"] == "ps"]
    assert [n["address"] for n in ps_nodes] == [f"127.0.0.1:{base_port}"], ps_nodes  # what the shard registered
    from metaps.job import load_job

    assert load_job(run / "job.toml").ps.base_port == base_port
    # the controller published the port it bound, and the launcher used it
    ctl = (run / "controller" / "address").read_text().strip()
    assert ctl.startswith("127.0.0.1:") and int(ctl.rpartition(":")[2]) > 0
    # every /metrics endpoint: bound by its process, published, in the report
    ports = rep["metrics_ports"]
    names = {"controller", "ps-0", "agent-ps-0", "worker-0", "worker-1", "agent-worker-0", "agent-worker-1"}
    assert names <= set(ports), ports
    published = {f.stem: json.loads(f.read_text())["port"] for f in (run / "metrics" / "ports").glob("*.json")}
    published["ps-0"] = json.loads((run / "ps" / "ps-0.ready").read_text())["metrics_port"]
    assert {n: ports[n] for n in names} == {n: published[n] for n in names}
    assert len({ports[n] for n in names}) == len(names) and all(ports[n] > 0 for n in names)
    # the run succeeded: its Prometheus targets are gone (no MetapsTargetDown for processes that ended well;
    # mid-run every endpoint is a target: test_coverage_honest)
    assert json.loads((run / "metrics" / "targets.json").read_text()) == []
