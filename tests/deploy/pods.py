"""Helpers of the pods-in-namespaces tests: render a job's manifests, show the pods of a failed test."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import yaml

from tests.deploy.podsim import PodSim, Pod, tail
from tests.metaps.fleet_data import wait_for

REPO = Path(__file__).resolve().parents[2]


def pod_env() -> dict[str, str]:
    """Environment for every container of a test's PodSim: the checkout on ``PYTHONPATH`` (the image's
    code) and one math thread per process, as tests/conftest.py gives every process a test starts
    (a kubelet passes no host environment; PodSim passes only PATH and the locale unless told): with
    two OpenMP threads on this oversubscribed box a pod's ``metaps deliver`` spin-waits, ~25 CPU-s
    against ~8 for its gate."""
    from tests.conftest import SINGLE_THREAD

    env = {"PYTHONPATH": str(REPO)}
    env.update({k: os.environ[k] for k in SINGLE_THREAD if k in os.environ})
    return env


def render(job_toml: Path, out: Path) -> list[dict[str, Any]]:
    """``metaps deploy k8s`` of ``job_toml`` into ``out``, then ``kubectl kustomize``: the objects a cluster gets."""
    r = subprocess.run([sys.executable, "-m", "metaps", "deploy", "k8s", "--config", str(job_toml),
                        "--image", "local/metaps:test", "--out", str(out)], capture_output=True, text=True,
                       timeout=120, cwd=REPO)
    assert r.returncode == 0, r.stderr
    k = subprocess.run(["kubectl", "kustomize", str(out)], capture_output=True, text=True, timeout=120)
    assert k.returncode == 0, k.stderr
    return [d for d in yaml.safe_load_all(k.stdout) if d]


def show_pods(sim: PodSim, lines: int = 25) -> None:
    """Every pod's phase, exit codes and log tail on stderr (a failed test's evidence)."""
    for p in sim.pods.values():
        sys.stderr.write(f"--- {p.name} ({p.phase}, exits {p.exit_codes})\n{tail(p.log_path, lines)}\n")


@contextmanager
def closing_shown(sim: PodSim) -> Iterator[PodSim]:
    """``with closing_shown(PodSim(...)) as sim``: every pod's log tail on stderr when the body fails,
    the simulation closed (namespaces, mounts, processes) either way."""
    try:
        yield sim
    except BaseException:
        show_pods(sim)
        raise
    finally:
        sim.close()


def train_to_completion(sim: PodSim, name: str, timeout_s: float = 300.0) -> Pod:
    """Start ``NAME-data``, ``-controller``, ``-ps`` and ``-worker``; assert that the worker Job
    completes with no failed pod (a failed pod is judged at once), that the PS and controller Jobs
    then complete, and that the controller's outcome is a complete run with complete coverage.

    Returns:
        the controller's pod.
    """
    for w in ("data", "controller", "ps", "worker"):
        sim.start_workload(f"{name}-{w}")
    worker = f"{name}-worker"
    wait_for(lambda: sim.job_status(worker) != "Running" or any(p.phase == "Failed" for p in sim.pods.values()),
             timeout_s, "the worker Job to end")
    failed = [p.name for p in sim.pods.values() if p.phase == "Failed"]
    assert not failed and sim.job_status(worker) == "Complete", (failed, sim.jobs[worker].reason)
    wait_for(lambda: sim.job_complete(f"{name}-ps") and sim.job_complete(f"{name}-controller"), 180,
             "the PS and controller Jobs to complete")
    ctl = sim.job_pods(f"{name}-controller")[0]
    outcome = json.loads(sim.termination_message(ctl.name))
    assert (outcome["run"], outcome["coverage"]) == ("complete", "complete"), outcome
    return ctl
