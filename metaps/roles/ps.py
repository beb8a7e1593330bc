"""``metaps ps``: run one parameter-server shard as its own process.

Example::

    metaps ps --config job.toml --shard 0 --port 5000
    metaps ps --config job.toml --shard 1 --restore runs/x/ckpt/ckpt-1200
    metaps ps --config job.toml --shard 1 --restore-latest runs/x/checkpoints --controller 127.0.0.1:7070

The process serves gRPC on ``[ps] host`` and ``--port`` (default
``base_port + shard``, or a port the kernel picks when base_port is 0), Prometheus
``/metrics`` on ``--metrics-port`` (0: a port the kernel picks) and, with ``--ready-file``,
writes ``{"port", "metrics_port", "pid"}`` there once serving (launchers and tests
wait for it and read the ports from it). With port 0 and a ready file an earlier
process of the shard wrote, it binds that file's port again: a restarted shard keeps
the address its clients know (the port in use by then: one line, exit 1).
SIGTERM/SIGINT: stop accepting calls, finish in-flight ones (up to ``--grace`` seconds),
exit 0 (``--signal-exit-code``: 143 in a Kubernetes Job, where 0 would mark the shard's
index complete). A ``stop`` from the controller ends it the same way, with the code
:mod:`common.exit_codes` gives its reason (0 the run ended, 4 the run failed,
5 superseded by a newer process of this shard).

With ``--controller`` (or ``$METAPS_CONTROLLER``, set by ``metaps agent``) the
shard registers as ``ps:<shard>`` with its address, heartbeats and reports its
mean request latency and queue depth (:mod:`metaps.roles.ps_link`); the
controller moves vshards off it when it is slow and restores the fleet to the
last committed checkpoint when it restarts after a crash.

**Awaiting recovery.** A shard process that replaces a crashed one holds none of
the fleet's rows. With ``--awaiting-recovery`` (default: on when
``$METAPS_RESTARTS`` > 0, which ``metaps agent`` sets when it restarts its child)
it serves no data and refuses Checkpoint until the controller's fleet recovery
restores it (``ps/servicer.py``), so no checkpoint cut captures its empty shard.
The controller link also sets it when the controller has seen an earlier process
of this shard under another incarnation id (a restart not made by an agent, or a
replaced pod; no Restore arrived yet), and clears it when the controller has seen
none (the crashed process never served).
It needs ``--controller``: only the controller's recovery clears it.

Security: the token is ``[rpc] token``, ``[rpc] token_file`` (``--token-file``),
``$METAPS_TOKEN``, else the run's token file ``<[run] dir>/rpc.token``
(``$METAPS_RUN_DIR/rpc.token``). With none of them a loopback shard generates
that file (0600; its path is logged, the token never) and requires it, so a
hand-started shard never accepts unauthenticated Push/PauseWrites/Checkpoint;
``metaps worker``/``status``/``cut`` of the same job read it. A non-loopback
``[ps] host`` without a token is refused (exit 1). ``--insecure`` keeps the old
unauthenticated behaviour, with a loud warning. Checkpoint/Restore requests may
only name directories under ``--checkpoint-root``. Files are created 0600,
directories 0700. Config errors (the job file, ``--shard``, ``[ps] device``, an
address that cannot be bound) are one line on stderr and exit 1.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
import time
from pathlib import Path
from typing import Any, Callable

from common import exit_codes
from common.atomic_write import write_json_atomic
from common.log import kv
from common.security import add_cli_args, check_bind, checkpoint_root, role_rpc, set_run_umask

log = logging.getLogger(__name__)


def _own_checkpoint(root: str | None, warm_start: str) -> Path | None:
    """The run's own newest committed checkpoint under ``root`` (None: none yet, or ``root`` is the
    warm-start directory itself)."""
    from ps.checkpoint import latest_checkpoint

    if not root or not Path(root).is_dir() or Path(root).resolve() == Path(warm_start).resolve():
        return None
    return latest_checkpoint(root)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("ps", help="run one parameter-server shard")
    p.add_argument("--config", required=True, help="job TOML")
    p.add_argument("--shard", required=True,
                   help="shard id 0..[ps].shards-1, or 'auto': this Indexed Job pod's $JOB_COMPLETION_INDEX "
                        "(else the -K its name ends in)")
    p.add_argument("--advertise", default=os.environ.get("METAPS_ADVERTISE_HOST", ""),
                   help="host registered with the controller (default $METAPS_ADVERTISE_HOST, else [ps] host "
                        "or 127.0.0.1 for a wildcard bind); in a pod: its stable DNS name")
    p.add_argument("--port", type=int, default=None, help="gRPC port (default base_port + shard; 0 = free port)")
    p.add_argument("--restore", default="", help="checkpoint directory to load this shard's vshards from")
    p.add_argument("--restore-latest", default="",
                   help="checkpoint root: restore its newest committed ckpt-<step> (nothing there: start empty)")
    p.add_argument("--controller", default=os.environ.get("METAPS_CONTROLLER", ""),
                   help="controller host:port to register with and report load to (default $METAPS_CONTROLLER)")
    p.add_argument("--metrics-port", type=int, default=0, help="Prometheus port (0 = free port)")
    p.add_argument("--ready-file", default="", help="write {port, metrics_port, pid} as JSON here once serving")
    p.add_argument("--grace", type=float, default=10.0, help="seconds in-flight calls get on SIGTERM")
    p.add_argument("--signal-exit-code", type=int, default=0,
                   help="exit code after a clean stop on SIGTERM/SIGINT (143 in a Kubernetes Job: an evicted "
                        "or deleted pod is then not counted as a completed index)")
    p.add_argument("--awaiting-recovery", action="store_true", default=_restarted_by_agent(),
                   help="this process replaces a crashed one: refuse data RPCs and checkpoints until the "
                        "controller restores the fleet (default: on when $METAPS_RESTARTS > 0)")
    add_cli_args(p, checkpoint_root=True)
    p.set_defaults(func=run_ps)


def _earlier_port(ready_file: str) -> int:
    """The gRPC port an earlier process of this shard wrote to ``ready_file`` (0: none).

    The launcher removes the ready files before it starts a shard the first time, so one
    that is there was written by this shard's previous process in the same run.
    """
    import json

    if not ready_file:
        return 0
    try:
        info = json.loads(Path(ready_file).read_text())
        return int(info.get("port", 0)) if int(info.get("pid", 0)) != os.getpid() else 0
    except (OSError, ValueError, TypeError, AttributeError):
        return 0


def _restarted_by_agent() -> bool:
    """True when ``metaps agent`` started this process as a restart (``$METAPS_RESTARTS`` > 0)."""
    try:
        return int(os.environ.get("METAPS_RESTARTS", "0") or 0) > 0
    except ValueError:
        return False


def _latency_hook(job: Any, shard: int) -> Callable[[], float] | None:
    """The fault injector's per-RPC delay for this shard, when common.faults provides one."""
    try:
        from common import faults
    except ImportError:
        return None
    make = getattr(faults, "ps_added_latency", None)
    return make(job.faults, shard) if make is not None else None


def run_ps(args: argparse.Namespace) -> int:
    from metaps.job import load_job

    set_run_umask()  # checkpoint LMDB files, ready file: group-readable (0640 / 0750)
    job = load_job(args.config)
    job = job.with_overrides(rpc=role_rpc(job.rpc, args.token_file, run_dir=job.run.dir, serve_hosts=[job.ps.host],
                                          insecure=args.insecure, what="metaps ps"))
    check_bind([job.ps.host], job.rpc.resolved_token(), insecure=args.insecure, what="metaps ps", serves=True)
    from metaps.deploy.identity import resolve_shard

    args.shard = resolve_shard(str(args.shard), job.ps.shards)
    port = args.port if args.port is not None else (job.ps.base_port + args.shard if job.ps.base_port else 0)
    earlier = _earlier_port(args.ready_file) if port == 0 else 0
    if earlier:
        # a restart of this shard (its agent's, or a relaunched agent's): clients know the address
        # its earlier process published, so it comes back on that port
        log.info("binding the port an earlier process of this shard published",
                 extra=kv(shard=args.shard, port=earlier, ready_file=args.ready_file))
        port = earlier
    from common.errors import BindError
    from common.rpc import check_bindable

    try:
        check_bindable(f"{job.ps.host}:{port}")  # a busy port or a foreign host: one line, before torch
    except BindError as exc:
        whence = (f" (the port its earlier process published in {args.ready_file})" if earlier
                  else " ([ps] base_port + shard)" if args.port is None and port else "")
        raise BindError(f"metaps ps shard {args.shard}: {exc}{whence}") from None
    # torch/fbgemm only once the config and bind checks passed: a bad invocation fails in a second
    import torch
    from prometheus_client import REGISTRY

    from common.metrics import serve_metrics
    from ps.coordinator import restore_shard_checkpoint
    from ps.factory import build_server

    # fbgemm's CPU backward is ~100x slower with intra-op threads fighting over 2 cores.
    torch.set_num_threads(1)
    ps_cfg = job.ps
    from ps import intra_op

    intra_op.set_threads(ps_cfg.intra_op_threads)  # [ps] intra_op_threads: explicit spans, not OpenMP
    from ps.shard_store import resolve_device

    try:
        resolve_device(ps_cfg.device)
    except ValueError as exc:
        from common.errors import ConfigError

        raise ConfigError(f"{args.config}: [ps] device: {exc}") from None
    server = build_server(
        ps_cfg, job.rpc, job.table_configs(), args.shard, registry=REGISTRY,
        added_latency_s=_latency_hook(job, args.shard),
    )
    server.checkpoint_root = str(checkpoint_root(args.checkpoint_root, job.run.dir))
    if args.awaiting_recovery:
        if not args.controller:
            from common.errors import ConfigError

            raise ConfigError("metaps ps --awaiting-recovery needs --controller (or $METAPS_CONTROLLER): "
                              "only the controller's fleet recovery ends the wait")
        server.mark_awaiting_recovery("restarted by its agent ($METAPS_RESTARTS / --awaiting-recovery)")
    if args.restore and args.restore_latest:
        from common.errors import ConfigError

        raise ConfigError("metaps ps: pass --restore DIR or --restore-latest ROOT, not both")
    restore = warm = args.restore
    if args.restore_latest:
        from ps.checkpoint import latest_checkpoint

        own = _own_checkpoint(server.checkpoint_root, args.restore_latest)
        found = latest_checkpoint(args.restore_latest)
        warm = str(found) if found is not None else ""
        restore = warm if own is None else ""
        if own is not None:
            # the run already has checkpoints of its own: the warm start was applied when it began;
            # a restarted shard gets this run's latest cut from the controller's recovery instead
            log.info("warm start not re-applied: the run has checkpoints of its own",
                     extra=kv(shard=args.shard, warm_start=args.restore_latest, own=str(own)))
        elif not restore:
            log.info("no committed checkpoint to restore; starting empty", extra=kv(shard=args.shard, root=args.restore_latest))
    # /metrics binds before gRPC serves: a port in use is one line, and no ready file is written
    metrics_port = serve_metrics(args.metrics_port, ps_cfg.host, what=f"metaps ps shard {args.shard}")
    # the warm start stays restorable (also when not re-applied): it is the run's first cut (metaps
    # controller --warm-start), which a recovery before the run's own first cut restores (outside the root)
    server.warm_start_dir = warm or None
    if restore:
        rows, step = restore_shard_checkpoint(server, restore)
        log.info("restored", extra=kv(shard=args.shard, dir=restore, rows=rows, step=step))
    try:
        port = server.start(f"{ps_cfg.host}:{port}")
    except BindError as exc:
        raise BindError(f"metaps ps shard {args.shard}: {exc}") from None
    log.info("ps ready", extra=kv(shard=args.shard, port=port, metrics_port=metrics_port, pid=os.getpid(),
                                  checkpoint_root=server.checkpoint_root))

    stop = threading.Event()

    def on_signal(signum: int, frame: Any) -> None:
        log.info("signal received; shutting down", extra=kv(signal=signal.Signals(signum).name, grace=args.grace))
        stop.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    link = None
    if args.controller:
        from metaps.roles.ps_link import ControllerLink

        host = args.advertise or (ps_cfg.host if ps_cfg.host not in ("", "0.0.0.0", "::", "[::]") else "127.0.0.1")
        link = ControllerLink(server, args.controller, job.rpc, f"{host}:{port}", metrics_port,
                              report_s=max(0.05, job.controller.monitor.window_s / 2))
        reg = link.register()
        if reg.restarted and server.restores == 0:
            # the controller knew an earlier process of this shard: it recovers the fleet
            server.mark_awaiting_recovery(f"controller incarnation {reg.incarnation} (a restart)")
        elif not reg.restarted and server.awaiting_recovery:
            # no earlier process of this shard ever registered, so none served: nothing to recover
            server.mark_recovered("first registration with the controller")
        link.on_stop = lambda why: stop.set()
        link.start()
    if args.ready_file:
        # atomic: the launcher polls for it and must never read half a file
        write_json_atomic(args.ready_file, {"port": port, "metrics_port": metrics_port, "pid": os.getpid()})
    from common.faults import FaultInjector

    born = time.time()
    killer = FaultInjector(job.faults, "ps", args.shard, t0=float(os.environ.get("METAPS_T0", born)))
    while not stop.wait(0.5):
        if killer.kill_due(born=born):
            log.error("fault injection: killing this PS now", extra=kv(shard=args.shard))
            os._exit(137)  # like SIGKILL: no graceful shutdown, no final words
    if link is not None:
        link.stop()
    server.stop(grace=args.grace)
    code = exit_codes.for_stop(link.stop_reason) if link is not None and link.stop_reason else args.signal_exit_code
    why = (link.stop_reason if link is not None else "") or "signal"
    if code in (exit_codes.OK, args.signal_exit_code):
        log.info("ps exited cleanly", extra=kv(shard=args.shard, reason=why, exit_code=code))
    else:
        log.error("ps exited: stopped by the controller", extra=kv(shard=args.shard, exit_code=code, reason=why))
    return code
