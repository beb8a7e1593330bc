"""The ``launch``, ``config-write`` and ``run-report`` subcommands (thin: parse, check, hand over)."""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
from pathlib import Path
from typing import Any

from common.errors import ConfigError
from common.log import kv
from metaps.roles.overrides import apply_overrides, describe, parse_sets
from metaps.launch.config import LaunchConfig, find_resume_checkpoint, write_job, parse_override
from metaps.launch.launcher import Launcher


log = logging.getLogger(__name__)


def register(subparsers: Any) -> None:
    """Add ``launch``, ``config-write`` and ``run-report`` to the ``metaps`` command line.

    Args:
        subparsers: the ``metaps`` parser's subparsers (see :mod:`metaps.cli`).
    """
    p = subparsers.add_parser("launch", help="run a controller, PS shards and workers on this machine")
    p.add_argument("--config", default="", help="job TOML (required unless --resume: the run's own job.toml)")
    p.add_argument("--workers", type=int, default=None, help="worker processes (default [train] workers)")
    p.add_argument("--ps", type=int, default=None, help="PS shards (default [ps] shards)")
    p.add_argument("--run-dir", default="", help="run directory, new or empty (default [run] dir/<name>-<time>)")
    p.add_argument("--resume-from", default="", help="warm start: a run dir, checkpoints dir or checkpoint")
    p.add_argument("--resume", default="", metavar="RUN",
                   help="continue the interrupted run RUN from its last committed cut (its data accounting, "
                        "model and step counters; nothing trained twice beyond the cut)")
    p.add_argument("--timeout", type=float, default=0.0, help="fail the run after this many seconds (0: none)")
    p.add_argument("--no-progress", action="store_true", help="no live view; a progress log line every 10 s")
    p.add_argument("--file-log-level", default="INFO", metavar="LEVEL",
                   help="level of the fleet's log files RUN/logs/*.log (--log-level sets the console's only)")
    p.add_argument("--token-file", default="",
                   help="auth token file (0600): read it, or create it with the run's token (default [rpc] token_file)")
    p.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE", dest="sets",
                   help="override a job-file key (VALUE is TOML; bare words are text); repeatable")
    p.set_defaults(func=_cmd_launch)

    c = subparsers.add_parser("config-write", help="write a job TOML with overrides (per-host configs)")
    c.add_argument("--config", required=True, help="job TOML to start from")
    c.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                   help="override (VALUE is a TOML value; bare words are strings); repeatable")
    c.add_argument("--out", required=True,
                   help="file to write: the source file with the overrides, comments and layout kept")
    c.set_defaults(func=_cmd_config_write)

    r = subparsers.add_parser("run-report", help="assemble report.json, TensorBoard logs and plots of a run dir")
    r.add_argument("--run-dir", required=True, help="the run directory (holds job.toml, workers/, controller/)")
    r.add_argument("--config", default="", help="job TOML (default RUN_DIR/job.toml)")
    r.add_argument("--controller", default="", help="controller host:port to read status from (optional)")
    r.add_argument("--ps", default="", help="PS addresses host:port,... to read stats from (optional)")
    r.add_argument("--out", default="",
                   help="write the assembled report here (JSON) instead of RUN_DIR/report.json, with no "
                        "TensorBoard logs or plots; needed when the run already has a report, which "
                        "run-report never overwrites")
    r.set_defaults(func=_cmd_run_report)


def _cmd_launch(args: argparse.Namespace) -> int:
    from common.security import set_run_umask

    from metaps.roles.output import emit, wants_json

    set_run_umask()  # every file of the run (logs, checkpoints, tb, plots) 0640, dirs 0750; the token 0600
    lc = LaunchConfig(config=args.config, workers=args.workers, ps=args.ps, run_dir=args.run_dir,
                      resume_from=args.resume_from, resume=args.resume, progress=not args.no_progress,
                      timeout_s=args.timeout,
                      token_file=args.token_file, sets=tuple(args.sets), file_log_level=args.file_log_level.upper())
    try:
        lc.validate()
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    if not wants_json(args):
        return Launcher(lc).run()
    import dataclasses

    from rich.console import Console

    # --json: stdout holds the one JSON object, stderr the log lines only: no live view (a progress
    # log line every 10 s instead), no tables (their figures are in the object and RUN/report.json)
    launcher = Launcher(dataclasses.replace(lc, progress=False), console=Console(stderr=True, quiet=True))
    code = launcher.run()
    rep = json.loads((launcher.run_dir / "report.json").read_text())
    emit(args, {k: rep.get(k) for k in ("status", "reason", "exit_code", "run_dir", "wall_s", "counts", "totals",
                                        "coverage_summary", "final_auc", "checkpoint", "resumed_from")}, "")
    return code


def _cmd_config_write(args: argparse.Namespace) -> int:
    """The source file with the overrides set: comments, blank lines and key order kept."""
    from common.atomic_write import write_text_atomic
    from common.config import read_toml
    from common.toml_writer import set_keys
    from metaps.job import job_from_mapping, load_job
    from metaps.roles.output import emit

    sets = parse_sets(args.set)
    where = describe(args.config, args.set)
    job_from_mapping(apply_overrides(read_toml(args.config), sets), where=where)  # errors name the source
    try:
        text = Path(args.config).read_text()
    except OSError as exc:
        raise ConfigError(f"{args.config}: cannot read: {exc.strerror}") from None
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out, set_keys(text, sets, where=args.config))
    load_job(out)  # what was written reads back
    emit(args, {"out": str(out), "config": args.config, "overrides": list(args.set)},
         f"wrote {out} ({args.config} with {len(args.set)} override(s))")
    return 0


def _cmd_run_report(args: argparse.Namespace) -> int:
    """Report of a fleet started by the scripts (or of a launch whose report was lost)."""
    from rich.console import Console

    from metaps.job import load_job
    from metaps.run_report import (
        build_report,
        print_summary,
        read_ledger,
        read_worker_reports,
        run_failure,
        write_report,
    )
    from metaps.tb import write_tensorboard

    run_dir = Path(args.run_dir).resolve()
    existing = run_dir / "report.json"
    if existing.exists() and not args.out:
        try:
            old = json.loads(existing.read_text())
            what = f"status {old.get('status', '?')}, coverage {old.get('coverage_summary', '?')}"
        except (OSError, ValueError):
            what = "unreadable"
        raise ConfigError(f"{existing} exists ({what}): run-report never overwrites a run's report; "
                          f"pass --out FILE to write the assembled report elsewhere")
    out_path = Path(args.out).resolve() if args.out else existing
    if out_path == existing and args.out and existing.exists():
        raise ConfigError(f"--out {args.out} is the run's own report.json; run-report never overwrites it")
    cfg = Path(args.config) if args.config else run_dir / "job.toml"
    job = load_job(cfg)
    if args.controller or args.ps:
        from common.security import client_rpc

        # the run's token: the 0600 file RUN/job.toml names (RUN/rpc.token), else $METAPS_TOKEN
        job = job.with_overrides(rpc=client_rpc(job.rpc, run_dir=run_dir, config=str(cfg), what="metaps run-report"))
    status = None
    if args.controller:
        from controller.client import ControllerClient, ControllerError

        try:
            with ControllerClient(args.controller, dataclasses.replace(job.rpc, timeout_s=5.0), retry_s=2.0) as c:
                status = c.status()
        except ControllerError as exc:
            log.warning("controller status unavailable", extra=kv(error=str(exc)[:200]))
    stats = None
    if args.ps:
        from ps.client import PsClient

        try:
            with PsClient([a for a in args.ps.split(",") if a], job.rpc, retry_timeout_s=5.0) as client:
                stats = client.stats()
        except Exception as exc:  # noqa: BLE001 -- PS already gone: report without its stats
            log.warning("PS stats unavailable", extra=kv(error=str(exc)[:200]))
    ports: dict[str, int | None] = {}
    for ready in sorted((run_dir / "ps").glob("ps-*.ready")):
        ports[ready.stem] = int(json.loads(ready.read_text())["metrics_port"])
    reports = read_worker_reports(run_dir)
    missing = sorted(set(range(job.train.workers)) - set(reports))
    failure = run_failure(status) or (f"no report from worker(s) {missing}" if missing else "")
    ok = not failure
    rep = build_report(run_dir, job, status="succeeded" if ok else "failed",
                       reason=failure, exit_code=0 if ok else 1,
                       ps_stats=stats, controller_status=status,
                       ledger=read_ledger(Path(job.controller.state_dir or run_dir / "controller")),
                       metrics_ports=ports, notes=["assembled by metaps run-report"])
    if args.out:
        from common.atomic_write import write_json_atomic

        out_path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(out_path, rep)
    else:
        write_report(run_dir, rep)
        from metaps.plots import make_plots  # matplotlib: only when drawing

        write_tensorboard(rep, run_dir / "tb")
        make_plots(rep, run_dir / "plots")
    from metaps.roles.output import emit, wants_json

    print_summary(Console(quiet=wants_json(args)), rep)  # --json: the one object on stdout, logs on stderr
    if wants_json(args):
        emit(args, {k: rep.get(k) for k in ("status", "reason", "exit_code", "run_dir", "counts", "totals",
                                            "coverage_summary", "final_auc", "checkpoint")}, "")
    return 0 if ok else 1


__all__ = [
    "LaunchConfig",
    "Launcher",
    "apply_overrides",
    "find_resume_checkpoint",
    "parse_override",
    "register",
    "write_job",
]

