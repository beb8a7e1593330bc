"""``metaps worker`` and ``metaps train-local``.

``train-local`` takes ``--set SECTION.KEY=VALUE`` overrides and leaves a run directory
like ``launch`` (:mod:`metaps.roles.local_run`); both print a short summary, or one
JSON object with ``--json``.

A worker's token is ``[rpc] token``, ``token_file`` (``--token-file``), ``$METAPS_TOKEN``,
else the run's ``<[run] dir>/rpc.token`` that a hand-started PS or controller generated;
without one it warns; a non-loopback ``--metrics-host`` without one is refused unless
``--insecure`` (see :mod:`common.security`).
"""

from __future__ import annotations

import argparse
import logging
import os
from pathlib import Path
from typing import Any

from common.log import kv
from common.security import add_cli_args
from metaps.roles.output import emit

log = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("worker", help="run one training worker of a fleet")
    p.add_argument("--config", required=True, help="job TOML")
    p.add_argument("--rank", required=True,
                   help="worker index 0..[train].workers-1, or 'auto': $JOB_COMPLETION_INDEX (all-reduce) or an "
                        "index the controller gives this pod's name (PS mode; any number of workers)")
    p.add_argument("--ps", default="", help="PS addresses host:port,... in shard order, a pattern with {k} "
                                            "(ps-{k}.ps:5000), or 'controller' (default $METAPS_PS)")
    p.add_argument("--controller", default="", help="controller host:port (default $METAPS_CONTROLLER; none = static split)")
    p.add_argument("--run-dir", default="", help="run directory (default [run].dir)")
    p.add_argument("--metrics-port", type=int, default=-1, help="Prometheus /metrics port (0 = free port; default: none)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address the /metrics endpoint binds")
    p.add_argument("--metrics-file", default="", help="write {host, port, pid} of /metrics here (JSON) once it serves")
    p.add_argument("--start-step", type=int, default=0,
                   help="number steps from at least this one (a continued run: its checkpoint cut's step)")
    add_cli_args(p)
    p.set_defaults(func=_run_worker)

    p = subparsers.add_parser("train-local", help="train in one process with local tables (the parity reference)")
    p.add_argument("--config", required=True, help="job TOML")
    p.add_argument("--run-dir", default="",
                   help="run directory, new or empty (default [run].dir/<name>-<time>, pointed at by latest)")
    p.add_argument("--max-steps", type=int, default=None, help="override [train].max_steps (default: the job's)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", dest="sets",
                   help="override a job-file key (VALUE is TOML; bare words are text); repeatable")
    p.set_defaults(func=_run_local)


def _load(args: argparse.Namespace, **train_overrides: Any) -> Any:
    from common.config import read_toml
    from metaps.job import job_from_mapping
    from metaps.roles.overrides import apply_overrides, describe, parse_sets

    sets = list(getattr(args, "sets", []) or [])
    data = apply_overrides(read_toml(args.config), parse_sets(sets))
    for k, v in train_overrides.items():
        if v is not None:
            data.setdefault("train", {})[k] = v
    return job_from_mapping(data, where=describe(args.config, sets))


def _run_worker(args: argparse.Namespace) -> int:
    from common.security import check_bind, role_rpc, set_run_umask

    set_run_umask()  # worker reports, checkpoints (rank 0's commit): 0640 / 0750, group-readable
    job = _load(args)
    job = job.with_overrides(rpc=role_rpc(job.rpc, args.token_file, run_dir=job.run.dir,  # as the PS: [run] dir
                                          what="metaps worker"))
    check_bind([args.metrics_host] if args.metrics_port >= 0 else [], job.rpc.resolved_token(),
               insecure=args.insecure, what="metaps worker")
    from metaps.deploy.pod import resolve_worker

    ctl = args.controller or os.environ.get("METAPS_CONTROLLER", "")
    in_pod = str(args.rank) == "auto" and bool(ctl)  # no agent reports this process's death: it does
    from controller.client import ControllerError

    try:
        args.rank, addrs = resolve_worker(job, args.config, args.rank, args.ps or os.environ.get("METAPS_PS", ""), ctl)
    except ControllerError as exc:
        if not exc.run_ended:
            raise
        # a pod started as the run ended (the Job replaced a worker just then): nothing to train
        log.info("the run is complete; nothing to train", extra=kv(why=exc.details))
        emit(args, {"rank": None, "steps": 0, "samples": 0, "run_ended": True}, "the run is complete: nothing to train")
        return 0
    run_dir = Path(args.run_dir or job.run.dir)
    if args.metrics_port >= 0:
        from common.metrics import serve_metrics

        serve_metrics(args.metrics_port, args.metrics_host, what=f"metaps worker {args.rank}",
                      publish=args.metrics_file or None)
    from workers.worker import run_worker  # torch: only once the command line passed its checks

    try:
        rep = run_worker(job, args.rank, addrs, ctl, run_dir, start_step=args.start_step)
    except Exception as exc:
        if in_pod:
            from metaps.deploy.pod import leave_on_failure

            leave_on_failure(job, args.rank, ctl, f"worker failed: {str(exc).splitlines()[0] if str(exc) else exc!r}")
        raise
    out = {k: rep[k] for k in ("rank", "steps", "samples", "samples_per_s")}
    emit(args, out, f"worker {out['rank']}: {out['steps']} steps, {out['samples']:,} samples "
                    f"({out['samples_per_s']:,.1f} samples/s)")
    return 0


def _run_local(args: argparse.Namespace) -> int:
    from common.security import set_run_umask
    from metaps.roles.local_run import run_local
    from metaps.run_report import flat_auc, shown_path

    set_run_umask()  # as launch: the run's files 0640, directories 0750
    job = _load(args, max_steps=args.max_steps)
    rep, run_dir = run_local(job, args.run_dir)
    w = rep["worker"]
    auc = flat_auc(w.get("eval") or {})
    summary = {"status": rep["status"], "run_dir": str(run_dir), "steps": w["steps"], "samples": w["samples"],
               "samples_per_s": w["samples_per_s"], "checkpoint": str(w["checkpoint"] or ""), "auc": auc}
    lines = [f"train-local: {w['steps']} steps, {w['samples']:,} samples ({w['samples_per_s']:,.1f} samples/s)",
             f"checkpoint    {shown_path(str(w['checkpoint'])) if w['checkpoint'] else '-'}"]
    lines += [f"auc           " + "  ".join(f"{k}={v:.4f}" for k, v in sorted(auc.items()))] if auc else []
    lines.append(f"run directory: {shown_path(str(run_dir))}")
    emit(args, summary, lines)
    return 0
