"""What ``metaps launch`` checks, besides :func:`metaps.preflight.preflight`, before it starts anything.

Each problem is collected and reported together in one line (a
:class:`~metaps.preflight.PreflightError`); nothing is created or started before::

    run dir      the run directory (and its checkpoints/) can be created: the nearest
                 existing parent is a writable directory
    hosts        [ps] host and the controller's host can be bound on this machine
    ports        every configured port is free: [ps] base_port + k for each shard k,
                 the port of [controller] address, a fixed [train] allreduce_port
                 (port 0: the server binds one the kernel picks, nothing to check)

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
    """'' when ``host:port`` can be bound (port 0: any free port), else why not.

    ``SO_REUSEADDR`` as the servers set it: a port only in TIME_WAIT (a run that just ended) is free
    to them; one that a process listens on, or holds bound without it, is not.
    """
    bind = "127.0.0.1" if host in _WILDCARD else host.strip("[]")
    if not 0 <= port <= 65535:
        return f"{what} {host}:{port}: not a TCP port (0-65535)"
    try:
        infos = socket.getaddrinfo(bind, port, type=socket.SOCK_STREAM)
    except OSError as exc:
        return f"{what} {host!r}: cannot resolve it ({exc})"
    family, _, _, _, addr = infos[0]
    with socket.socket(family, socket.SOCK_STREAM) as s:
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind(addr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                return f"{what} {host}:{port}: the port is in use"
            return f"{what} {host!r}: cannot listen there on this machine ({exc.strerror})"
    return ""


def _port_problems(job: "JobConfig", ps_shards: int) -> list[str]:
    """A configured port that is in use (or out of range): [ps] base_port + k, [controller] address."""
    problems = []
    base = job.ps.base_port
    if base:
        for k in range(ps_shards):
            problems.append(_bind_problem(job.ps.host, base + k, f"[ps] base_port {base}: PS shard {k} binds"))
    host, _, cport = job.controller.address.rpartition(":")
    if cport.isdigit() and int(cport):
        problems.append(_bind_problem(host, int(cport), "[controller] address"))
    return problems


def launch_problems(job: "JobConfig", run_dir: Path, ps_shards: int | None = None) -> list[str]:
    """Every problem :func:`check_launch` would report (empty: fine).

    Args:
        job: the parsed job (overrides applied).
        run_dir: the run directory the launch will create.
        ps_shards: the number of PS shards the launch starts (default ``[ps] shards``).
    """
    problems = [_writable_parent(run_dir)]
    problems.append(_bind_problem(job.ps.host, 0, "[ps] host"))
    problems.append(_bind_problem(job.controller.address.rsplit(":", 1)[0], 0, "[controller] address host"))
    problems += _port_problems(job, job.ps.shards if ps_shards is None else ps_shards)
    port = int(getattr(job.train, "allreduce_port", 0) or 0)
    if port:
        problems.append(_bind_problem("127.0.0.1", port, "[train] allreduce_port"))
    return [p for p in problems if p]


def check_launch(job: "JobConfig", run_dir: Path, resume: str = "", ps_shards: int | None = None) -> None:
    """Preflight plus the launch checks: raise one PreflightError listing every problem.

    Nothing is created or started; the caller does that only after this returns.

    Args:
        job: the parsed job (overrides applied).
        run_dir: the run directory the launch will create.
        resume: the resolved checkpoint to warm-start from ('' = cold).
        ps_shards: the number of PS shards the launch starts (default ``[ps] shards``).

    Raises:
        metaps.preflight.PreflightError: the problems, in one line.
    """
    from metaps.preflight import PreflightError, preflight

    problems = launch_problems(job, run_dir, ps_shards)
    try:
        preflight(job, resume=resume)
    except PreflightError as exc:
        raise PreflightError(exc.problems + problems) from None
    if problems:
        raise PreflightError(problems)
