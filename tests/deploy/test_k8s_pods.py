"""The generated manifests run, pod by pod, in network namespaces (tests.deploy.podsim).

One fleet run from ``kubectl kustomize`` output, with nothing taken from the job file
directly: the data Job builds Meta-IO on the shared volume, the controller Job, the PS
Indexed Job (2 shards) and worker work-queue Job (2 workers) train to completion with
coverage 100%. Mid-run a node drain evicts PS 1: its preStop hook has the controller take a
checkpoint cut first, its PodDisruptionBudget refuses a second eviction meanwhile, the Job
replaces the pod (a new pod, uid and address, the same shard
and DNS name, and -- in a fresh PID namespace -- the same pid 1), and the controller
recovers it as a new incarnation; then PS 0 hangs (SIGSTOP): its liveness probe (periods
scaled 5x down) fails 6 times, the container is killed (137), the Job replaces the pod and
the controller recovers it too; the worker Job is scaled up by one (the newcomer trains)
and down by one (the Job controller's pick goes, whichever index it holds: its shards are requeued,
none lost, and if it was the checkpoint leader another takes over). When the run ends
the controller stops the PS and exits: all three Jobs complete, nothing holds a node.
The delivery CronJob's command, run once, publishes a bundle. Every container runs as
the manifests' uid/gid 10001 with fsGroup 10001 (checked in /proc), and what the data Job
wrote to the shared volume is that user's.

Where namespaces cannot be created (not root, no iproute2), this test cannot run the
pods and fails with a message saying so: the render/validate tests
(test_k8s_manifests.py) still cover the wiring. (test_multi_host.py falls back to
loopback addresses; pods need their own network and mount namespaces, which have no
loopback equivalent.)
"""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from meta_io.synth.generator import GeneratorConfig, generate
from tests.deploy.podsim import PodSim, netns_available, tail
from metaps.run_report import read_worker_reports
from common.toml_writer import write
from tests.deploy.pods import pod_env, render as render_manifests, show_pods
from tests.metaps.fleet_data import wait_for



def job_file(path: Path) -> Path:
    """A small PS-mode job; every path is relative to the pods' working directory (the shared volume)."""
    return write(path, {
        "data": {"train": "metaio/train"},
        "ps": {"shards": 2, "num_vshards": 16, "device": "cpu",
               "table_defaults": {"dim": 8, "capacity": 8192}},
        "model": {"kind": "dnn", "default_dim": 8, "hidden": [16, 8]},
        "meta": {"inner_steps": 1, "inner_lr": 0.1},
        "train": {"mode": "meta", "workers": 2, "epochs": 20, "overlap": False, "log_every": 5},
        # frozen workers (SIGSTOP below) keep their registration (heartbeat timeout) but lose
        # their leases after lease_s: the newcomer gets their shards
        "controller": {"heartbeat_timeout_s": 300.0, "tick_s": 0.2, "checkpoint_interval_s": 2.0,
                       "dds": {"batches_per_shard": 2, "lease_s": 8.0}, "monitor": {"window_s": 1.0},
                       "agent": {"heartbeat_s": 1.0}},
        "rpc": {"timeout_s": 20.0},
        # the CronJob gates on [delivery] holdout (here the training data: the gate runs, and a
        # first bundle has no previous AUC to drop from)
        "delivery": {"out": "bundles", "holdout": "metaio/train", "holdout_rows": 400},
        "run": {"dir": "runs", "name": "k8s"},
        "deploy": {"name": "mps", "data_input": "raw/train", "data_schema": "raw/train/schema.json",
                   "deliver_schedule": "*/30 * * * *", "deliver_args": ["--keep", "3"]},
    })


def _events(state_dir: Path) -> list[dict[str, Any]]:
    """The controller's event log, read from its LMDB state after it exited."""
    from controller.state import EventLog, StateStore

    store = StateStore(state_dir)
    try:
        return [e.__dict__ for e in EventLog(store).list()]
    finally:
        store.close()


def _ids(pid: int) -> dict[str, list[int]]:
    """Uid / Gid (real, effective, saved, fs) and supplementary Groups of a process."""
    out = {}
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        key, _, rest = line.partition(":")
        if key in ("Uid", "Gid", "Groups"):
            out[key] = [int(x) for x in rest.split()]
    return out


def render(tmp: Path) -> tuple[list[dict[str, Any]], str]:
    out = tmp / "manifests"
    return render_manifests(job_file(tmp / "job.toml"), out), (out / "token").read_text().strip()


@pytest.mark.timeout(900)
def test_the_fleet_runs_from_the_manifests_in_pods(tmp_path: Path) -> None:
    assert netns_available(), ("this test runs pods in network + mount namespaces: it needs root, iproute2 "
                               "and unshare (the manifests' wiring is still checked by test_k8s_manifests.py)")
    docs, token = render(tmp_path)
    t0 = time.monotonic()

    def phase(what: str) -> None:  # where the time goes, with -s
        sys.stderr.write(f"[k8s e2e {time.monotonic() - t0:6.1f}s] {what}\n")

    # probes 5x faster than written: liveness gives up on a hung PS after 6 x 2 s, not 6 x 10 s
    sim = PodSim(docs, tmp_path / "sim", env=pod_env(), probe_time_scale=5.0)
    try:
        data = sim.root / "pvc" / "mps-data"
        generate(data / "raw" / "train", GeneratorConfig(rows=3000, users=150, items=200, seed=5, n_files=1,
                                                          row_group_rows=3000), progress=False)
        # kubectl apply -k: everything at once; training pods wait for the data in an init container
        for w in ("mps-data", "mps-controller", "mps-ps", "mps-worker"):
            sim.start_workload(w)
        ctl = sim.job_pods("mps-controller")[0]

        def ps_pod(k: int) -> str:
            pod = sim.index_pod("mps-ps", k)
            assert pod is not None, f"no pod of PS index {k}"
            return pod.name

        for name in [ctl.name, ps_pod(0), ps_pod(1)]:
            sim.wait_ready(name, 400)
        assert sim.job_complete("mps-data")
        phase("controller and PS ready")
        # runAsUser/runAsGroup/fsGroup: the containers' processes are uid 10001, not root, and what
        # the data Job's pod wrote to the shared volume is theirs, in the volume's fsGroup
        for name in [ctl.name, ps_pod(0)]:
            assert _ids(sim.container_pid(name)) == {"Uid": [10001] * 4, "Gid": [10001] * 4, "Groups": [10001]}
        built = (data / "metaio" / "train").stat()
        assert (built.st_uid, built.st_gid) == (10001, 10001)
        assert data.stat().st_mode & 0o2070 == 0o2070, oct(data.stat().st_mode)  # OnRootMismatch: g+rwx, setgid
        ctl_addr = f"{ctl.ip}:7070"

        def status() -> dict[str, Any]:
            st = sim.controller_status(ctl_addr, token)
            assert "error" not in st, st
            return st

        def nodes() -> dict[tuple[str, int], dict[str, Any]]:
            return {(n["role"], n["index"]): n for n in status()["nodes"]}

        # identity: shards from the Job's completion index, registered under their stable DNS names
        wait_for(lambda: {("ps", 0), ("ps", 1)} <= set(nodes()), 120, "both PS shards registered")
        assert nodes()[("ps", 1)]["address"] == "mps-ps-1.mps-ps:5000"

        # After the first committed checkpoint the two workers are held (SIGSTOP: the test's way to
        # be sure shards are left for a newcomer whatever this machine's speed), then a node drain
        # evicts PS 1 and the worker Job is scaled up by one.
        wait_for(lambda: any(c.get("state") == "committed" for c in status()["checkpoints"]), 300,
                 "a committed checkpoint")
        phase("first checkpoint committed")
        old_ps1 = sim.pods[ps_pod(1)]
        assert sim.evict_pod(old_ps1.name)
        assert not sim.evict_pod(ps_pod(0)), "the PDB (maxUnavailable 1) lets a drain take one PS at a time"
        # its preStop hook has the controller take a cut while the shard still serves

        def pre_stop_cut() -> str:
            st = status()
            asked = [e for e in st["events"] if e["kind"] == "checkpoint"
                     and e["evidence"].get("reason", "").startswith("preStop")]
            cuts = {c["cut_id"]: c for c in st["checkpoints"]}
            return cuts[asked[-1]["evidence"]["cut_id"]]["state"] if asked else ""

        wait_for(lambda: pre_stop_cut() == "committed", 60, "the preStop cut committed")
        held = [p.name for p in sim.job_pods("mps-worker")]
        for name in held:  # at once: the workers must leave shards for the newcomer below
            sim.signal_container(name, signal.SIGSTOP)
        wait_for(lambda: old_ps1.pre_stop_exits, 60, "PS 1's preStop hook")
        assert old_ps1.pre_stop_exits == [0], tail(old_ps1.log_path)
        assert not status()["finished"], "the job finished before the workers could be held: make it longer"
        # a new pod for index 1: new name, uid and address; same shard and DNS name
        wait_for(lambda: ps_pod(1) != old_ps1.name, 120, "the Job to replace PS 1's pod")
        new_ps1 = sim.pods[ps_pod(1)]
        sim.wait_ready(new_ps1.name, 300)
        wait_for(lambda: any(e["kind"] == "ps_recovery" and e["node"] == "ps:1" for e in status()["events"]),
                 300, "the controller's PS recovery")
        ps1 = nodes()[("ps", 1)]
        phase("PS recovered")
        assert ps1["address"] == "mps-ps-1.mps-ps:5000" and ps1["state"] == "alive"
        assert old_ps1.exit_codes == [143] and old_ps1.phase == "Deleted"  # not counted as the index complete
        restarted = [e for e in status()["events"] if e["kind"] == "ps_restarted" and e["node"] == "ps:1"]
        assert restarted, "a replaced pod is a new incarnation"
        ev = restarted[-1]["evidence"]
        # the pid says nothing (pid 1 in both PID namespaces); the incarnation id and pod uid do
        assert ev["pid"] == ev["previous_pid"] == 1, ev
        assert (ev["pod_uid"], ev["previous_pod_uid"]) == (new_ps1.uid, old_ps1.uid)
        assert ev["incarnation_id"] != ev["previous_incarnation_id"]

        # A hung PS (SIGSTOP: its port still accepts, nothing answers): the liveness probe fails 6
        # times in a row, the kubelet kills the container (SIGTERM is not acted on, SIGKILL after the
        # grace period: 137), the Job replaces the pod and the controller recovers a new incarnation.
        old_ps0 = sim.pods[ps_pod(0)]
        sim.signal_container(old_ps0.name, signal.SIGSTOP)
        wait_for(lambda: ps_pod(0) != old_ps0.name, 120, "liveness to kill the hung PS 0 and the Job to replace it")
        assert old_ps0.probe_kills == ["liveness"] and old_ps0.exit_codes == [137], \
            (old_ps0.probe_kills, old_ps0.exit_codes)
        new_ps0 = sim.pods[ps_pod(0)]
        sim.wait_ready(new_ps0.name, 300)
        wait_for(lambda: any(e["kind"] == "ps_recovery" and e["node"] == "ps:0" for e in status()["events"]),
                 300, "the controller's recovery of PS 0")
        ev0 = [e for e in status()["events"] if e["kind"] == "ps_restarted" and e["node"] == "ps:0"][-1]["evidence"]
        assert (ev0["pod_uid"], ev0["previous_pod_uid"]) == (new_ps0.uid, old_ps0.uid), ev0
        phase("hung PS 0 killed by liveness and recovered")
        sim.scale_job("mps-worker", 3)
        # the newcomer claims index 2 and trains on the shards the held workers' leases gave back
        wait_for(lambda: ("worker", 2) in nodes() and nodes()[("worker", 2)]["step"] > 0, 300,
                 "worker 2 (the newcomer) training")
        # scale down by one: the Job controller's pick (the most recently started) is deleted; it reports
        # itself down, its shards are requeued
        before = {p.name for p in sim.job_pods("mps-worker") if p.phase == "Running"}
        sim.scale_job("mps-worker", 2)
        gone = [p for p in sim.job_pods("mps-worker") if p.name in before and p.scaled_down]
        assert len(gone) == 1
        phase(f"scaled down: {gone[0].name} deleted")
        if gone[0].name in held:
            sim.signal_container(gone[0].name, signal.SIGCONT)  # a stopped process acts on SIGTERM once resumed
        wait_for(lambda: any(e["kind"] == "node_down" and e["evidence"].get("exit_code") == 143
                             for e in status()["events"]), 120, "the deleted worker's NodeDown")
        for name in held:
            if name != gone[0].name:
                sim.signal_container(name, signal.SIGCONT)
        phase("scaled down")

        wait_for(lambda: sim.job_complete("mps-worker"), 600, "the worker Job to complete")
        phase("worker Job complete")
        # the run ended: the controller stopped the PS and exited; every Job completed
        wait_for(lambda: sim.job_complete("mps-ps") and sim.job_complete("mps-controller"), 180,
                 "the PS and controller Jobs to complete")
        assert [p.exit_codes[-1] for p in sim.job_pods("mps-controller")] == [0]
        final_ps = [sim.index_pod("mps-ps", k) for k in (0, 1)]
        assert all(p is not None and p.phase == "Succeeded" for p in final_ps)
        outcome = json.loads(sim.termination_message(sim.job_pods("mps-controller")[0].name))
        assert (outcome["run"], outcome["coverage"]) == ("complete", "complete"), outcome
        assert sim.job_status("mps-worker") == "Complete"
        run = data / "runs" / "k8s"
        reports = list(read_worker_reports(run).values())
        final = [r for r in reports if r.get("final")]
        assert len(final) == 1 and final[0]["checkpoint"], [(r["rank"], r.get("final")) for r in reports]
        assert list((run / "checkpoints").glob("ckpt-*"))
        state = sim.root / "pvc" / "mps-controller-state" / "runs" / "k8s"  # one state dir per run name
        led = [e for e in _events(state) if e["kind"] == "final_checkpoint"]
        assert led and led[-1]["evidence"]["worker"] == final[0]["rank"]

        # the delivery CronJob's command, once
        pod = sim.trigger_cronjob("mps-deliver")
        wait_for(lambda: pod.phase in ("Succeeded", "Failed"), 300, "the delivery pod")
        assert pod.phase == "Succeeded", tail(pod.log_path)
        latest = (data / "bundles" / "LATEST").read_text().strip()
        phase("delivered")
        assert (data / "bundles" / latest).is_dir()
    except BaseException:
        show_pods(sim)
        raise
    finally:
        sim.close()
        phase("torn down")
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert sim.tag not in left, f"namespaces left behind: {left}"
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f"v{sim.tag}" not in links, "veths left behind"
