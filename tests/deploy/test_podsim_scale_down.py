"""podsim's scale-down is the Job controller's (issue 39, item 7).

On ``parallelism`` lowered, the Job controller deletes the excess active pods in the order of
``activePodsForRemoval`` (``controller.ActivePods``: pending before running, not ready before
ready, ready for less time first, more restarts first, newer first), and a deleted pod's end
goes through the ``podFailurePolicy`` like any failed pod's. podsim used to pick random victims
and skip their accounting, kinder than a cluster: a worker that exits 1 on SIGTERM would fail
a real Job with ``backoffLimit: 0`` and passed the harness.

* the order, on pods that never run (:func:`removal_order` is all that picks them);
* the accounting, on two small Jobs of ``sh`` pods in a real simulation: the one whose pods
  exit 143 on SIGTERM (the manifests' ignored code) keeps running; the one whose pods exit 1
  fails (``BackoffLimitExceeded``, ``backoffLimit: 0``); the victim is the most recently started.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.podsim import Pod, PodSim, netns_available, removal_order
from tests.deploy.pods import show_pods
from tests.metaps.fleet_data import wait_for


def _pod(name: str, phase: str, created: float, started_at: float = 0.0, restarts: int = 0) -> Pod:
    p = Pod(name, "job", {}, "", "", Path("/nonexistent"), phase=phase, created=created, restarts=restarts)
    p.started_at = started_at
    return p


def test_victims_go_in_the_job_controllers_order() -> None:
    ready = {"ready-old", "ready-new", "ready-restarted", "ready-twin-old", "ready-twin-new"}
    pods = [
        _pod("ready-old", "Running", created=1, started_at=10),
        _pod("ready-new", "Running", created=2, started_at=30),             # ready for less time
        _pod("ready-restarted", "Running", created=3, started_at=20, restarts=2),
        _pod("ready-twin-old", "Running", created=4, started_at=20, restarts=0),
        _pod("ready-twin-new", "Running", created=5, started_at=20, restarts=0),  # newer, same start
        _pod("not-ready", "Running", created=0, started_at=5),
        _pod("pending", "Pending", created=0),
    ]
    order = [p.name for p in removal_order(pods, lambda p: p.name in ready)]
    assert order == ["pending", "not-ready", "ready-new", "ready-restarted", "ready-twin-new", "ready-twin-old",
                     "ready-old"]


def _job(name: str, on_term: int, parallelism: int) -> dict[str, Any]:
    """A work-queue Job of ``sh`` pods that exit ``on_term`` on SIGTERM, with the manifests' rules."""
    rules = [{"action": "FailJob", "onExitCodes": {"containerName": "main", "operator": "In", "values": [4]},
              "onPodConditions": []},
             {"action": "Ignore", "onPodConditions": [{"type": "DisruptionTarget", "status": "True"}]},
             {"action": "Ignore", "onExitCodes": {"containerName": "main", "operator": "In", "values": [143]},
              "onPodConditions": []}]
    loop = f"trap 'exit {on_term}' TERM; while :; do sleep 0.1; done"
    return {"kind": "Job", "metadata": {"name": name},
            "spec": {"parallelism": parallelism, "backoffLimit": 0, "podFailurePolicy": {"rules": rules},
                     "template": {"metadata": {"labels": {"app": name}},
                                  "spec": {"restartPolicy": "Never", "terminationGracePeriodSeconds": 5,
                                           "containers": [{"name": "main", "command": ["sh", "-c", loop]}]}}}}


@pytest.mark.timeout(120)
def test_a_scaled_down_pod_meets_the_pod_failure_policy(tmp_path: Path) -> None:
    assert netns_available(), "pods run in network + mount namespaces: needs root, iproute2 and unshare"
    sim = PodSim([_job("quiet", 143, 2), _job("loud", 1, 2)], tmp_path / "sim", subnet="10.233.0")
    try:
        for name in ("quiet", "loud"):
            sim.start_workload(name)
        wait_for(lambda: all(p.phase == "Running" for p in sim.pods.values()) and len(sim.pods) == 4, 60,
                 "4 pods running")
        time.sleep(0.3)  # the shells have set their traps
        victims = {}
        for name in ("quiet", "loud"):
            newest = max(sim.job_pods(name), key=lambda p: p.started_at)  # every pod ready: the last started goes
            sim.scale_job(name, 1)
            assert [p.name for p in sim.job_pods(name) if p.scaled_down] == [newest.name]
            victims[name] = newest
        wait_for(lambda: all(p.accounted for p in victims.values()), 60, "the victims' ends accounted")
        assert [v.exit_codes for v in victims.values()] == [[143], [1]]
        # 143 is ignored: the Job goes on with one pod; exit 1 counts, beyond backoffLimit 0: the Job fails
        assert (sim.job_status("quiet"), sim.jobs["quiet"].failures) == ("Running", 0)
        assert sim.job_status("loud") == "Failed" and sim.jobs["loud"].reason.startswith("BackoffLimitExceeded")
        assert len([p for p in sim.job_pods("quiet") if not p.ended]) == 1  # no replacement for the victim
    except BaseException:
        show_pods(sim)
        raise
    finally:
        sim.close()
