"""The all-reduce variant of the manifests, as one JobSet, runs to completion in pods (tests.deploy.podsim).

``[train] dense_sync = "allreduce"`` renders the workers as an Indexed Job (completions =
parallelism = ``[train] workers``) whose pods find rank 0's gloo rendezvous through the
headless Service; ranks are the Job's completion indexes. Here the manifests are the JobSet
variant (``[deploy] api = "jobset"``, :mod:`metaps.deploy.jobset`): one JobSet whose
replicated jobs (data, controller, PS, workers) run the Jobs variant's pods, the JobSet
controller creating them in order (each once the one before is ready) and the child Jobs
named ``mar-ROLE-0``, so rank 0 is met at ``mar-worker-0-0.mar-worker`` and the PS at
``mar-ps-0-0.mar-ps``. One small fleet (data step, controller, 1 PS shard, 2 workers) trains
to the end; after the first committed cut the PS pod crashes (SIGKILL, with the workers
held by SIGSTOP so the run cannot end first): its child Job replaces the pod (exit 137, one
counted failure), the new pod is reached at the same name and the controller recovers it to
the cut as a new incarnation. Judged: the JobSet completes by its success policy with no
restart and no other failed pod, the controller's outcome is ``complete``
with complete coverage, both ranks joined the one all-reduce group and the checkpoint
leader wrote the final checkpoint. The Jobs variant runs in pods in test_k8s_pods.py
(PS mode) and test_k8s_pods_per_role.py; the JobSet's failure policy and restarts in
test_k8s_jobset.py; wiring alone (no run) in test_k8s_manifests.py and test_k8s_jobset.py.
"""

from __future__ import annotations

import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from meta_io.synth.generator import GeneratorConfig, generate
from common.toml_writer import write
from tests.deploy.podsim import PodSim, netns_available, tail
from metaps.run_report import read_worker_reports
from tests.deploy.pods import closing_shown, pod_env, render
from tests.metaps.fleet_data import wait_for


def _job_file(path: Path) -> Path:
    return write(path, {
        "data": {"train": "metaio/train"},
        "ps": {"shards": 1, "num_vshards": 8, "device": "cpu", "table_defaults": {"dim": 8, "capacity": 4096}},
        "model": {"kind": "dnn", "default_dim": 8, "hidden": [16, 8]},
        "meta": {"inner_steps": 1, "inner_lr": 0.1},
        "train": {"mode": "meta", "workers": 2, "epochs": 10, "overlap": False, "log_every": 5,
                  "dense_sync": "allreduce", "allreduce_port": 29511},
        # the default hang rule (120 s): a worker told to WAIT at an epoch's tail joins the all-reduce
        # steps idle (tests/workers/test_allreduce_wait.py); it used to block them until that rule fired
        "controller": {"tick_s": 0.2, "checkpoint_interval_s": 1.0,
                       "dds": {"batches_per_shard": 2}, "agent": {"heartbeat_s": 1.0}},
        "rpc": {"timeout_s": 20.0},
        "run": {"dir": "runs", "name": "ar"},
        "deploy": {"name": "mar", "data_input": "raw/train", "data_schema": "raw/train/schema.json",
                   "deliver_schedule": "", "api": "jobset"},  # no delivery CronJob: training only
    })


@pytest.mark.timeout(600)
def test_the_allreduce_jobset_runs_to_completion_in_pods_through_a_ps_crash(tmp_path: Path) -> None:
    assert netns_available(), ("this test runs pods in network + mount namespaces: it needs root, iproute2 "
                               "and unshare (the manifests' wiring is still checked by test_k8s_manifests.py)")
    docs = render(_job_file(tmp_path / "job.toml"), tmp_path / "manifests")
    token = (tmp_path / "manifests" / "token").read_text().strip()
    jobset = [d for d in docs if d["kind"] == "JobSet"][0]
    workers = [r for r in jobset["spec"]["replicatedJobs"] if r["name"] == "worker"][0]["template"]
    assert workers["spec"]["completionMode"] == "Indexed" and not [d for d in docs if d["kind"] == "Job"]
    sim = PodSim(docs, tmp_path / "sim", env=pod_env(), subnet="10.237.0")
    t0 = time.monotonic()

    def phase(what: str) -> None:  # where the time goes, with -s
        sys.stderr.write(f"[allreduce jobset {time.monotonic() - t0:6.1f}s] {what}\n")

    with closing_shown(sim):
        data = sim.root / "pvc" / "mar-data"
        generate(data / "raw" / "train", GeneratorConfig(rows=1500, users=100, items=150, seed=7, n_files=1,
                                                          row_group_rows=1500), progress=False)
        sim.start_jobset("mar")
        wait_for(lambda: sim.job_pods("mar-controller-0") or sim.jobset_status("mar") != "Running", 120,
                 "the controller's Job")
        ctl = sim.job_pods("mar-controller-0")[0]

        def status() -> dict[str, Any]:
            st = sim.controller_status(f"{ctl.ip}:7070", token)
            assert "error" not in st, st
            return st

        crashed: list[str] = []  # the PS pod this test kills

        def failed() -> list[str]:
            return [p.name for p in sim.pods.values() if p.phase == "Failed" and p.name not in crashed]

        # a rank that fails (e.g. gloo cannot reach its peer) is a failed pod: judged at once
        wait_for(lambda: failed() or sim.jobset_status("mar") != "Running"
                 or any(c.get("state") == "committed" for c in status()["checkpoints"]), 300, "a committed cut")
        assert not failed() and sim.jobset_status("mar") == "Running", (failed(), sim.jobsets["mar"].reason)
        phase("first cut committed")
        held = [p for p in sim.job_pods("mar-worker-0") if not p.ended]
        for p in held:  # the run must not end before the PS is back
            sim.signal_container(p.name, signal.SIGSTOP)
        assert not status()["finished"], "the run finished before the workers could be held: make it longer"
        old = sim.index_pod("mar-ps-0", 0)
        assert old is not None
        crashed.append(old.name)
        sim.kill_container(old.name)  # SIGKILL: exit 137, a pod failure the Job counts (no preStop cut)
        wait_for(lambda: sim.index_pod("mar-ps-0", 0) is not old, 120, "the child Job to replace the PS pod")
        new = sim.index_pod("mar-ps-0", 0)
        assert new is not None
        sim.wait_ready(new.name, 300)
        wait_for(lambda: any(e["kind"] == "ps_recovery" and e["node"] == "ps:0" for e in status()["events"]),
                 300, "the controller's PS recovery")
        ev = [e for e in status()["events"] if e["kind"] == "ps_restarted" and e["node"] == "ps:0"][-1]["evidence"]
        assert (ev["pod_uid"], ev["previous_pod_uid"]) == (new.uid, old.uid), ev
        assert nodes_address(status(), "ps", 0) == "mar-ps-0-0.mar-ps:5000"  # the JobSet child's hostname
        phase("PS recovered")
        for p in held:
            sim.signal_container(p.name, signal.SIGCONT)

        wait_for(lambda: failed() or sim.jobset_status("mar") != "Running", 300, "the JobSet to end")
        js = sim.jobsets["mar"]
        assert not failed() and (js.status, js.restarts) == ("Completed", 0), (failed(), js.status, js.reason)
        assert sim.job_status("mar-worker-0") == "Complete"
        phase("JobSet complete")
        # the controller ended the run and wrote its outcome; the JobSet deleted the child Jobs still
        # active (the PS, if the controller's stop had not reached it yet): nothing holds a node
        wait_for(lambda: ctl.ended, 120, "the controller pod to end")
        assert {sim.job_status("mar-ps-0"), sim.job_status("mar-controller-0")} <= {"Complete", "Deleted"}
        assert all(p.ended or p.deleting for p in sim.pods.values())
        assert old.exit_codes == [137] and old.phase == "Failed" and sim.jobs["mar-ps-0"].failures == 1
        outcome = json.loads(sim.termination_message(ctl.name))
        assert (outcome["run"], outcome["coverage"]) == ("complete", "complete"), outcome
        ranks = sorted(p.index for p in sim.job_pods("mar-worker-0") if p.phase == "Succeeded" and p.index is not None)
        assert ranks == [0, 1]
        for p in sim.job_pods("mar-worker-0"):  # one gloo group of both ranks, met through the Service name
            assert "joined all-reduce group" in p.log_path.read_text(), tail(p.log_path)
        reports = list(read_worker_reports(data / "runs" / "ar").values())
        final = [r for r in reports if r.get("final")]
        assert len(final) == 1 and final[0]["checkpoint"], [(r["rank"], r.get("final")) for r in reports]
        phase("judged")


def nodes_address(st: dict[str, Any], role: str, index: int) -> str:
    """The address a node registered with the controller under."""
    return [n for n in st["nodes"] if (n["role"], n["index"]) == (role, index)][0]["address"]
