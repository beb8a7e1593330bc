"""Worker indices for pods that have none: the Kubernetes work-queue Job.

A Job with ``parallelism`` N and no ``completions`` gives its pods no rank; each
worker asks the controller (``ClaimWorker``) for an index by its pod name::

    same name as before          -> the same index (a restarted container keeps its id)
    a new name                   -> the lowest index no live worker holds: never claimed, or
                                    its holder is dead in the registry (NodeDown, heartbeat
                                    timeout) since after it was claimed (a claim newer than
                                    the death is a pod still starting)

so scaling the Job up hands a newcomer a fresh index (the DDS leases it shards
once it registers) and scaling down then up reuses a leaver's index. Claims live in
the controller's LMDB (``meta`` db, ``worker_claim:<name>``), so a restarted
controller keeps them.

Example::

    claims = WorkerClaims(store, registry)
    claims.claim("metaps-worker-x7k2p")   # 0
    claims.claim("metaps-worker-q9d4s")   # 1
    claims.claim("metaps-worker-x7k2p")   # 0 again
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Callable

from controller.node_registry import NodeRegistry, NodeState
from controller.state import StateStore
from common.log import kv

log = logging.getLogger(__name__)

_PREFIX = "worker_claim:"
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,252}$")


class WorkerClaims:
    """Pod name -> worker index, persistent and thread-safe.

    Args:
        store: the controller's LMDB state.
        registry: the node registry (tells whether an index's holder is dead).
        clock: the registry's clock.
    """

    def __init__(self, store: StateStore, registry: NodeRegistry, clock: Callable[[], float] = time.time) -> None:
        self.store, self.registry, self.clock = store, registry, clock
        self._lock = threading.Lock()
        self._by_name: dict[str, tuple[int, float]] = {
            k.decode()[len(_PREFIX):]: (int(v["index"]), float(v["t"]))
            for k, v in store.items("meta", _PREFIX.encode())}

    def _live(self, index: int, claimed_at: float) -> bool:
        if not self.registry.known("worker", index):
            return True  # claimed, not registered yet: its pod is starting
        info = self.registry.get("worker", index)
        gone = info.state in (NodeState.DEAD, NodeState.DONE)
        return not gone or claimed_at > max(info.last_heartbeat, info.last_process_heartbeat)

    def claim(self, name: str) -> int:
        """The worker index of pod ``name`` (see the module docstring).

        Raises:
            ValueError: ``name`` is not a pod name (DNS label characters, 1-253 long).
        """
        if not _NAME.match(name or ""):
            raise ValueError(f"ClaimWorker: name {name!r} is not a pod name (letters, digits, '.', '_', '-')")
        with self._lock:
            if name in self._by_name:
                return self._by_name[name][0]
            held: dict[int, list[str]] = {}
            newest: dict[int, float] = {}
            for holder, (idx, t) in self._by_name.items():
                held.setdefault(idx, []).append(holder)
                newest[idx] = max(newest.get(idx, t), t)
            index = 0
            while index in held and self._live(index, newest[index]):
                index += 1
            for old in held.get(index, []):  # a dead holder's claim passes to the newcomer
                del self._by_name[old]
                with self.store.begin(write=True) as txn:
                    txn.delete(f"{_PREFIX}{old}".encode(), db=self.store.db("meta"))
            now = self.clock()
            self._by_name[name] = (index, now)
            self.store.put_json("meta", f"{_PREFIX}{name}", {"index": index, "t": now})
        log.info("worker index claimed", extra=kv(name=name, index=index, reused_from=held.get(index, [])))
        return index
