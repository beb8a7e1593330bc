"""``metaps controller`` and ``metaps agent`` subcommands.

::

    metaps controller --config job.toml [--address HOST:PORT] [--state-dir DIR]
    metaps agent --config job.toml --role worker --index 3 [--controller HOST:PORT] [-- CMD ...]
    metaps status --config job.toml [--controller HOST:PORT]
    metaps cut --config job.toml [--controller HOST:PORT] [--wait S]     (a PS pod's preStop hook)

The controller serves until a Shutdown RPC or SIGTERM/SIGINT, or, with
``--exit-when-done``, until the run ends: then the PS processes are told to stop and
it exits 0 (complete) or 4 (failed; :mod:`common.exit_codes`). Its datasets are
the job's ``[data] train`` (``[train] epochs`` passes) and ``[data] eval``
(``[controller] eval_epochs`` passes); it writes its address to
``<state_dir>/address``. The agent finds the controller from ``--controller``,
``$METAPS_CONTROLLER`` or ``<state_dir>/address``. The ND policy's vshard moves
go through a ``MigrationPsMover`` over the addresses PS processes register
(``metaps ps --controller``); a PS process that registers again after a crash
makes the controller restore the fleet to the last committed cut
(``controller/ps_recovery.py``).

Security: as ``metaps ps`` (see :mod:`common.security`): no token -> a loopback
controller generates ``<[run] dir>/rpc.token`` (0600) and requires it; ``status``,
``cut`` and ``agent`` read it when they have no other token (a ``metaps launch`` run's
``RUN/job.toml`` names its 0600 ``RUN/rpc.token`` as ``[rpc] token_file``, so
``metaps status --config RUN/job.toml`` needs nothing else; a missing or loose token
file is one line naming it); a non-loopback
``--address`` without a token is refused; ``--insecure`` serves unauthenticated, loudly;
``CheckpointDone`` dirs must lie under ``--checkpoint-root``
(default ``$METAPS_RUN_DIR/checkpoints``, else ``checkpoints/`` next to the
state dir); files 0600, directories 0700.
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
from pathlib import Path
from typing import Any

from common.errors import ConfigError
from common.log import kv
from common.security import add_cli_args, check_bind, checkpoint_root, client_rpc, role_rpc, set_run_umask

log = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("controller", help="run the AntDT controller (DDS, monitor, policy)")
    p.add_argument("--config", required=True, help="job TOML")
    p.add_argument("--address", default="", help="listen address (default [controller] address)")
    p.add_argument("--state-dir", default="", help="LMDB state dir (default [controller] state_dir or <run.dir>/controller)")
    p.add_argument("--metrics-port", type=int, default=-1, help="Prometheus /metrics port (0 = free port, -1 = none)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address /metrics binds (0.0.0.0 in a pod)")
    p.add_argument("--metrics-file", default="",
                   help="write {host, port, pid} of /metrics here (JSON) once it serves, before the address file")
    p.add_argument("--exit-when-done", action="store_true",
                   help="when the run ends, stop the PS processes and exit: 0 complete, 4 failed "
                        "(the Kubernetes manifests use it; `metaps launch` stops the fleet itself)")
    p.add_argument("--continue-from-cut", action="store_true",
                   help="continue an interrupted run: roll the data accounting back to the latest committed "
                        "checkpoint cut before serving (`metaps launch --resume`)")
    p.add_argument("--warm-start", default="",
                   help="the checkpoint every PS restores before training (metaps ps --restore): recorded as "
                        "the run's first committed cut, so a PS lost before the run's own first cut is "
                        "recovered to it")
    p.add_argument("--warm-start-latest", default="",
                   help="as --warm-start, the newest committed checkpoint under this root (metaps ps "
                        "--restore-latest, as the Kubernetes manifests run it)")
    p.add_argument("--signal-exit-code", type=int, default=0,
                   help="exit code after a stop by SIGTERM/SIGINT before the run ended (143 in a Kubernetes "
                        "Job: a drained controller pod is then replaced, not counted complete)")
    p.add_argument("--termination-log", default="",
                   help="file the run's outcome is written to on exit, one JSON line (a pod's "
                        "terminationMessagePath, /dev/termination-log)")
    add_cli_args(p, checkpoint_root=True)
    p.set_defaults(func=run_controller)

    s = _client_parser(subparsers, "status", "the run's state, coverage, nodes and checkpoints from the controller")
    s.set_defaults(func=run_status)

    c = _client_parser(subparsers, "cut", "ask the controller for a coordinated checkpoint cut now (a preStop hook)")
    c.add_argument("--wait", type=float, default=0.0, help="wait up to this many seconds for the cut to commit")
    c.add_argument("--reason", default="requested", help="why, for the event log")
    c.set_defaults(func=run_cut)

    a = subparsers.add_parser("agent", help="run and supervise one worker or PS process")
    a.add_argument("--config", required=True, help="job TOML")
    a.add_argument("--role", required=True, choices=["worker", "ps"], help="the role of the supervised process")
    a.add_argument("--index", required=True, type=int, help="its index: worker rank or PS shard")
    a.add_argument("--controller", default="", help="controller host:port")
    a.add_argument("--metrics-port", type=int, default=-1, help="Prometheus /metrics port (0 = free port, -1 = none)")
    a.add_argument("--metrics-file", default="", help="write {host, port, pid} of /metrics here (JSON) once it serves")
    add_cli_args(a)
    a.add_argument("child", nargs=argparse.REMAINDER, help="child command after '--' (default: metaps ROLE ...)")
    a.set_defaults(func=run_agent)


def _client_parser(subparsers: Any, name: str, help_text: str) -> Any:
    """A subcommand that talks to a running controller (``status``, ``cut``)."""
    p = subparsers.add_parser(name, help=help_text)
    p.add_argument("--config", required=True, help="job TOML (its [rpc] token; [controller] state_dir's address file)")
    p.add_argument("--controller", default="",
                   help="controller host:port (default $METAPS_CONTROLLER, else the state dir's address file)")
    p.add_argument("--token-file", default="", help="file (mode 0600) holding the auth token")
    return p


def _controller_address(job: Any, given: str, config: str) -> str:
    """``given``, else ``$METAPS_CONTROLLER``, else the controller's address file in the job's state dir.

    Raises:
        ConfigError: none of them.
    """
    addr = given or os.environ.get("METAPS_CONTROLLER", "")
    if addr:
        return addr
    f = _state_dir(job, "") / "address"
    if not f.exists():
        raise ConfigError(f"{config}: no controller address: pass --controller, set METAPS_CONTROLLER "
                          f"or start the controller first (it writes {f})")
    return f.read_text().strip()


def _state_dir(job: Any, override: str) -> Path:
    return Path(override or job.controller.state_dir or Path(job.run.dir) / "controller")


def job_datasets(job: Any) -> list[Any]:
    """The DDS datasets of a job: train (``train.epochs`` passes) and eval if set."""
    from controller.types import DatasetKind, DatasetSpec

    epochs = int(getattr(job.train, "epochs", 1))
    out = [DatasetSpec.from_meta_io("train", job.data.train, DatasetKind.TRAIN, epochs)]
    if job.data.eval:
        out.append(DatasetSpec.from_meta_io("eval", job.data.eval, DatasetKind.EVAL, job.controller.eval_epochs))
    return out


def _warm_start(args: argparse.Namespace) -> str:
    """The warm-start checkpoint the PS fleet restores (``--warm-start``, or the newest committed
    one under ``--warm-start-latest``, found as ``metaps ps --restore-latest`` finds it); ''."""
    if args.warm_start and args.warm_start_latest:
        raise ConfigError("metaps controller: pass --warm-start DIR or --warm-start-latest ROOT, not both")
    if not args.warm_start_latest:
        return str(args.warm_start)
    from ps.checkpoint import latest_checkpoint

    found = latest_checkpoint(args.warm_start_latest)
    return str(found) if found is not None else ""


def run_controller(args: argparse.Namespace) -> int:
    from controller.server import ControllerServer
    from metaps.job import load_job

    set_run_umask()  # LMDB state, address file: 0640 (common.security.RUN_UMASK)
    job = load_job(args.config)
    address = args.address or job.controller.address
    hosts = [address.rsplit(":", 1)[0]] + ([args.metrics_host] if args.metrics_port >= 0 else [])
    job = job.with_overrides(rpc=role_rpc(job.rpc, args.token_file, run_dir=job.run.dir, serve_hosts=hosts,
                                          insecure=args.insecure, what="metaps controller"))
    check_bind(hosts, job.rpc.resolved_token(), insecure=args.insecure, what="metaps controller", serves=True)
    from controller.ps_mover import MigrationPsMover
    from ps.fleet_admin import GrpcPsFleet  # the app floor wires the PS fleet into the controller

    state_dir = _state_dir(job, args.state_dir)
    fleet = GrpcPsFleet(job.rpc)
    server = ControllerServer(job.controller, state_dir, job_datasets(job), job.rpc, ps_fleet=fleet,
                              end_fleet=args.exit_when_done, expected_workers=job.train.workers,
                              warm_start=_warm_start(args))
    server.checkpoint_root = str(checkpoint_root(args.checkpoint_root, state_dir.resolve().parent))
    if args.continue_from_cut:
        server.continue_from_latest_cut()
    server.ps_mover = MigrationPsMover(server.ps_addresses, fleet,  # PS register their addresses
                                       keep=job.controller.nd.keep)
    try:
        if args.metrics_port >= 0:
            # /metrics binds first: a port in use is one line, and no address file names a controller
            # that never served (the address file is written once gRPC serves)
            from prometheus_client import REGISTRY

            from controller.metrics import ControllerCollector
            from common.metrics import serve_metrics

            REGISTRY.register(ControllerCollector(server))
            mport = serve_metrics(args.metrics_port, args.metrics_host, what="metaps controller",
                                  publish=args.metrics_file or None)
            log.info("controller metrics", extra=kv(metrics_port=mport))
        server.start(address)
    except BaseException:
        server.stop()  # LMDB and the state dir's lock, whatever failed
        raise
    log.info("controller serving", extra=kv(address=server.address, checkpoint_root=server.checkpoint_root))
    signalled = []

    def on_signal(signum: int, frame: Any) -> None:
        signalled.append(signum)
        server.shutdown_requested.set()

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    server.wait()
    summary = status_summary(server.status())[0]
    server.stop()
    log.info("controller exiting", extra=kv(run=summary["run"], reason=summary["reason"] or "-",
                                            coverage=summary["coverage"]))
    if args.termination_log:
        _write_termination_log(Path(args.termination_log), summary)
    ended = server.outcome.end_fleet and server.outcome.ended
    return server.outcome.exit_code if ended or not signalled else args.signal_exit_code


def _write_termination_log(path: Path, summary: dict[str, Any]) -> None:
    """The pod's termination message (``kubectl describe pod``): the outcome, one JSON line, < 4 KiB."""
    import json

    out = {k: summary[k] for k in ("run", "reason", "coverage", "checkpoint", "checkpoint_step", "checkpoint_final")}
    if summary["run"] == "failed":  # its state is never reused (a process joining it is refused)
        out["relaunch"] = ("relaunch under a new run name (metaps deploy k8s --run-name NEW, --warm-start-from "
                           "the last good checkpoints to keep the model), after deleting this run's Jobs")
    line = json.dumps(out, default=str)[:4000]
    try:
        path.write_text(line + "\n")
    except OSError as exc:
        log.warning("cannot write the termination log", extra=kv(path=str(path), error=exc.strerror))


def status_summary(st: dict[str, Any]) -> tuple[dict[str, Any], list[str]]:
    """The controller status (``ControllerServer.status`` / ``ControllerClient.status``) as a
    short result: (one JSON-able dict, the human lines).

    Args:
        st: the status mapping.
    """
    from controller.run_outcome import outcome_checkpoint
    from metaps.run_report import coverage_text

    run = st.get("run") or {"state": "running", "reason": ""}
    state = str(run.get("state") or "running")
    cov = st.get("coverage") or {}
    cov_status = {"running": "running", "complete": "succeeded"}.get(state, "failed")
    cov_line = coverage_text(cov, cov_status, str(run.get("reason") or ""))
    counts: dict[str, dict[str, int]] = {}
    for n in st.get("nodes") or []:
        by = counts.setdefault(str(n["role"]), {})
        by[str(n["state"])] = by.get(str(n["state"]), 0) + 1
    # the leader's final checkpoint once it is written, even when a cut was committed after it
    last = outcome_checkpoint(st.get("checkpoints") or [])
    final = bool(last and last.get("final"))
    ckpt = (f"{last.get('dir', '')} (cut {last.get('cut_id')}, step {last.get('step')}"
            f"{', final' if final else ''})" if last else "none committed")
    datasets = [{k: d.get(k) for k in ("dataset", "epoch", "epochs", "shards_done", "shards_total",
                                       "batches_done", "batches_total")} for d in st.get("datasets") or []]
    reason = str(run.get("reason") or "")
    data: dict[str, Any] = {"run": state, "reason": reason, "coverage": cov_line,
                            "coverage_fraction": cov.get("fraction"), "nodes": counts,
                            "checkpoint": last.get("dir", "") if last else "",
                            "checkpoint_step": last.get("step") if last else None, "checkpoint_final": final,
                            "datasets": datasets}
    lines = [f"run         {state}" + (f": {reason}" if reason else ""), f"coverage    {cov_line}"]
    for d in datasets:
        lines.append(f"  {d['dataset']:<9} epoch {d['epoch']}/{d['epochs']}: {d['shards_done']}/{d['shards_total']} "
                     f"shards, {d['batches_done']}/{d['batches_total']} batches")
    lines.append("nodes       " + "; ".join(f"{role} " + ", ".join(f"{v} {k}" for k, v in sorted(by.items()))
                                          for role, by in sorted(counts.items())) if counts else "nodes       none")
    lines.append(f"checkpoint  {ckpt}")
    return data, lines


def _controller_client(args: argparse.Namespace) -> Any:
    """A ControllerClient for ``status`` / ``cut``: ``--controller``, ``$METAPS_CONTROLLER`` or the
    job's state dir's address file; the token from ``--token-file``, else the job's ``[rpc]`` (a
    launched run's ``RUN/job.toml`` names its 0600 ``RUN/rpc.token``), else ``$METAPS_TOKEN``,
    else ``<[run] dir>/rpc.token`` (:func:`common.security.client_rpc`)."""
    from controller.client import ControllerClient
    from metaps.job import load_job

    job = load_job(args.config)
    # RUN/job.toml of `metaps launch` names the run's 0600 token file ([rpc] token_file = RUN/rpc.token)
    job = job.with_overrides(rpc=client_rpc(job.rpc, args.token_file, run_dir=job.run.dir, config=args.config,
                                            what=f"metaps {args.command}"))
    return ControllerClient(_controller_address(job, args.controller, args.config), job.rpc, retry_s=5.0)


def run_status(args: argparse.Namespace) -> int:
    """``metaps status``: exit 0 while running or complete, 4 when the run failed."""
    from controller.client import ControllerError
    from common import exit_codes
    from metaps.roles.output import emit

    with _controller_client(args) as c:
        try:
            st = c.status()
        except ControllerError as exc:
            raise ConfigError(f"controller {c.address}: {exc.details or exc.code.name}") from None
        addr = c.address
    data, lines = status_summary(st)
    emit(args, {"controller": addr, **data}, lines)
    return exit_codes.RUN_FAILED if data["run"] == "failed" else exit_codes.OK


def run_cut(args: argparse.Namespace) -> int:
    """``metaps cut``: request a cut; with ``--wait``, exit 0 once it committed, 1 if it did not in time."""
    import time

    from controller.client import ControllerError
    from metaps.roles.output import emit

    with _controller_client(args) as c:
        try:
            cut_id = c.request_cut(args.reason)
            state = "requested"
            deadline = time.monotonic() + args.wait
            while args.wait > 0 and state not in ("committed", "aborted") and time.monotonic() < deadline:
                time.sleep(0.5)
                cuts = {int(x["cut_id"]): x for x in c.status(events_since=2**62)["checkpoints"]}
                state = str(cuts.get(cut_id, {}).get("state", "pending"))
        except ControllerError as exc:
            raise ConfigError(f"controller {c.address}: {exc.details or exc.code.name}") from None
    emit(args, {"cut_id": cut_id, "state": state}, f"checkpoint cut {cut_id}: {state}")
    return 0 if state == "committed" or args.wait <= 0 else 1


def run_agent(args: argparse.Namespace) -> int:
    from controller.agent import Agent, default_child_cmd
    from metaps.job import load_job

    set_run_umask()
    job = load_job(args.config)
    job = job.with_overrides(rpc=role_rpc(job.rpc, args.token_file, run_dir=job.run.dir, what="metaps agent"))
    check_bind(["127.0.0.1"], job.rpc.resolved_token(), insecure=args.insecure, what="metaps agent")
    addr = _controller_address(job, args.controller, args.config)
    child = [c for c in args.child if c != "--"] or default_child_cmd(args.role, args.index, args.config)
    agent = Agent(job.controller.agent, args.role, args.index, addr, job.rpc, child)
    if args.metrics_port >= 0:
        from prometheus_client import REGISTRY

        from controller.metrics import AgentCollector
        from common.metrics import serve_metrics

        REGISTRY.register(AgentCollector(agent))
        serve_metrics(args.metrics_port, what=f"metaps agent {args.role}:{args.index}",
                      publish=args.metrics_file or None)
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())
    signal.signal(signal.SIGINT, lambda *_: agent.stop())
    return agent.run()
