"""A worker's identity inside a pod (``metaps worker --rank auto``).

::

    --rank auto, dense_sync = allreduce  -> $JOB_COMPLETION_INDEX (Indexed Job; < [train] workers)
    --rank auto, PS mode                 -> ClaimWorker(pod name) at the controller: any number of
                                            workers (the work-queue Job's parallelism, patched mid-run)
    --rank K                             -> K, < [train] workers (launcher, scripts)

A worker with ``--rank auto`` and a controller also leaves politely when its pod
is deleted (scale-down, ``kubectl delete pod``): SIGTERM reports it down to the
controller (``NodeDown``), which requeues its leased shards at once and frees its
index for a newcomer; the worker then leaves the PS (its cleanup) and exits 143. One
that fails does the same before it exits 1 (:func:`leave_on_failure`).
"""

from __future__ import annotations

import logging
import os
import signal
from typing import Any

from metaps.deploy.identity import completion_index, pod_name, ps_addresses, registered_ps_addresses
from common.errors import ConfigError
from common.log import kv

log = logging.getLogger(__name__)


def resolve_worker(job: Any, config: str, rank: str, ps_spec: str, controller: str) -> tuple[int, list[str]]:
    """``--rank`` and ``--ps`` as given -> (rank, PS addresses in shard order).

    Args:
        job: the loaded job (with the resolved token).
        config: the job file's path (for messages).
        rank: ``"K"`` or ``"auto"``.
        ps_spec: ``--ps`` (a list, a ``{k}`` pattern or ``controller``).
        controller: controller ``host:port`` ('' = none).

    Raises:
        ConfigError: a bad or out-of-range rank, ``auto`` in PS mode without a controller,
            or PS addresses that cannot be resolved.
    """
    from controller.client import ControllerClient

    allreduce = str(getattr(job.train.dense_sync, "value", job.train.dense_sync)) == "allreduce"
    if rank == "auto":
        if allreduce:
            r = completion_index()
            if r >= job.train.workers:
                raise ConfigError(f"{config}: $JOB_COMPLETION_INDEX {r} out of range: [train] workers = "
                                  f"{job.train.workers} (the Indexed Job's completions must equal it)")
        else:
            if not controller:
                raise ConfigError("metaps worker --rank auto (PS mode): the controller gives the index; "
                                  "pass --controller HOST:PORT or set METAPS_CONTROLLER")
            with ControllerClient(controller, job.rpc, retry_s=300.0) as ctl:
                r = ctl.claim_worker(pod_name())
            log.info("worker index from the controller", extra=kv(pod=pod_name(), rank=r))
            _leave_on_sigterm(job, r, controller)
    else:
        try:
            r = int(rank)
        except ValueError:
            raise ConfigError(f"--rank {rank!r}: expected a worker index or 'auto'") from None
        if not 0 <= r < job.train.workers:
            raise ConfigError(f"{config}: --rank {r} out of range: [train] workers = {job.train.workers}")

    def from_controller() -> list[str]:
        with ControllerClient(controller, job.rpc, retry_s=300.0) as ctl:
            return registered_ps_addresses(ctl.status())

    addrs = ps_addresses(ps_spec, job.ps.shards, from_controller if controller else None)
    return r, addrs


def leave_on_failure(job: Any, rank: int, controller: str, reason: str, exit_code: int = 1) -> list[str]:
    """A pod's worker that fails (an error it cannot retry, e.g. a push whose deadline passed)
    reports itself down before it exits, as a deleted one does on SIGTERM: its leases are
    requeued and another live worker takes over the checkpoint lead at once, instead of the
    controller holding it "alive" until its heartbeat timeout. Best effort: returns the
    requeued shard ids ([] if the controller could not be told; it then finds out by timeout).

    Args:
        job: the job config (``rpc``).
        rank: this worker's index.
        controller: the controller's address.
        reason: why the worker fails (one line).
        exit_code: the exit code the worker is about to exit with.
    """
    from controller.client import ControllerClient

    try:
        with ControllerClient(controller, job.rpc, role="worker", index=rank, retry_s=5.0) as ctl:
            requeued = list(ctl.node_down("worker", rank, reason[:300], exit_code))
    except Exception as exc:  # the controller finds out on heartbeat timeout instead
        log.error("NodeDown failed; the controller finds out by heartbeat timeout", extra=kv(error=str(exc)[:200]))
        return []
    log.warning("failed; left the job", extra=kv(rank=rank, requeued=requeued))
    return requeued


def _leave_on_sigterm(job: Any, rank: int, controller: str) -> None:
    """SIGTERM: NodeDown to the controller (requeue my leases, free my index), then unwind with
    exit code 143 so the worker's cleanup runs: it leaves the PS (a staleness bound must not wait
    for a worker that is gone). A second SIGTERM exits at once."""
    fired: list[bool] = []

    def on_term(signum: int, frame: Any) -> None:
        from controller.client import ControllerClient

        if fired:
            os._exit(143)
        fired.append(True)
        log.warning("SIGTERM: leaving the job", extra=kv(rank=rank))
        try:
            with ControllerClient(controller, job.rpc, role="worker", index=rank, retry_s=5.0) as ctl:
                requeued = ctl.node_down("worker", rank, "SIGTERM (pod deleted or scaled down)", 143)
            log.warning("left the job; shards requeued", extra=kv(rank=rank, requeued=requeued))
        except Exception as exc:  # the controller requeues on lease expiry instead
            log.error("NodeDown failed; the controller requeues on lease expiry", extra=kv(error=str(exc)[:200]))
        raise SystemExit(143)

    signal.signal(signal.SIGTERM, on_term)
