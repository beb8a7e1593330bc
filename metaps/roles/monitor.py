"""``metaps monitor``: a local Prometheus (+ Grafana) over a run's metrics, or the files and commands for one.

::

    metaps monitor --run runs/main/runs/latest [--prometheus-port 9090] [--grafana-port 3000] [--print]

Writes the scrape config, alert rules and Grafana provisioning next to the run's
targets file (:func:`metaps.monitoring.write_stack`); then starts ``prometheus`` and
``grafana-server`` when they are on ``PATH``, or prints the two commands (always with
``--print``).

What it starts it stops: each program runs in a process group of its own, and when
``metaps monitor`` ends -- SIGINT (Ctrl-C), SIGTERM, SIGHUP (its terminal closed), or every
program it started exited -- every group gets SIGTERM, then SIGKILL after
:data:`STOP_GRACE_S`, so no Prometheus or Grafana (nor a process either started) outlives
it. Each program also gets a death signal (``setpriv --pdeathsig``, :func:`metaps.fleet.
with_death_signal`): a SIGKILLed ``metaps monitor`` takes them with it where ``setpriv``
exists. Exit code: 130 / 143 / 129 after SIGINT / SIGTERM / SIGHUP, else the first non-zero
exit code of the programs (0 when they exited cleanly).
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path
from typing import Any

from common.log import kv
from metaps.fleet import with_death_signal
from metaps.monitoring import write_stack
from metaps.roles.output import emit

log = logging.getLogger(__name__)

STOP_GRACE_S = 10.0
"""SIGTERM -> SIGKILL grace for each program ``metaps monitor`` started."""


def register(subparsers: argparse._SubParsersAction) -> None:  # type: ignore[type-arg]
    p = subparsers.add_parser("monitor", help="a local Prometheus + Grafana over a run's metrics (or their files)")
    p.add_argument("--run", required=True, type=Path, help="a run directory of `metaps launch` (or runs/latest)")
    p.add_argument("--prometheus-port", type=int, default=9090, help="local Prometheus port")
    p.add_argument("--grafana-port", type=int, default=3000, help="local Grafana port")
    p.add_argument("--print", action="store_true", dest="print_only",
                   help="write the files and print the commands; start nothing")
    p.set_defaults(func=run_monitor)


def run_monitor(args: argparse.Namespace) -> int:
    files = write_stack(args.run.resolve(), args.prometheus_port, args.grafana_port)
    found = {cmd[0]: shutil.which(cmd[0]) for cmd in files.commands}
    lines = [f"targets:    {files.targets}", f"prometheus: {files.prometheus}", f"rules:      {files.rules}",
             f"grafana:    {files.grafana}"]
    if args.print_only or not found["prometheus"]:
        why = "" if args.print_only else " (prometheus is not on PATH)"
        lines += [f"start them with{why}:", *("  " + " ".join(cmd) for cmd in files.commands)]
        emit(args, {"targets": str(files.targets), "prometheus": str(files.prometheus), "rules": str(files.rules),
                    "grafana": str(files.grafana), "commands": [list(c) for c in files.commands], "started": []},
             lines)
        return 0
    stop = threading.Event()
    signalled: list[int] = []

    def on_signal(signum: int, frame: Any) -> None:
        signalled.append(signum)
        stop.set()

    old = {sig: signal.signal(sig, on_signal) for sig in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)}
    procs: list[subprocess.Popen[bytes]] = []
    try:
        for cmd in files.commands:
            if found[cmd[0]] and not stop.is_set():
                # a process group of its own: stopping it stops whatever it started, and a Ctrl-C at the
                # terminal reaches metaps monitor only (which then stops the groups, in order)
                procs.append(subprocess.Popen(with_death_signal(cmd), start_new_session=True))
        started = [cmd[0] for cmd in files.commands if found[cmd[0]]]
        log.info("monitoring started", extra=kv(started=",".join(started), pids=",".join(str(p.pid) for p in procs),
                                                prometheus=f"http://127.0.0.1:{args.prometheus_port}",
                                                grafana=f"http://127.0.0.1:{args.grafana_port}"
                                                if found["grafana-server"] else "-"))
        while not stop.is_set() and any(p.poll() is None for p in procs):
            stop.wait(0.5)
    finally:
        stop_groups(procs, STOP_GRACE_S)
        for sig, handler in old.items():
            signal.signal(sig, handler)
    if signalled:
        return 128 + signalled[0]
    return next((p.returncode for p in procs if p.returncode), 0)


def stop_groups(procs: list[subprocess.Popen[bytes]], grace_s: float) -> None:
    """SIGTERM every process group of ``procs`` (each started with ``start_new_session``), then
    SIGKILL what is left after ``grace_s``; reaps the leaders.

    Args:
        procs: the programs started, each the leader of its own process group.
        grace_s: how long the groups get to stop after SIGTERM.
    """
    def signal_groups(sig: int) -> None:
        for p in procs:
            try:
                os.killpg(p.pid, sig)  # the group outlives a leader that exited: its children too
            except (ProcessLookupError, PermissionError):
                pass

    signal_groups(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            log.warning("did not stop after SIGTERM: killing its process group", extra=kv(pid=p.pid, grace_s=grace_s))
    signal_groups(signal.SIGKILL)
    for p in procs:
        p.wait()
    log.info("monitoring stopped", extra=kv(pids=",".join(str(p.pid) for p in procs)))
