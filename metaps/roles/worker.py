"""``metaps worker`` and ``metaps train-local``.

A worker without a token warns; a non-loopback ``--metrics-host`` without one is
refused unless ``--insecure`` (see :mod:`metaps.core.security`).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path
from typing import Any

from metaps.core.security import add_cli_args


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
    add_cli_args(p)
    p.set_defaults(func=_run_worker)

    p = subparsers.add_parser("train-local", help="train in one process with local tables (the parity reference)")
    p.add_argument("--config", required=True, help="job TOML")
    p.add_argument("--run-dir", default="", help="run directory (default [run].dir)")
    p.add_argument("--max-steps", type=int, default=None, help="override [train].max_steps")
    p.set_defaults(func=_run_local)


def _load(args: argparse.Namespace, **train_overrides: Any) -> Any:
    from metaps.job import load_job

    overrides = {"train": {k: v for k, v in train_overrides.items() if v is not None}}
    return load_job(args.config, overrides=overrides)


def _run_worker(args: argparse.Namespace) -> int:
    from metaps.core.security import check_bind, role_rpc, set_private_umask
    from workers.worker import run_worker

    set_private_umask()  # worker reports, checkpoints (rank 0's commit): 0600 / 0700
    job = _load(args)
    job = job.with_overrides(rpc=role_rpc(job.rpc, args.token_file))
    check_bind([args.metrics_host] if args.metrics_port >= 0 else [], job.rpc.resolved_token(),
               insecure=args.insecure, what="metaps worker")
    from metaps.deploy.pod import resolve_worker

    ctl = args.controller or os.environ.get("METAPS_CONTROLLER", "")
    args.rank, addrs = resolve_worker(job, args.config, args.rank, args.ps or os.environ.get("METAPS_PS", ""), ctl)
    run_dir = Path(args.run_dir or job.run.dir)
    if args.metrics_port >= 0:
        from metaps.core.metrics import serve_metrics

        serve_metrics(args.metrics_port, args.metrics_host)
    rep = run_worker(job, args.rank, addrs, ctl, run_dir)
    print(json.dumps({k: rep[k] for k in ("rank", "steps", "samples", "samples_per_s")}))
    return 0


def _run_local(args: argparse.Namespace) -> int:
    from workers.local import train_local

    job = _load(args, max_steps=args.max_steps)
    from metaps.preflight import preflight

    preflight(job)
    rep, _ = train_local(job, Path(args.run_dir or job.run.dir))
    summary = {k: rep[k] for k in ("steps", "samples", "samples_per_s", "checkpoint")}
    summary["eval"] = rep["eval"]
    print(json.dumps(summary, indent=1))
    return 0
