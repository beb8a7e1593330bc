"""The all-reduce variant of the manifests runs to completion in pods (tests.deploy.podsim).

``[train] dense_sync = "allreduce"`` renders the worker Job as an Indexed Job (completions =
parallelism = ``[train] workers``) whose pods find rank 0's gloo rendezvous through the
headless Service (``NAME-worker-0.NAME-worker``, ``$METAPS_ALLREDUCE``); ranks are the Job's
completion indexes. One small fleet (data Job, controller, 1 PS shard, 2 workers) trains to
the end: every Job completes, the controller's outcome is ``complete`` with complete coverage,
both ranks joined the one all-reduce group and the checkpoint leader wrote the final
checkpoint. Wiring alone (no run) is in test_k8s_manifests.py.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path
from typing import Any

import pytest

from meta_io.synth.generator import GeneratorConfig, generate
from common.toml_writer import write
from tests.deploy.podsim import PodSim, netns_available, tail
from metaps.run_report import read_worker_reports
from tests.deploy.pods import closing_shown, pod_env, render, train_to_completion



def _job_file(path: Path) -> Path:
    return write(path, {
        "data": {"train": "metaio/train"},
        "ps": {"shards": 1, "num_vshards": 8, "device": "cpu", "table_defaults": {"dim": 8, "capacity": 4096}},
        "model": {"kind": "dnn", "default_dim": 8, "hidden": [16, 8]},
        "meta": {"inner_steps": 1, "inner_lr": 0.1},
        "train": {"mode": "meta", "workers": 2, "epochs": 2, "overlap": False, "log_every": 5,
                  "dense_sync": "allreduce", "allreduce_port": 29511},
        # the default hang rule (120 s): a worker told to WAIT at an epoch's tail joins the all-reduce
        # steps idle (tests/workers/test_allreduce_wait.py); it used to block them until that rule fired
        "controller": {"tick_s": 0.2, "checkpoint_interval_s": 5.0,
                       "dds": {"batches_per_shard": 2}, "agent": {"heartbeat_s": 1.0}},
        "rpc": {"timeout_s": 20.0},
        "run": {"dir": "runs", "name": "ar"},
        "deploy": {"name": "mar", "data_input": "raw/train", "data_schema": "raw/train/schema.json",
                   "deliver_schedule": ""},  # no delivery CronJob: training only
    })


def _render(tmp: Path) -> list[dict[str, Any]]:
    return render(_job_file(tmp / "job.toml"), tmp / "manifests")


@pytest.mark.timeout(600)
def test_the_allreduce_fleet_runs_to_completion_in_pods(tmp_path: Path) -> None:
    assert netns_available(), ("this test runs pods in network + mount namespaces: it needs root, iproute2 "
                               "and unshare (the manifests' wiring is still checked by test_k8s_manifests.py)")
    docs = _render(tmp_path)
    workers = [d for d in docs if d["kind"] == "Job" and d["metadata"]["name"] == "mar-worker"][0]
    assert workers["spec"]["completionMode"] == "Indexed"
    sim = PodSim(docs, tmp_path / "sim", env=pod_env(), subnet="10.237.0")
    t0 = time.monotonic()
    with closing_shown(sim):
        data = sim.root / "pvc" / "mar-data"
        generate(data / "raw" / "train", GeneratorConfig(rows=1500, users=100, items=150, seed=7, n_files=1,
                                                          row_group_rows=1500), progress=False)
        # a rank that fails (e.g. gloo cannot reach its peer) is a failed pod: judged at once
        train_to_completion(sim, "mar")
        ranks = sorted(p.index for p in sim.job_pods("mar-worker") if p.phase == "Succeeded" and p.index is not None)
        assert ranks == [0, 1]
        for p in sim.job_pods("mar-worker"):  # one gloo group of both ranks, met through the Service name
            assert "joined all-reduce group" in p.log_path.read_text(), tail(p.log_path)
        reports = list(read_worker_reports(data / "runs" / "ar").values())
        final = [r for r in reports if r.get("final")]
        assert len(final) == 1 and final[0]["checkpoint"], [(r["rank"], r.get("final")) for r in reports]
        sys.stderr.write(f"[allreduce pods] complete in {time.monotonic() - t0:.1f}s\n")
