"""``metaps controller`` and ``metaps agent`` subcommands.

::

    metaps controller --config job.toml [--address HOST:PORT] [--state-dir DIR]
    metaps agent --config job.toml --role worker --index 3 [--controller HOST:PORT] [-- CMD ...]

The controller serves until a Shutdown RPC or SIGTERM/SIGINT, or, with
``--exit-when-done``, until the run ends: then the PS processes are told to stop and
it exits 0 (complete) or 4 (failed; :mod:`metaps.core.exit_codes`). Its datasets are
the job's ``[data] train`` (``[train] epochs`` passes) and ``[data] eval``
(``[controller] eval_epochs`` passes); it writes its address to
``<state_dir>/address``. The agent finds the controller from ``--controller``,
``$METAPS_CONTROLLER`` or ``<state_dir>/address``. The ND policy's vshard moves
go through a ``MigrationPsMover`` over the addresses PS processes register
(``metaps ps --controller``); a PS process that registers again after a crash
makes the controller restore the fleet to the last committed cut
(``controller/ps_recovery.py``).

Security: as ``metaps ps`` (see :mod:`metaps.core.security`): no token -> a loud
warning and loopback only (a non-loopback ``--address`` is refused unless
``--insecure``); ``CheckpointDone`` dirs must lie under ``--checkpoint-root``
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

from metaps.core.errors import ConfigError
from metaps.core.log import kv
from metaps.core.security import add_cli_args, check_bind, checkpoint_root, role_rpc, set_private_umask

log = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    p = subparsers.add_parser("controller", help="run the AntDT controller (DDS, monitor, policy)")
    p.add_argument("--config", required=True, help="job TOML")
    p.add_argument("--address", default="", help="listen address (default [controller] address)")
    p.add_argument("--state-dir", default="", help="LMDB state dir (default [controller] state_dir or <run.dir>/controller)")
    p.add_argument("--metrics-port", type=int, default=-1, help="Prometheus /metrics port (0 = free port, -1 = none)")
    p.add_argument("--metrics-host", default="127.0.0.1", help="address /metrics binds (0.0.0.0 in a pod)")
    p.add_argument("--exit-when-done", action="store_true",
                   help="when the run ends, stop the PS processes and exit: 0 complete, 4 failed "
                        "(the Kubernetes manifests use it; `metaps launch` stops the fleet itself)")
    add_cli_args(p, checkpoint_root=True)
    p.set_defaults(func=run_controller)

    a = subparsers.add_parser("agent", help="run and supervise one worker or PS process")
    a.add_argument("--config", required=True, help="job TOML")
    a.add_argument("--role", required=True, choices=["worker", "ps"], help="the role of the supervised process")
    a.add_argument("--index", required=True, type=int, help="its index: worker rank or PS shard")
    a.add_argument("--controller", default="", help="controller host:port")
    a.add_argument("--metrics-port", type=int, default=-1, help="Prometheus /metrics port (0 = free port, -1 = none)")
    add_cli_args(a)
    a.add_argument("child", nargs=argparse.REMAINDER, help="child command after '--' (default: metaps ROLE ...)")
    a.set_defaults(func=run_agent)


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


def run_controller(args: argparse.Namespace) -> int:
    from controller.server import ControllerServer
    from metaps.job import load_job

    set_private_umask()  # LMDB state, address file: 0600
    job = load_job(args.config)
    job = job.with_overrides(rpc=role_rpc(job.rpc, args.token_file))
    address = args.address or job.controller.address
    check_bind([address.rsplit(":", 1)[0]] + ([args.metrics_host] if args.metrics_port >= 0 else []),
               job.rpc.resolved_token(), insecure=args.insecure,
               what="metaps controller")
    from controller.ps_mover import MigrationPsMover
    from ps.fleet_admin import GrpcPsFleet  # the app floor wires the PS fleet into the controller

    state_dir = _state_dir(job, args.state_dir)
    fleet = GrpcPsFleet(job.rpc)
    server = ControllerServer(job.controller, state_dir, job_datasets(job), job.rpc, ps_fleet=fleet,
                              end_fleet=args.exit_when_done)
    server.checkpoint_root = str(checkpoint_root(args.checkpoint_root, state_dir.resolve().parent))
    server.ps_mover = MigrationPsMover(server.ps_addresses, fleet,  # PS register their addresses
                                       keep=job.controller.nd.keep)
    server.start(address)
    log.info("controller serving", extra=kv(address=server.address, checkpoint_root=server.checkpoint_root))
    if args.metrics_port >= 0:
        from prometheus_client import REGISTRY

        from controller.metrics import ControllerCollector
        from metaps.core.metrics import serve_metrics

        REGISTRY.register(ControllerCollector(server))
        mport = serve_metrics(args.metrics_port, args.metrics_host)
        log.info("controller metrics", extra=kv(metrics_port=mport))
    signal.signal(signal.SIGTERM, lambda *_: server.shutdown_requested.set())
    signal.signal(signal.SIGINT, lambda *_: server.shutdown_requested.set())
    server.wait()
    server.stop()
    state, reason = server.outcome.state()
    log.info("controller exiting", extra=kv(run=state.value, reason=reason or "-", exit_code=server.outcome.exit_code))
    return server.outcome.exit_code


def run_agent(args: argparse.Namespace) -> int:
    from controller.agent import Agent, default_child_cmd
    from metaps.job import load_job

    set_private_umask()
    job = load_job(args.config)
    job = job.with_overrides(rpc=role_rpc(job.rpc, args.token_file))
    check_bind(["127.0.0.1"], job.rpc.resolved_token(), insecure=args.insecure, what="metaps agent")
    addr = args.controller or os.environ.get("METAPS_CONTROLLER", "")
    if not addr:
        f = _state_dir(job, "") / "address"
        if not f.exists():
            raise ConfigError(f"{args.config}: no controller address: pass --controller, set METAPS_CONTROLLER "
                              f"or start the controller first (it writes {f})")
        addr = f.read_text().strip()
    child = [c for c in args.child if c != "--"] or default_child_cmd(args.role, args.index, args.config)
    agent = Agent(job.controller.agent, args.role, args.index, addr, job.rpc, child)
    if args.metrics_port >= 0:
        from prometheus_client import REGISTRY

        from controller.metrics import AgentCollector
        from metaps.core.metrics import serve_metrics

        REGISTRY.register(AgentCollector(agent))
        serve_metrics(args.metrics_port)
    signal.signal(signal.SIGTERM, lambda *_: agent.stop())
    signal.signal(signal.SIGINT, lambda *_: agent.stop())
    return agent.run()
