"""A process that joins a failed run is told at once: exit 4, not a crash loop; a pod that claims into a
complete run exits 0.

Re-applying a failed day's manifests started a controller on the failed state: the processes
alive then were told to stop, but workers that registered later never were, exited 1 every few
minutes and the worker Job failed only at its backoffLimit (~29 minutes, 18 pods). Now a
``RegisterNode`` (of a worker or PS process) and a ``ClaimWorker`` in a failed run are refused
with FAILED_PRECONDITION ``run_failed: <why> ...``, which the client turns into exit code 4
(RUN_FAILED: the agent does not restart it, the Job's podFailurePolicy fails the Job at once).
Agents still register (they supervise the child that exits 4). Real controller over gRPC on
127.0.0.1, its failure read back from the LMDB state as a restarted controller does.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import grpc
import pytest

from controller.client import ControllerError
from controller.run_outcome import RUN_FAILED
from controller.state import Event
from controller.types import NODE_FINISHED
from common import exit_codes
from common.toml_writer import write
from tests.controller.conftest import TOKEN, TRAIN, client, drain
from tests.metaps.fleet_data import job_mapping

REPO = Path(__file__).resolve().parents[2]


def test_register_and_claim_in_a_failed_run_are_refused_with_exit_4(controller, tmp_path: Path) -> None:
    state = tmp_path / "failed-state"
    first = controller(state_dir=state)
    ok = client(first, 0)  # registered before the failure: it is told by a stop command instead
    first.events.record(Event.now("controller", RUN_FAILED, {"reason": "PS recovery failed: no committed cut"},
                                  "stop"))
    first.stop(grace=0)
    ok.close()
    srv = controller(state_dir=state)  # the failed day's manifests applied again
    for make in (lambda: client(srv, 1), lambda: client(srv, 0, role="ps")):
        with pytest.raises(ControllerError) as refused:
            make()
        err = refused.value
        assert err.code == grpc.StatusCode.FAILED_PRECONDITION and err.exit_code == exit_codes.RUN_FAILED, err
        assert "run_failed: PS recovery failed: no committed cut" in str(err) and "new run name" in str(err)
    late = client(srv, 2, register=False)
    with pytest.raises(ControllerError) as refused:
        late.claim_worker("train-worker-abcde")
    assert refused.value.exit_code == exit_codes.RUN_FAILED
    agent = client(srv, 1, role="worker", register=False, source="agent")
    agent.register()  # an agent is not refused: it supervises the child that exits 4
    assert not [i for i in srv.registry.nodes() if i.role == "ps"]  # nothing registered by the refusals
    # a refusal for any other reason keeps exit code 1
    assert ControllerError(grpc.StatusCode.FAILED_PRECONDITION, "not finished", "X").exit_code == exit_codes.FAILED


def test_a_pod_claiming_into_a_complete_run_is_told_to_exit_0(controller, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    """A worker pod the Job starts as the run ends (it replaced a worker that failed just then) used to claim
    an index and wait for a controller and PS fleet that were stopping: the Job never completed. A
    ``ClaimWorker`` in a complete run is refused with ``run_ended: ...`` and ``metaps worker`` exits 0."""
    srv = controller(datasets=(TRAIN,))
    w0 = client(srv, 0)
    assert client(srv, 5, register=False).claim_worker("train-worker-early") >= 0  # a running run gives an index
    drain(w0, "train")
    w0.node_down("worker", 0, NODE_FINISHED, 0)
    assert srv.outcome.state()[0].value == "complete"
    with pytest.raises(ControllerError) as refused:
        client(srv, 2, register=False).claim_worker("train-worker-late")
    err = refused.value
    assert err.run_ended and "nothing is left to train" in str(err), err  # the worker command exits 0 on it
    assert not ControllerError(grpc.StatusCode.FAILED_PRECONDITION, "run_failed: x", "X").run_ended
    job = write(tmp_path / "job.toml", {**job_mapping({"train": tmp_path / "no-data"}, tmp_path),
                                        "rpc": {"token": TOKEN, "timeout_s": 5.0}})
    proc = subprocess.run([sys.executable, "-m", "metaps", "worker", "--config", str(job), "--rank", "auto",
                           "--controller", srv.address, "--ps", "127.0.0.1:1", "--metrics-port", "-1"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr
    assert "the run is complete" in proc.stdout + proc.stderr, proc.stdout + proc.stderr
