"""``metaps launch --set train.max_steps=N``: the fleet ends when every worker reached its
step limit, with coverage partial by request -- not a wait of up to an hour for shards no
worker will take -- and the ledger claims exactly the batches that were trained.

A real launch (controller, agents, PS, workers on 127.0.0.1), judged on the controller's
ledger and the workers' own step counts. It goes through the Python API (``metaps.api.launch``,
the Launcher ``metaps launch`` runs, with ``overrides`` as ``--set``), so the same fleet also
checks the API's result: the report it returns is report.json, the checkpoint, the umask kept.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from metaps import api
from tests.metaps.fleet_data import fleet_pids, kill_leftovers, make_data, write_job_file


@pytest.mark.timeout(600)
def test_max_steps_ends_the_fleet_with_partial_coverage_by_request(tmp_path: Path) -> None:
    data = make_data(tmp_path / "data")
    cfg = write_job_file(tmp_path / "job.toml", data, workers=2, ps=1, train={"epochs": 3},
                         controller={"dds": {"batches_per_shard": 2}})
    run = tmp_path / "run"
    umask = os.umask(0o022)
    os.umask(umask)
    try:
        res = api.launch(cfg, overrides={"train.max_steps": 5}, run_dir=run, timeout_s=400)
        left = fleet_pids(str(run))
    finally:
        kill_leftovers(str(run))
    assert res.ok and res.status == "succeeded" and res.exit_code == 0, res.reason
    assert left == []
    assert os.umask(umask) == umask  # the run's 0600/0700 rule was for the call only
    rep = json.loads((run / "report.json").read_text())
    assert res.report == rep and res.run_dir == run.resolve()
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
