"""The generated manifests run, pod by pod, in network namespaces (metaps.deploy.podsim).

One fleet run from ``kubectl kustomize`` output, with nothing taken from the job file
directly: the data Job builds Meta-IO on the shared volume, the controller Deployment,
PS StatefulSet (2 shards) and worker work-queue Job (2 workers) train to completion with
coverage 100%; mid-run a PS container is SIGKILLed and comes back with the same identity
(pod name, DNS name, shard) through the controller's recovery; the worker Job is scaled
up by one (the newcomer claims index 2 and trains) and down by one (the leaver's shards
are requeued, none lost); the delivery CronJob's command, run once, publishes a bundle.

Where namespaces cannot be created (not root, no iproute2), this test cannot run the
pods and fails with a message saying so: the render/validate tests
(test_k8s_manifests.py) still cover the wiring. (test_multi_host.py falls back to
loopback addresses; pods need their own network and mount namespaces, which have no
loopback equivalent.)
"""

from __future__ import annotations

import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from meta_io.synth.generator import GeneratorConfig, generate
from metaps.deploy.podsim import PodSim, netns_available, tail
from metaps.core.toml_writer import write
from tests.metaps.fleet_data import wait_for

REPO = Path(__file__).resolve().parents[2]


def job_file(path: Path) -> Path:
    """A small PS-mode job; every path is relative to the pods' working directory (the shared volume)."""
    return write(path, {
        "data": {"train": "metaio/train"},
        "ps": {"shards": 2, "num_vshards": 16, "device": "cpu",
               "table_defaults": {"dim": 8, "capacity": 8192}},
        "model": {"kind": "dnn", "default_dim": 8, "hidden": [16, 8]},
        "meta": {"inner_steps": 1, "inner_lr": 0.1},
        "train": {"mode": "meta", "workers": 2, "epochs": 6, "overlap": False, "log_every": 5},
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


def render(tmp: Path) -> tuple[list[dict[str, Any]], str]:
    out = tmp / "manifests"
    r = subprocess.run([sys.executable, "-m", "metaps", "deploy", "k8s", "--config", str(job_file(tmp / "job.toml")),
                        "--image", "local/metaps:test", "--out", str(out)], capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    k = subprocess.run(["kubectl", "kustomize", str(out)], capture_output=True, text=True, timeout=120)
    assert k.returncode == 0, k.stderr
    return [d for d in yaml.safe_load_all(k.stdout) if d], (out / "token").read_text().strip()


@pytest.mark.timeout(900)
def test_the_fleet_runs_from_the_manifests_in_pods(tmp_path: Path) -> None:
    assert netns_available(), ("this test runs pods in network + mount namespaces: it needs root, iproute2 "
                               "and unshare (the manifests' wiring is still checked by test_k8s_manifests.py)")
    docs, token = render(tmp_path)
    t0 = time.monotonic()

    def phase(what: str) -> None:  # where the time goes, with -s
        sys.stderr.write(f"[k8s e2e {time.monotonic() - t0:6.1f}s] {what}\n")

    sim = PodSim(docs, tmp_path / "sim", env={"PYTHONPATH": str(REPO)})
    try:
        data = sim.root / "pvc" / "mps-data"
        generate(data / "raw" / "train", GeneratorConfig(rows=3000, users=150, items=200, seed=5, n_files=1,
                                                          row_group_rows=3000), progress=False)
        # kubectl apply -k: everything at once; training pods wait for the data in an init container
        for w in ("mps-data", "mps-controller", "mps-ps", "mps-worker"):
            sim.start_workload(w)
        ctl = sim.job_pods("mps-controller")[0]
        for pod in [ctl.name, "mps-ps-0", "mps-ps-1"]:
            sim.wait_ready(pod, 400)
        assert sim.job_complete("mps-data")
        phase("controller and PS ready")
        ctl_addr = f"{ctl.ip}:7070"

        def status() -> dict[str, Any]:
            st = sim.controller_status(ctl_addr, token)
            assert "error" not in st, st
            return st

        def nodes() -> dict[tuple[str, int], dict[str, Any]]:
            return {(n["role"], n["index"]): n for n in status()["nodes"]}

        # identity: shards from the StatefulSet ordinals, registered under their stable DNS names
        wait_for(lambda: {("ps", 0), ("ps", 1)} <= set(nodes()), 120, "both PS shards registered")
        assert nodes()[("ps", 1)]["address"] == "mps-ps-1.mps-ps:5000"

        # After the first committed checkpoint the two workers are held (SIGSTOP: the test's way to
        # be sure shards are left for a newcomer whatever this machine's speed), then a PS container
        # is SIGKILLed and the worker Job scaled up by one.
        wait_for(lambda: any(c.get("state") == "committed" for c in status()["checkpoints"]), 300,
                 "a committed checkpoint")
        held = [p.name for p in sim.job_pods("mps-worker")]
        phase("first checkpoint committed")
        for name in held:
            sim.signal_container(name, signal.SIGSTOP)
        assert not status()["finished"]
        old_pid = sim.kill_container("mps-ps-1")
        sim.scale_job("mps-worker", 3)
        # the PS comes back in the same pod: same name, DNS name and shard, a new process
        wait_for(lambda: sim.pods["mps-ps-1"].restarts >= 1, 60, "the PS container restarted")
        sim.wait_ready("mps-ps-1", 300)
        wait_for(lambda: any(e["kind"] == "ps_recovery" and e["node"] == "ps:1" for e in status()["events"]),
                 300, "the controller's PS recovery")
        ps1 = nodes()[("ps", 1)]
        phase("PS recovered")
        assert ps1["address"] == "mps-ps-1.mps-ps:5000" and ps1["state"] == "alive"
        restarted = [e for e in status()["events"] if e["kind"] == "ps_restarted" and e["node"] == "ps:1"]
        assert restarted and restarted[-1]["evidence"]["previous_pid"] == old_pid
        # the newcomer claims index 2 and trains on the shards the held workers' leases gave back
        wait_for(lambda: ("worker", 2) in nodes() and nodes()[("worker", 2)]["step"] > 0, 300,
                 "worker 2 (the newcomer) training")
        # scale down by one: the newest pod is deleted; it reports itself down, its shards are requeued
        sim.scale_job("mps-worker", 2)
        phase("newcomer trained")
        wait_for(lambda: any(e["kind"] == "node_down" and e["node"] == "worker:2" for e in status()["events"]),
                 120, "worker 2's NodeDown")
        down = [e for e in status()["events"] if e["kind"] == "node_down" and e["node"] == "worker:2"][-1]
        assert down["evidence"]["exit_code"] == 143
        for name in held:
            sim.signal_container(name, signal.SIGCONT)
        phase("scaled down")

        wait_for(lambda: sim.job_complete("mps-worker"), 600, "the worker Job to complete")
        final = status()
        phase("worker Job complete")
        assert final["finished"]
        cov = final["coverage"]
        assert cov["complete"] and cov["fraction"] == 1.0, cov
        worker_pods = sim.job_pods("mps-worker")
        assert len(worker_pods) == 3 and sum(p.phase == "Succeeded" for p in worker_pods) == 2
        run = data / "runs" / "k8s"
        assert (run / "workers" / "worker-0.json").is_file() and list((run / "checkpoints").glob("ckpt-*"))

        # the delivery CronJob's command, once
        pod = sim.trigger_cronjob("mps-deliver")
        wait_for(lambda: pod.phase in ("Succeeded", "Failed"), 300, "the delivery pod")
        assert pod.phase == "Succeeded", tail(pod.log_path)
        latest = (data / "bundles" / "LATEST").read_text().strip()
        phase("delivered")
        assert (data / "bundles" / latest).is_dir()
    except BaseException:
        for p in sim.pods.values():
            sys.stderr.write(f"--- {p.name} ({p.phase}, exits {p.exit_codes})\n{tail(p.log_path, 25)}\n")
        raise
    finally:
        sim.close()
        phase("torn down")
    left = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True).stdout
    assert sim.tag not in left, f"namespaces left behind: {left}"
    links = subprocess.run(["ip", "-o", "link"], capture_output=True, text=True).stdout
    assert f"v{sim.tag}" not in links, "veths left behind"
