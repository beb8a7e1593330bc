"""Registered nodes (workers, PS), their liveness and their pending commands.

A node is ``role:index``. Both the node's process and its agent talk to the
controller under that name (``source`` = ``process`` | ``agent``); commands
are queued for one of them and handed out in its next heartbeat reply::

    register ----> ALIVE --(no heartbeat for heartbeat_timeout_s / agent reports death)--> DEAD
                    |  ^                                                                    |
                    |  +----------------------- register / heartbeat again -----------------+
                    +--(drain command)--> DRAINING --(process exits)--> DEAD
                    +--(the process reports itself finished)--> DONE --(register again)--> ALIVE

Registrations are stored in LMDB; a restarted controller reloads them and
gives every node a fresh heartbeat grace period.

A process registers with a random ``incarnation_id`` (one per process start) and,
in a pod, its pod UID. A registration under a new id is a new incarnation of the
node (a restart or a replaced pod: the pid says nothing, a fresh PID namespace
reuses it). A heartbeat still carrying an older id comes from a superseded process
(a replaced pod that has not died yet): it is fenced off with a ``stop`` command
and changes nothing. Pending commands are memory
only: a command lost in a controller restart is re-decided by the policy.

Example::

    reg = NodeRegistry(store)
    reg.register("worker", 0, address="127.0.0.1:7000", incarnation_id="5f0c...")
    reg.enqueue("worker", 0, "restart", target="agent", reason="slow")
"""

from __future__ import annotations

import enum
import itertools
import threading
import time
from dataclasses import asdict, dataclass, field
from typing import Any, Callable

from controller.state import StateStore
from common import exit_codes
from controller.types import ROLES, SOURCES, BadNode, Command, UnknownNode, check_node

AGENT_COMMANDS = ("restart", "drain", "stop")
PROCESS_COMMANDS = ("set_batch_size", "checkpoint", "stop", "release_clock", "rejoin_clock", "truncate")


class NodeState(str, enum.Enum):
    ALIVE = "alive"
    DEAD = "dead"
    DRAINING = "draining"
    DONE = "done"  # the process finished its part of the run and left (controller/run_outcome.py)


@dataclass
class NodeInfo:
    role: str
    index: int
    address: str = ""
    metrics_port: int = 0
    pid: int = 0
    incarnation: int = 0
    incarnation_id: str = ""
    pod_uid: str = ""
    state: NodeState = NodeState.ALIVE
    registered_at: float = 0.0
    last_heartbeat: float = 0.0
    last_process_heartbeat: float = 0.0
    step: int = 0
    rss_bytes: float = 0.0
    cpu_percent: float = 0.0
    slow: bool = False
    batch_size: int = 0
    restarts: int = 0
    stopped: str = ""  # a worker that stopped training early says why ("max_steps"); '' = it did not
    metrics: dict[str, float] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{self.role}:{self.index}"

    def persistent(self) -> dict[str, Any]:
        d = asdict(self)
        d["state"] = self.state.value
        for k in ("last_heartbeat", "last_process_heartbeat", "metrics", "rss_bytes", "cpu_percent", "step"):
            d.pop(k)
        return d


class NodeRegistry:
    """Thread-safe node table. See the module docstring.

    Args:
        store: LMDB state (``nodes`` database).
        clock: ``time.time``-like.
    """

    def __init__(self, store: StateStore, clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._clock = clock
        self._lock = threading.Lock()
        self._nodes: dict[tuple[str, int], NodeInfo] = {}
        self._queues: dict[tuple[str, int, str], list[Command]] = {}
        self._ids = itertools.count(1)
        now = clock()
        for _, body in store.items("nodes"):
            info = NodeInfo(**{**body, "state": NodeState(body["state"])})
            info.last_heartbeat = info.last_process_heartbeat = now  # grace after a controller restart
            self._nodes[(info.role, info.index)] = info

    def _save(self, info: NodeInfo) -> None:
        self._store.put_json("nodes", info.name, info.persistent())

    def register(self, role: str, index: int, address: str = "", metrics_port: int = 0, pid: int = 0,
                 source: str = "process", incarnation_id: str = "", pod_uid: str = "") -> NodeInfo:
        """Record a registration; a process's replaces the node's address, pid and identity.

        Raises:
            BadNode: a process registration without an incarnation id.
        """
        check_node(role, index, source)
        if source == "process" and not incarnation_id:
            raise BadNode(f"{role}:{index}: a process registers with an incarnation_id (a random id per process "
                          "start); got none")
        with self._lock:
            now = self._clock()
            info = self._nodes.get((role, index)) or NodeInfo(role, index, registered_at=now)
            if source == "process":
                info.address, info.metrics_port, info.pid = address, metrics_port, pid
                info.incarnation_id, info.pod_uid = incarnation_id, pod_uid
                info.stopped = ""
                info.incarnation += 1
                info.last_process_heartbeat = now
            info.state = NodeState.ALIVE
            info.last_heartbeat = now
            self._nodes[(role, index)] = info
            self._save(info)
            return info

    def get(self, role: str, index: int) -> NodeInfo:
        with self._lock:
            info = self._nodes.get((role, index))
        if info is None:
            known = sorted(i.name for i in self.nodes())
            raise UnknownNode(f"{role}:{index} is not registered; call RegisterNode first (known: {known})")
        return info

    def known(self, role: str, index: int) -> bool:
        return (role, index) in self._nodes

    def heartbeat(self, role: str, index: int, source: str = "process", step: int = 0, rss_bytes: float = 0.0,
                  cpu_percent: float = 0.0, metrics: dict[str, float] | None = None,
                  child_restarts: int = -1, incarnation_id: str = "",
                  stopped: str = "") -> tuple[NodeInfo, list[Command]] | None:
        """Record a heartbeat; return the node and its pending commands (None: not registered).

        A process heartbeat under an incarnation id other than the registered one comes
        from a superseded process: it gets only a ``stop`` command and records nothing.
        """
        check_node(role, index, source)
        with self._lock:
            info = self._nodes.get((role, index))
            if info is None:
                return None
            if source == "process" and incarnation_id and info.incarnation_id \
                    and incarnation_id != info.incarnation_id:
                why = (f"{exit_codes.STOP_SUPERSEDED}: {info.name} is now incarnation {info.incarnation_id} "
                       f"(pod {info.pod_uid or '-'}); this process ({incarnation_id}) must stop")
                return info, [Command(next(self._ids), "stop", "process", reason=why)]
            now = self._clock()
            info.last_heartbeat = now
            if source == "process":
                info.last_process_heartbeat = now
                info.step = max(info.step, step)
                if stopped and stopped != info.stopped:
                    info.stopped = stopped
                    self._save(info)
                if metrics:
                    info.metrics.update(metrics)
            else:
                if rss_bytes or cpu_percent:
                    info.rss_bytes, info.cpu_percent = rss_bytes, cpu_percent
                if child_restarts >= 0 and child_restarts != info.restarts:
                    info.restarts = child_restarts
                    self._save(info)
            if info.state is NodeState.DEAD:
                info.state = NodeState.ALIVE
                self._save(info)
            cmds = self._queues.pop((role, index, source), [])
            return info, cmds

    def enqueue(self, role: str, index: int, kind: str, target: str = "process", **params: Any) -> Command:
        """Queue a command for the node's process or agent (handed out on its next heartbeat)."""
        check_node(role, index, target)
        allowed = AGENT_COMMANDS if target == "agent" else PROCESS_COMMANDS
        if kind not in allowed:
            raise BadNode(f"command {kind!r} cannot go to a {target}; allowed: {list(allowed)}")
        with self._lock:
            cmd = Command(next(self._ids), kind, target, **params)
            self._queues.setdefault((role, index, target), []).append(cmd)
            if kind == "drain" and (role, index) in self._nodes:
                self._nodes[(role, index)].state = NodeState.DRAINING
            return cmd

    def set_batch_sizes(self, sizes: dict[int, int]) -> None:
        """Set every worker's batch size at once (readers never see a mix of old and new)."""
        with self._lock:
            for index, batch_size in sizes.items():
                info = self._nodes.get(("worker", index))
                if info is not None:
                    info.batch_size = batch_size
                    self._save(info)

    def set_slow(self, role: str, index: int, slow: bool) -> None:
        with self._lock:
            info = self._nodes.get((role, index))
            if info is not None and info.slow != slow:
                info.slow = slow
                self._save(info)

    def mark_done(self, role: str, index: int) -> bool:
        """The node's process finished and left; True when it was not already done."""
        return self._set_state(role, index, NodeState.DONE)

    def pending(self, role: str, index: int, target: str = "process", kind: str = "") -> bool:
        """Commands queued for the node's process (or agent) not yet handed out (of ``kind`` only,
        when given)."""
        with self._lock:
            queue = self._queues.get((role, index, target)) or []
            return any(not kind or c.kind == kind for c in queue)

    def retire_all(self) -> list[str]:
        """A new attempt of the run (``metaps launch --resume``): every node is marked dead and
        forgets its incarnation, so the new attempt's processes register as fresh ones, not as
        restarts (the attempt restores the fleet itself). Returns the nodes' names."""
        with self._lock:
            for info in self._nodes.values():
                info.state, info.incarnation_id, info.pod_uid, info.stopped = NodeState.DEAD, "", "", ""
                self._save(info)
            return sorted(i.name for i in self._nodes.values())

    def mark_dead(self, role: str, index: int) -> bool:
        """True when the node was not already dead."""
        return self._set_state(role, index, NodeState.DEAD)

    def _set_state(self, role: str, index: int, state: NodeState) -> bool:
        with self._lock:
            info = self._nodes.get((role, index))
            if info is None or info.state is state:
                return False
            info.state = state
            self._save(info)
            return True

    def timed_out(self, timeout_s: float) -> list[NodeInfo]:
        """Live nodes with no heartbeat (from process or agent) for ``timeout_s``."""
        now = self._clock()
        with self._lock:
            return [i for i in self._nodes.values()
                    if i.state not in (NodeState.DEAD, NodeState.DONE) and now - i.last_heartbeat > timeout_s]

    def nodes(self) -> list[NodeInfo]:
        with self._lock:
            return sorted(self._nodes.values(), key=lambda i: (i.role, i.index))

    def alive(self, role: str | None = None) -> list[NodeInfo]:
        """Nodes neither dead nor done (draining ones included)."""
        return [i for i in self.nodes() if i.state not in (NodeState.DEAD, NodeState.DONE)
                and (role is None or i.role == role)]
