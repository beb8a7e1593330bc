"""Two pod simulations on one machine: one ending must not take the other's mounts with it.

A pod's volume is bind-mounted on a host directory (``/etc/metaps/job``); the simulation that
created that directory removed it when it ended, and since Linux 3.18 removing a mount point
detaches its bind mounts in every mount namespace: a concurrent simulation's pods (another
test on the other xdist worker) lost their config file mid-run ("metaps cut: error:
/etc/metaps/job/job.toml: config file not found" in a PS pod's preStop hook). Judged from
inside the surviving pod: its mounted file is still there after the other simulation closed.
"""

from __future__ import annotations

import fcntl
import secrets
import subprocess
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.podsim import HOST_DIRS, HOST_LOCK, PodSim, _main_pid, netns_available
from tests.metaps.fleet_data import wait_for


def _docs(mount: str) -> list[dict[str, Any]]:
    return [
        {"kind": "ConfigMap", "metadata": {"name": "cfg"}, "data": {"job.toml": "x = 1\n"}},
        {"kind": "Job", "metadata": {"name": "holder"},
         "spec": {"parallelism": 1, "completions": 1, "backoffLimit": 0,
                  "template": {"metadata": {"labels": {"app": "holder"}},
                               "spec": {"restartPolicy": "Never",
                                        "containers": [{"name": "main", "command": ["sleep", "300"],
                                                        "volumeMounts": [{"name": "cfg", "mountPath": mount}]}],
                                        "volumes": [{"name": "cfg", "configMap": {"name": "cfg"}}]}}}},
    ]


def _read_in_pod(sim: PodSim, path: str) -> subprocess.CompletedProcess[str] | None:
    """``cat path`` in the holder pod's mount namespace; None before its container started."""
    pods = sim.job_pods("holder")
    if not pods or pods[0].proc is None:
        return None
    return subprocess.run(["nsenter", "-t", str(_main_pid(pods[0].proc)), "-m", "cat", path],
                          capture_output=True, text=True, timeout=30)


def _sees(sim: PodSim, path: str) -> bool:
    r = _read_in_pod(sim, path)
    return r is not None and r.returncode == 0 and r.stdout == "x = 1\n"


@pytest.mark.timeout(300)
def test_a_closing_simulation_keeps_the_mount_points_another_one_uses(tmp_path: Path) -> None:
    assert netns_available(), "pods run in network + mount namespaces: needs root, iproute2 and unshare"
    mount = f"/etc/metaps-podsim-test-{secrets.token_hex(3)}/job"  # a host path neither simulation finds
    assert not Path(mount).exists()
    first = PodSim(_docs(mount), tmp_path / "a", subnet="10.234.0")
    second = None
    try:
        second = PodSim(_docs(mount), tmp_path / "b", subnet="10.235.0")
        for sim in (first, second):
            sim.start_workload("holder")
        wait_for(lambda: all(_sees(s, f"{mount}/job.toml") for s in (first, second)), 120,
                 "both pods to see their config file")
        first.close()  # the one that created the host directory ends first
        r = _read_in_pod(second, f"{mount}/job.toml")
        assert r is not None and r.returncode == 0 and r.stdout == "x = 1\n", r
        assert Path(mount).is_dir()
    finally:
        first.close()
        if second is not None:
            second.close()
    _assert_last_one_out_cleans_up(Path(mount))


def _assert_last_one_out_cleans_up(mount: Path) -> None:
    """The last simulation out removes the mount points; while another simulation on this machine
    (another test) still runs, they stay listed for it. Every live simulation holds the host lock
    shared until it has closed, so an exclusive hold means none is left: the last one out has run."""
    with open(HOST_LOCK, "a+") as lock:
        try:
            fcntl.flock(lock, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            listed = set(Path(HOST_DIRS).read_text().split("\n"))
            assert {str(mount), str(mount.parent)} <= listed, f"left for the last one out, unlisted: {listed}"
            return
        assert not mount.exists() and not mount.parent.exists()
