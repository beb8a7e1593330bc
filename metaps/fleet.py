"""Process management for a local fleet: start, watch and stop process groups.

Every process the launcher starts (the controller, and one agent per PS shard
and per worker) gets its own session, hence its own process group; an agent's
child (the PS or worker) inherits that group. Stopping a member is::

    SIGTERM to the leader (the agent stops its child cleanly, then exits)
    wait up to grace seconds
    SIGKILL to the whole group (anything left: a hung child, a grandchild, or the
        child of a leader that exited politely without stopping it)
    wait until no process of the group is left (SIGKILL is asynchronous: a big
        process takes a while to be torn down, longer on a loaded machine)

so nothing of the fleet outlives the launcher, even when a child ignores
SIGTERM. The group id is the leader's pid (``start_new_session``), remembered in
the :class:`Member`, so the group is found and killed after the leader is gone. Leaders also get ``PR_SET_PDEATHSIG = SIGTERM``: if the launcher
itself is SIGKILLed they are told to stop.

The death signal is set by ``setpriv --pdeathsig TERM`` (util-linux) exec'ing the
member, not by a ``preexec_fn``: the launcher talks gRPC from several threads, and
a ``preexec_fn`` makes ``subprocess`` do a real ``fork()`` that runs gRPC's fork
handlers in the child, whose restarted poller then meets the epoll fd that
``close_fds`` closed and aborts the child before ``exec`` (grpcio >= 1.81,
grpc/grpc#43055; seen here as an agent restart that "died (signal 6)"; a probe with
two threads calling gRPC lost 8 of 300 ``/bin/true`` children that way, 0 of 300
without the ``preexec_fn``). Without one, ``subprocess`` uses ``vfork`` and no Python
or gRPC code runs between fork and exec. Where ``setpriv`` is missing the members
start without a death signal (logged once); ``stop`` still kills their groups.

Each member's stdout and stderr go to ``<log_dir>/<name>.log``.

Example::

    fleet = Fleet(Path("runs/x/logs"), env={"METAPS_T0": str(time.time())})
    ctl = fleet.start("controller", [sys.executable, "-m", "metaps", "controller", ...])
    ...
    fleet.stop_all(grace_s=15)
    assert not fleet.alive_pids()
"""

from __future__ import annotations

import logging
import os
import re
import shutil
import signal
import subprocess
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from common.errors import MetapsError
from common.log import kv

log = logging.getLogger(__name__)

_SETPRIV = shutil.which("setpriv")
_warned_no_setpriv = False


def with_death_signal(cmd: Sequence[str]) -> list[str]:
    """``cmd`` run with ``PR_SET_PDEATHSIG = SIGTERM`` (through ``setpriv``), or as is without it.

    Args:
        cmd: argv of a fleet member.
    """
    global _warned_no_setpriv
    if _SETPRIV is None:
        if not _warned_no_setpriv:
            _warned_no_setpriv = True
            log.info("setpriv not found: fleet members get no death signal (stop() still kills their groups)")
        return list(cmd)
    return [_SETPRIV, "--pdeathsig", "TERM", "--", *cmd]


@dataclass
class Member:
    """One started process (a group leader) of the fleet.

    Attributes:
        name: unique label, e.g. ``controller``, ``ps-0``, ``worker-1``.
        role: ``controller`` | ``ps`` | ``worker``.
        index: shard or rank (0 for the controller).
        cmd: the command line.
        proc: the running process.
        log_path: where its stdout/stderr go.
    """

    name: str
    role: str
    index: int
    cmd: list[str]
    proc: subprocess.Popen[bytes]
    log_path: Path
    started: float = field(default_factory=time.time)
    stopped_by_us: bool = False
    env: dict[str, str] = field(default_factory=dict)
    restarts: int = 0

    @property
    def pid(self) -> int:
        return self.proc.pid

    def poll(self) -> int | None:
        return self.proc.poll()


class FleetError(MetapsError, RuntimeError):
    """A member could not be started or did not become ready."""


class Fleet:
    """The processes of one run.

    Args:
        log_dir: directory for ``<name>.log`` files (created).
        env: extra environment for every member (on top of this process's).
        cwd: working directory of every member (default: this process's).
    """

    def __init__(self, log_dir: Path, env: Mapping[str, str] | None = None, cwd: Path | None = None) -> None:
        self.log_dir = Path(log_dir)
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, **(env or {})}
        self.cwd = cwd
        self.members: dict[str, Member] = {}

    # ---------------------------------------------------------------- start
    def start(self, name: str, cmd: Sequence[str], role: str = "", index: int = 0,
              env: Mapping[str, str] | None = None) -> Member:
        """Start ``cmd`` as the leader of a new process group; output to ``<name>.log``.

        Args:
            name: unique member name (also the log file name).
            cmd: argv.
            role / index: what the member is (for reports).
            env: extra environment for this member only.
        """
        if name in self.members:
            raise FleetError(f"fleet member {name!r} already started")
        log_path = self.log_dir / f"{name}.log"
        proc = self._popen(cmd, log_path, env or {})
        m = Member(name, role or name, index, list(cmd), proc, log_path, env=dict(env or {}))
        self.members[name] = m
        log.info("started", extra=kv(member=name, pid=proc.pid, log=str(log_path)))
        return m

    def _popen(self, cmd: Sequence[str], log_path: Path, env: Mapping[str, str]) -> subprocess.Popen[bytes]:
        with log_path.open("ab") as out:
            # no preexec_fn: it would force a real fork() running gRPC's fork handlers (module docstring)
            return subprocess.Popen(
                with_death_signal(cmd), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                env={**self.env, **env}, cwd=self.cwd, start_new_session=True,
            )

    def restart(self, name: str) -> Member:
        """Start an exited member again (same command, env and log file, a new process group).

        Whatever is left of its old group (a child that outlived its dead leader) is
        SIGKILLed first, and the restart waits until that group is empty.

        Raises:
            FleetError: unknown member, or its leader is still running.
        """
        m = self.members.get(name)
        if m is None:
            raise FleetError(f"no fleet member {name!r} to restart (members: {sorted(self.members)})")
        if m.poll() is None:
            raise FleetError(f"fleet member {name!r} (pid {m.pid}) is still running; stop it before a restart")
        _kill_group(m.pid)
        self.wait_gone([m.pid])
        m.proc = self._popen(m.cmd, m.log_path, m.env)
        m.restarts += 1
        m.started, m.stopped_by_us = time.time(), False
        log.info("restarted", extra=kv(member=name, pid=m.pid, restarts=m.restarts))
        return m

    # ---------------------------------------------------------------- watch
    def exited(self) -> dict[str, int]:
        """Members that have exited, with their exit codes."""
        return {n: rc for n, m in self.members.items() if (rc := m.poll()) is not None}

    def wait_file(self, path: Path, member: Member, timeout_s: float,
                  stop: Callable[[], bool] = lambda: False) -> None:
        """Wait until ``path`` exists; fail early if ``member`` exits or ``stop()`` turns true.

        Raises:
            FleetError: timeout, the member died (its log's tail is quoted), or stopped.
        """
        deadline = time.monotonic() + timeout_s
        while not path.exists():
            rc = member.poll()
            if rc is not None:
                raise FleetError(f"{member.name} exited with code {rc} before writing {path}; "
                                 f"log tail:\n{tail(member.log_path)}")
            if stop():
                raise FleetError(f"stopped while waiting for {member.name} ({path})")
            if time.monotonic() > deadline:
                raise FleetError(f"{member.name} did not write {path} within {timeout_s:.0f}s; "
                                 f"log tail:\n{tail(member.log_path)}")
            time.sleep(0.1)

    # ---------------------------------------------------------------- stop
    def stop(self, names: Sequence[str], grace_s: float = 15.0, sig: int = signal.SIGTERM) -> dict[str, int | None]:
        """Signal the leaders of ``names``, wait up to ``grace_s``, then SIGKILL their groups.

        Returns:
            exit code per member (None if it had to be killed and was not reaped).
        """
        members = [self.members[n] for n in names if n in self.members]
        for m in members:
            m.stopped_by_us = True
            if m.poll() is None:
                _signal_pid(m.pid, sig)
        deadline = time.monotonic() + grace_s
        for m in members:
            try:
                m.proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                log.warning("member ignored SIGTERM; killing its group", extra=kv(member=m.name, pid=m.pid))
        out: dict[str, int | None] = {}
        for m in members:
            _kill_group(m.pid)  # leftovers: a child that outlived its agent
            try:
                out[m.name] = m.proc.wait(5.0)
            except subprocess.TimeoutExpired:
                out[m.name] = None
        self.wait_gone([m.pid for m in members])
        return out

    def wait_gone(self, pgids: Sequence[int], timeout_s: float = 30.0) -> list[int]:
        """Wait until no live process is in any of ``pgids`` (re-sending SIGKILL); returns the pids left.

        Args:
            pgids: process groups (members' leader pids).
            timeout_s: give up after this long (the pids left are logged and returned).
        """
        groups = set(pgids)
        deadline = time.monotonic() + timeout_s
        while True:
            left = [pid for pid, pgid in _process_groups().items() if pgid in groups]
            if not left:
                return []
            if time.monotonic() > deadline:
                log.error("processes outlived SIGKILL of their group", extra=kv(pids=left, groups=sorted(groups)))
                return left
            for g in groups:
                _kill_group(g)
            time.sleep(0.02)

    def stop_all(self, grace_s: float = 15.0) -> None:
        """Stop every member (workers, then PS, then the controller)."""
        order = {"worker": 0, "ps": 1, "controller": 2}
        for role in sorted({m.role for m in self.members.values()}, key=lambda r: order.get(r, 3)):
            self.stop([n for n, m in self.members.items() if m.role == role], grace_s)

    def kill_all(self) -> None:
        """SIGKILL every member's group now (second Ctrl-C, or a launcher error)."""
        for m in self.members.values():
            _kill_group(m.pid)
        self.wait_gone([m.pid for m in self.members.values()])

    def alive_pids(self) -> list[int]:
        """Pids of any process still in one of the fleet's process groups."""
        groups = {m.pid for m in self.members.values()}
        return [pid for pid, pgid in _process_groups().items() if pgid in groups]


def _signal_pid(pid: int, sig: int) -> None:
    try:
        os.kill(pid, sig)
    except ProcessLookupError:
        pass


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _process_groups() -> dict[int, int]:
    """pid -> process group id of every live (non-zombie) process, from /proc."""
    out = {}
    for d in Path("/proc").iterdir():
        if not d.name.isdigit():
            continue
        try:
            stat = (d / "stat").read_text()
        except OSError:
            continue
        fields = stat.rsplit(")", 1)[1].split()
        if fields[0] == "Z":
            continue
        out[int(d.name)] = int(fields[2])
    return out


_ERROR_LINE = re.compile(r"(metaps [\w-]+: error: .*|^[\w.]*(?:Error|Exception|Timeout)[\w]*: .*)$", re.M)


def last_error(path: Path, lines: int = 200, width: int = 300) -> str:
    """The last error a role printed in its log: its CLI line (``metaps worker: error: ...``),
    else the final line of a traceback (``SomeError: ...``); '' when there is none.

    Args:
        path: the member's log (the agent's log holds its child's output too).
        lines: how many trailing lines to search.
        width: the returned text is cut to this many characters.
    """
    found = _ERROR_LINE.findall(tail(path, lines))
    return found[-1].strip()[:width] if found else ""


def tail(path: Path, lines: int = 20) -> str:
    """The last ``lines`` lines of a text file ('' if missing)."""
    try:
        with path.open("rb") as fh:
            fh.seek(0, os.SEEK_END)
            size = fh.tell()
            fh.seek(max(0, size - 16384))
            data = fh.read().decode(errors="replace")
    except OSError:
        return ""
    return "\n".join(data.splitlines()[-lines:])
