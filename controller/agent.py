"""The per-node agent: runs one worker or PS process and keeps it going.

::

              start child
    STARTING -------------> RUNNING --child exits 0--------------------------> DONE (exit 0)
        ^                    |   |  \\--SIGTERM / drain command--> STOPPING --> exit 0
        |                    |   +--restart command (slow or stalled worker): stop child (SIGTERM +
        |                    |   |  SIGCONT, so a SIGSTOPped child goes too), NodeDown, start again
        |   backoff          |  child crashes: NodeDown (its shards are requeued) right away
        +-- min(b*2^k, max) -+
                             +--crashes > restart_limit--> GAVE_UP (NodeDown "gave up", exit 1)
                             +--child exits 4 (run failed, or its final checkpoint could not be
                                written) or 5 (superseded)--> exit with that code, no restart

Every ``heartbeat_s`` the agent heartbeats as ``source=agent`` with the
child's RSS and CPU (from ``/proc``) and its restart count, and carries out the
commands in the reply: ``restart``, ``drain`` (stop the child, do not restart,
exit 0) and ``stop``. Batch sizes (DD) and checkpoint commands are not the
agent's business: the child learns them from its own heartbeat replies
(``commands``), since only the child can apply them between steps; all-reduce
workers switch batch sizes at a step they agree on (workers/dd.py).

The child gets ``METAPS_CONTROLLER`` (address), ``METAPS_NODE``
(``role:index``) and ``METAPS_RESTARTS`` (how many times this agent restarted
it: 0 for the first start) in its environment. A PS child started with
``METAPS_RESTARTS`` > 0 awaits the controller's fleet recovery before serving
data or checkpoints (``metaps/roles/ps.py``).

Example::

    agent = Agent(AgentConfig(restart_limit=3), "worker", 2, "127.0.0.1:7070", RpcConfig(),
                  child_cmd=["metaps", "worker", "--config", "job.toml", "--rank", "2"])
    sys.exit(agent.run())
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
import threading
import time
from typing import Mapping, Sequence

from controller.client import ControllerClient, ControllerError
from controller.config import AgentConfig
from common import exit_codes
from common.log import kv
from common.rpc import RpcConfig

log = logging.getLogger(__name__)

_PAGE = os.sysconf("SC_PAGE_SIZE")
_TICKS = os.sysconf("SC_CLK_TCK")


def proc_usage(pid: int) -> tuple[float, float]:
    """(RSS bytes, CPU seconds user+system) of ``pid`` from /proc; zeros if gone."""
    try:
        with open(f"/proc/{pid}/statm") as fh:
            rss = int(fh.read().split()[1]) * _PAGE
        with open(f"/proc/{pid}/stat") as fh:
            fields = fh.read().rsplit(")", 1)[1].split()
        cpu = (int(fields[11]) + int(fields[12])) / _TICKS  # utime, stime
        return float(rss), cpu
    except (OSError, IndexError, ValueError):
        return 0.0, 0.0


def default_child_cmd(role: str, index: int, config: str) -> list[str]:
    """``metaps ps --config CFG --shard K`` or ``metaps worker --config CFG --rank K``."""
    import sys

    flag = "--shard" if role == "ps" else "--rank"
    return [sys.executable, "-m", "metaps", role, "--config", config, flag, str(index)]


class Agent:
    """Supervises one child process for node ``role:index``. See the module docstring.

    Args:
        cfg: heartbeat period, restart limit and backoff.
        role: ``worker`` or ``ps``.
        index: the node index.
        controller: controller ``host:port``.
        rpc_cfg: job RPC settings (token).
        child_cmd: the command to run (injectable; tests run a small python child).
        env: extra environment for the child.
    """

    def __init__(self, cfg: AgentConfig, role: str, index: int, controller: str, rpc_cfg: RpcConfig | None,
                 child_cmd: Sequence[str], env: Mapping[str, str] | None = None) -> None:
        cfg.validate()
        if role not in ("worker", "ps"):
            raise ValueError(f"agent role must be 'worker' or 'ps', got {role!r}")
        if not child_cmd:
            raise ValueError("agent child_cmd is empty")
        self.cfg = cfg
        self.role, self.index = role, index
        self.controller = controller
        self.child_cmd = list(child_cmd)
        self.env = {**os.environ, **(env or {}), "METAPS_CONTROLLER": controller, "METAPS_NODE": f"{role}:{index}"}
        # short retry: a heartbeat must not block supervision while the controller restarts
        self.client = ControllerClient(controller, rpc_cfg, role, index, source="agent",
                                       retry_s=max(1.0, cfg.heartbeat_s))
        self.child: subprocess.Popen[bytes] | None = None
        self.restarts = 0
        self.crashes = 0
        self._stop = threading.Event()
        self._cpu_prev: tuple[float, float] | None = None

    @property
    def node(self) -> str:
        return f"{self.role}:{self.index}"

    def stop(self) -> None:
        """Ask :meth:`run` to stop the child cleanly and return (signal-safe)."""
        self._stop.set()

    def _start_child(self) -> None:
        self.child = subprocess.Popen(self.child_cmd, env={**self.env, "METAPS_RESTARTS": str(self.restarts)})
        self._cpu_prev = None
        log.info("child started", extra=kv(node=self.node, pid=self.child.pid, restarts=self.restarts))

    def _stop_child(self) -> int | None:
        """SIGTERM (+ SIGCONT: a stopped child acts on it), wait ``stop_grace_s``, then SIGKILL.

        Returns:
            the child's exit code.
        """
        child = self.child
        if child is None or child.poll() is not None:
            return None if child is None else child.returncode
        child.send_signal(signal.SIGTERM)
        child.send_signal(signal.SIGCONT)  # a SIGSTOPped (stalled) child would hold SIGTERM pending forever
        try:
            return child.wait(self.cfg.stop_grace_s)
        except subprocess.TimeoutExpired:
            log.warning("child ignored SIGTERM; killing", extra=kv(node=self.node, pid=child.pid))
            child.kill()
            return child.wait()

    def _report_down(self, reason: str, exit_code: int) -> None:
        try:
            requeued = self.client.node_down(self.role, self.index, reason, exit_code)
            log.info("reported child down", extra=kv(node=self.node, reason=reason, requeued=len(requeued)))
        except ControllerError as exc:
            log.warning("could not report child down", extra=kv(node=self.node, error=exc))

    def _usage(self) -> tuple[float, float]:
        if self.child is None or self.child.poll() is not None:
            return 0.0, 0.0
        rss, cpu_s = proc_usage(self.child.pid)
        now = time.monotonic()
        pct = 0.0
        if self._cpu_prev is not None and now > self._cpu_prev[0]:
            pct = 100.0 * (cpu_s - self._cpu_prev[1]) / (now - self._cpu_prev[0])
        self._cpu_prev = (now, cpu_s)
        return rss, max(pct, 0.0)

    def _heartbeat(self) -> list[str]:
        """Heartbeat; returns the kinds of the commands received."""
        rss, cpu = self._usage()
        alive = self.child is not None and self.child.poll() is None
        try:
            reply = self.client.heartbeat(rss_bytes=rss, cpu_percent=cpu, child_alive=alive,
                                          child_restarts=self.restarts)
        except ControllerError as exc:
            log.warning("heartbeat failed", extra=kv(node=self.node, error=exc))
            return []
        return [c.kind for c in reply.commands]

    def run(self) -> int:
        """Supervise until the child finishes (0), a drain/stop/SIGTERM (0), the restart limit (1)
        or the child exits with :data:`~common.exit_codes.RUN_FAILED` / ``SUPERSEDED``
        (that code: restarting it cannot help)."""
        try:
            self.client.register()
        except ControllerError as exc:
            log.warning("agent could not register; will retry in heartbeats", extra=kv(node=self.node, error=exc))
        self._start_child()
        next_hb = 0.0
        try:
            while not self._stop.is_set():
                assert self.child is not None
                rc = self.child.poll()
                if rc is not None:
                    if rc == 0:
                        log.info("child finished", extra=kv(node=self.node))
                        return 0
                    if rc in (exit_codes.RUN_FAILED, exit_codes.SUPERSEDED):
                        # the controller failed the run (or the child's final checkpoint could not be
                        # written: it told the controller, which failed the run) or fenced the child
                        # off: a restart cannot help
                        log.error("child ended the run or was stopped by the controller; not restarting",
                                  extra=kv(node=self.node, code=rc))
                        return rc
                    self.crashes += 1
                    self._report_down(f"child exited with code {rc}", rc)
                    if self.crashes > self.cfg.restart_limit:
                        log.error("restart limit reached; giving up",
                                  extra=kv(node=self.node, crashes=self.crashes, limit=self.cfg.restart_limit))
                        self._report_down(f"gave up after {self.crashes} crashes (restart_limit "
                                          f"{self.cfg.restart_limit})", rc)
                        return 1
                    delay = min(self.cfg.backoff_s * 2 ** (self.crashes - 1), self.cfg.backoff_max_s)
                    log.warning("child crashed; restarting after backoff",
                                extra=kv(node=self.node, code=rc, crashes=self.crashes, backoff_s=delay))
                    if self._stop.wait(delay):
                        break
                    self.restarts += 1
                    self._start_child()
                    continue
                now = time.monotonic()
                if now >= next_hb:
                    next_hb = now + self.cfg.heartbeat_s
                    for kind in self._heartbeat():
                        if kind == "restart":
                            code = self._stop_child()
                            self._report_down("restart command from the controller", code or 0)
                            self.restarts += 1
                            self._start_child()
                        elif kind in ("drain", "stop"):
                            log.info("stopping on command", extra=kv(node=self.node, command=kind))
                            self._stop_child()
                            return 0
                self._stop.wait(min(0.05, self.cfg.heartbeat_s))
            self._stop_child()
            return 0
        finally:
            self._stop_child()
            self.client.close()
