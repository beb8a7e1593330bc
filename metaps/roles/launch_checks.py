"""What ``metaps launch`` checks, besides :func:`metaps.preflight.preflight`, before it starts anything.

Each problem is collected and reported together in one line (a
:class:`~metaps.preflight.PreflightError`); nothing is created or started before::

    run dir      the run directory (and its checkpoints/) can be created: the nearest
                 existing parent is a writable directory
    hosts        [ps] host and the controller's host can be bound on this machine
                 (the launcher picks free ports on them)
    ports        a fixed [train] allreduce_port is free

Example::

    check_launch(job, Path("runs/local/runs/local-20260101-000000"), resume="")
"""

from __future__ import annotations

import errno
import os
import socket
from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from metaps.job import JobConfig

_WILDCARD = ("", "0.0.0.0", "::", "[::]")


def _writable_parent(d: Path) -> str:
    """'' when ``d`` can be created (or exists and is writable), else why not."""
    p = d
    while not p.exists():
        if p.parent == p:
            break
        p = p.parent
    if not p.is_dir():
        return f"run directory {d}: {p} is not a directory"
    if not os.access(p, os.W_OK | os.X_OK):
        return f"run directory {d}: {p} is not writable (checkpoints, logs and report.json go there)"
    return ""


def _bind_problem(host: str, port: int, what: str) -> str:
    """'' when ``host:port`` can be bound (port 0: any free port), else why not."""
    bind = "127.0.0.1" if host in _WILDCARD else host.strip("[]")
    try:
        infos = socket.getaddrinfo(bind, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"{what} {host!r}: cannot resolve it ({exc})"
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.bind(addr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"{what} {host}:{port}: the port is in use"
            return f"{what} {host!r}: cannot listen there on this machine ({exc.strerror})"
    return ""


def launch_problems(job: "JobConfig", run_dir: Path) -> list[str]:
    """Every problem :func:`check_launch` would report (empty: fine).

    Args:
        job: the parsed job (overrides applied).
        run_dir: the run directory the launch will create.
    """
    problems = [_writable_parent(run_dir)]
    problems.append(_bind_problem(job.ps.host, 0, "[ps] host"))
    problems.append(_bind_problem(job.controller.address.rsplit(":", 1)[0], 0, "[controller] address host"))
    port = int(getattr(job.train, "allreduce_port", 0) or 0)
    if port:
        problems.append(_bind_problem("127.0.0.1", port, "[train] allreduce_port"))
    return [p for p in problems if p]


def check_launch(job: "JobConfig", run_dir: Path, resume: str = "") -> None:
    """Preflight plus the launch checks: raise one PreflightError listing every problem.

    Nothing is created or started; the caller does that only after this returns.

    Args:
        job: the parsed job (overrides applied).
        run_dir: the run directory the launch will create.
        resume: the resolved checkpoint to warm-start from ('' = cold).

    Raises:
        metaps.preflight.PreflightError: the problems, in one line.
    """
    from metaps.preflight import PreflightError, preflight

    problems = launch_problems(job, run_dir)
    try:
        preflight(job, resume=resume)
    except PreflightError as exc:
        raise PreflightError(exc.problems + problems) from None
    if problems:
        raise PreflightError(problems)
