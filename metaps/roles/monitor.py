"""``metaps monitor``: a local Prometheus (+ Grafana) over a run's metrics, or the files and commands for one.

::

    metaps monitor --run runs/main/runs/latest [--prometheus-port 9090] [--grafana-port 3000] [--print]

Writes the scrape config, alert rules and Grafana provisioning next to the run's
targets file (:func:`metaps.monitoring.write_stack`); then starts ``prometheus`` and
``grafana-server`` when they are on ``PATH`` (until Ctrl-C), or prints the two commands
(always with ``--print``).
"""

from __future__ import annotations

import argparse
import logging
import shutil
import subprocess
from pathlib import Path

from common.log import kv
from metaps.monitoring import write_stack
from metaps.roles.output import emit

log = logging.getLogger(__name__)


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
    procs = [subprocess.Popen(list(cmd)) for cmd in files.commands if found[cmd[0]]]
    started = [cmd[0] for cmd in files.commands if found[cmd[0]]]
    log.info("monitoring started", extra=kv(started=",".join(started),
                                            prometheus=f"http://127.0.0.1:{args.prometheus_port}",
                                            grafana=f"http://127.0.0.1:{args.grafana_port}" if found["grafana-server"]
                                            else "-"))
    try:
        for p in procs:
            p.wait()
    except KeyboardInterrupt:
        for p in procs:
            p.terminate()
        for p in procs:
            p.wait(timeout=30)
        return 130
    return max((p.returncode or 0) for p in procs)
