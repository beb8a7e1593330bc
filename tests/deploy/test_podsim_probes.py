"""The kubelet's startup and liveness probes, as podsim enforces them, on two small pods.

* ``slow``: a container whose port never opens, with a startup window of 3 x 1 s: the startup
  probe kills it (SIGTERM does nothing to a pid 1 without a handler, SIGKILL after the grace
  period: exit 137), and with ``restartPolicy: Never`` and ``backoffLimit: 0`` its Job fails.
* ``late``: a gRPC health server that opens its port after 3 s, with a startup window of
  12 x 0.5 s and a liveness probe that gives up after one failure. Liveness must not run
  before the startup probe passed (it would kill the container at once); once started, a hung
  container (SIGSTOP) is killed by liveness and, ``restartPolicy: OnFailure``, restarted in the
  same pod. Both run as uid 10001 (the interpreter behind ``/root``, 0700, stays reachable).

The fleet's own case (a hung PS killed by liveness, replaced, recovered by the controller)
is in test_k8s_pods.py.
"""

from __future__ import annotations

import signal
import sys
from pathlib import Path
from typing import Any

import pytest

from tests.deploy.podsim import PodSim, netns_available, tail
from tests.deploy.pods import show_pods
from tests.metaps.fleet_data import wait_for

PORT = 5999
SERVE_LATE = (
    "import time, grpc\n"
    "from concurrent import futures\n"
    "from grpc_health.v1 import health, health_pb2, health_pb2_grpc\n"
    "time.sleep(3)\n"
    "s = grpc.server(futures.ThreadPoolExecutor(2))\n"
    "h = health.HealthServicer()\n"
    "h.set('', health_pb2.HealthCheckResponse.SERVING)\n"
    "health_pb2_grpc.add_HealthServicer_to_server(h, s)\n"
    f"s.add_insecure_port('0.0.0.0:{PORT}')\n"
    "s.start()\n"
    "print('port open', flush=True)\n"
    "time.sleep(600)\n"
)


def _job(name: str, command: list[str], restart: str, probes: dict[str, Any]) -> dict[str, Any]:
    container = {"name": "main", "command": command, **probes}
    return {"kind": "Job", "metadata": {"name": name},
            "spec": {"parallelism": 1, "completions": 1, "backoffLimit": 0,
                     "template": {"metadata": {"labels": {"app": name}},
                                  "spec": {"restartPolicy": restart, "terminationGracePeriodSeconds": 1,
                                           "securityContext": {"runAsUser": 10001, "runAsGroup": 10001},
                                           "containers": [container]}}}}


def _grpc(period: float, threshold: int, **extra: Any) -> dict[str, Any]:
    return {"grpc": {"port": PORT}, "periodSeconds": period, "timeoutSeconds": 1, "failureThreshold": threshold,
            **extra}


@pytest.mark.timeout(300)
def test_startup_and_liveness_probes_kill_and_restart(tmp_path: Path) -> None:
    assert netns_available(), "pods run in network + mount namespaces: needs root, iproute2 and unshare"
    docs = [_job("slow", ["sleep", "600"], "Never", {"startupProbe": _grpc(1, 3)}),
            _job("late", [sys.executable, "-c", SERVE_LATE], "OnFailure",
                 {"startupProbe": _grpc(0.5, 12), "livenessProbe": _grpc(0.5, 1)})]
    sim = PodSim(docs, tmp_path / "sim", subnet="10.236.0")
    try:
        sim.start_workload("slow")
        late = sim.start_workload("late")[0]
        slow = sim.job_pods("slow")[0]
        # the late server started within its window: liveness (1 failure = kill) only probes after that
        wait_for(lambda: late.started and "port open" in late.log_path.read_text().splitlines(), 60,
                 "the late server to serve and its startup probe to pass")
        assert late.probe_kills == [] and late.restarts == 0, (late.probe_kills, tail(late.log_path))
        # the startup window (3 x 1 s) passes with no answer: killed, and the Job (backoffLimit 0) fails
        wait_for(lambda: sim.job_status("slow") == "Failed", 60, "the startup probe to fail the slow pod's Job")
        assert slow.probe_kills == ["startup"] and slow.exit_codes == [137], (slow.probe_kills, slow.exit_codes)
        # hung: liveness kills it, OnFailure restarts the container in the same pod
        sim.signal_container(late.name, signal.SIGSTOP)
        wait_for(lambda: late.restarts == 1, 60, "liveness to kill the hung server and the pod to restart it")
        assert late.probe_kills == ["liveness"] and late.exit_codes == [137], (late.probe_kills, late.exit_codes)
        wait_for(lambda: late.started and late.phase == "Running", 60, "the restarted server to start")
    except BaseException:
        show_pods(sim)
        raise
    finally:
        sim.close()
