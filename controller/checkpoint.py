"""Coordinated checkpoint cuts: the DDS side of a consistent checkpoint.

Every ``checkpoint_interval_s`` the controller opens a cut: it snapshots the
DDS (ledger head + epochs), stores it as *pending* with a ``cut_id`` and sends
a ``checkpoint`` command carrying that id to every live worker and PS. When
the checkpoint is written, its writer calls ``CheckpointDone(cut_id, step,
dir)`` and the cut becomes *committed*. Recovery rolls the DDS back to the
newest committed cut: shards done after it go back to TODO, their ledger
entries are marked replayed.

    trigger ---> PENDING(cut_id, dds snapshot) --CheckpointDone--> COMMITTED(step, dir)
                    |
                    +--fleet restored to an earlier cut (PS restart)--> ABORTED (a late commit is ignored)

**The final checkpoint is a cut too.** Its writer (the leader, once every dataset is done)
calls ``CheckpointDone`` with ``cut_id`` :data:`FINAL_CUT` (0): the controller records it as a
committed cut of the DDS at that moment (:meth:`CheckpointCoordinator.commit_final`), and
refuses it (FAILED_PRECONDITION) while any dataset is unfinished. A PS restarted after the run
finished is therefore restored to the final checkpoint and the rollback to its cut requeues
nothing: a finished run stays finished (not rolled back to an older interval cut).

**A warm start is cut 0.** A run that begins from another run's checkpoint (``metaps
controller --warm-start DIR``: every PS restored that checkpoint before training) records it,
once, as its first committed cut with the DDS at its start (:meth:`CheckpointCoordinator.
commit_warm_start`). A PS lost before the run's own first cut is then restored to the
warm-start checkpoint and the DDS rolled back to the beginning, instead of failing the run
for want of a committed cut.

Samples of shards that were DOING at the cut were partly trained before the
checkpoint was taken; they are replayed after a rollback (counted in the ledger
as replayed, never lost).

Example::

    ckpt = CheckpointCoordinator(store, dds)
    cut_id = ckpt.open_cut()
    ckpt.commit(cut_id, step=1200, directory="runs/x/ckpt-1200")
    ckpt.rollback_to_latest()
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Callable

from controller.dds import DynamicDataSharding
from controller.state import StateStore, key_seq, seq_key, dumps, loads
from controller.types import FINAL_CUT, DdsCut
from common.errors import MetapsError
from common.log import kv

log = logging.getLogger(__name__)


class UnknownCut(MetapsError):
    code = "not_found"


class RunNotFinished(MetapsError):
    """A final checkpoint reported while a dataset is still being trained."""

    code = "failed_precondition"


class CheckpointCoordinator:
    """Stores cuts in LMDB (``cuts`` database).

    Args:
        store: the controller's state.
        dds: the DDS to snapshot and roll back.
        clock: ``time.time``-like.
    """

    def __init__(self, store: StateStore, dds: DynamicDataSharding, clock: Callable[[], float] = time.time) -> None:
        self._store = store
        self._dds = dds
        self._clock = clock
        self._lock = threading.Lock()

    def open_cut(self) -> int:
        """Snapshot the DDS now; return the new cut's id (pending until committed)."""
        with self._lock:
            cut = self._dds.snapshot()
            with self._store.begin(write=True) as txn:
                cut_id = max(1, self._store.next_seq(txn, "cuts"))
                txn.put(seq_key(cut_id), dumps({"cut_id": cut_id, "state": "pending", "dds": cut.to_json(),
                                                 "opened": self._clock(), "step": -1, "dir": ""}),
                        db=self._store.db("cuts"))
            log.info("checkpoint cut opened", extra=kv(cut_id=cut_id, ledger_seq=cut.ledger_seq))
            return cut_id

    def commit(self, cut_id: int, step: int, directory: str) -> dict[str, Any]:
        """Record that the checkpoint of ``cut_id`` is written at ``directory``."""
        with self._lock:
            with self._store.begin(write=True) as txn:
                raw = txn.get(seq_key(cut_id), db=self._store.db("cuts"))
                if raw is None:
                    raise UnknownCut(f"checkpoint cut {cut_id} was never opened (step {step}, dir {directory!r})")
                body = loads(raw)
                if body["state"] == "aborted":
                    # the fleet was restored to an earlier cut after this one opened: its
                    # checkpoint may mix pre- and post-restore state, never roll back to it
                    log.warning("checkpoint of an aborted cut ignored",
                                extra=kv(cut_id=cut_id, step=step, dir=directory, reason=body.get("reason", "")))
                    return body
                body.update(state="committed", step=int(step), dir=directory, committed=self._clock())
                txn.put(seq_key(cut_id), dumps(body), db=self._store.db("cuts"))
            log.info("checkpoint cut committed", extra=kv(cut_id=cut_id, step=step, dir=directory))
            return body

    def commit_final(self, step: int, directory: str) -> dict[str, Any]:
        """Record the run's final checkpoint as a committed cut of the DDS now.

        The caller has checked that every dataset is done (the DDS snapshot then holds every
        ledger entry, so a rollback to this cut requeues nothing). The same report again (its
        reply was lost) returns the cut already recorded.

        Args:
            step: the checkpoint's step.
            directory: where it was written.
        """
        with self._lock:
            for body in self.cuts():
                if body.get("final") and body["dir"] == directory and body["state"] == "committed":
                    return body
            body = self._put_committed(int(step), directory, "final")
            log.info("final checkpoint committed as a cut", extra=kv(cut_id=body["cut_id"], step=step, dir=directory,
                                                                     ledger_seq=body["dds"]["ledger_seq"]))
            return body

    def commit_warm_start(self, directory: str) -> dict[str, Any] | None:
        """Record the warm-start checkpoint as the run's first committed cut (cut 0 of the run).

        Only on a state with no cut at all (the run's first start): a restarted controller, or a
        run that already cut, keeps its cuts. The DDS snapshot is the run's start, so a rollback to
        it replays everything the run trained. Returns the cut recorded, or None.

        Args:
            directory: the checkpoint every PS restored before training.
        """
        with self._lock:
            if self.cuts():
                return None
            body = self._put_committed(0, directory, "warm_start")
            log.info("warm-start checkpoint recorded as the run's first cut",
                     extra=kv(cut_id=body["cut_id"], dir=directory))
            return body

    def _put_committed(self, step: int, directory: str, flag: str) -> dict[str, Any]:
        """A cut of the DDS now, committed at once (no trigger, no command), marked ``flag`` (lock held)."""
        cut = self._dds.snapshot()
        now = self._clock()
        with self._store.begin(write=True) as txn:
            cut_id = max(1, self._store.next_seq(txn, "cuts"))
            body = {"cut_id": cut_id, "state": "committed", "dds": cut.to_json(), "opened": now,
                    "step": step, "dir": directory, "committed": now, flag: True}
            txn.put(seq_key(cut_id), dumps(body), db=self._store.db("cuts"))
        return body

    def abort_pending(self, reason: str) -> list[int]:
        """Mark every pending cut aborted (a later commit of one is ignored); returns their ids."""
        with self._lock:
            aborted = []
            with self._store.begin(write=True) as txn:
                db = self._store.db("cuts")
                pending = [(bytes(k), loads(raw)) for k, raw in txn.cursor(db)]
                for key, body in pending:
                    if body["state"] == "pending":
                        body.update(state="aborted", reason=reason, aborted=self._clock())
                        txn.put(key, dumps(body), db=db)
                        aborted.append(int(body["cut_id"]))
            if aborted:
                log.info("pending checkpoint cuts aborted", extra=kv(cuts=aborted, reason=reason))
            return aborted

    def cuts(self) -> list[dict[str, Any]]:
        return [body for _, body in self._store.items("cuts")]

    def latest_committed(self) -> dict[str, Any] | None:
        done = [c for c in self.cuts() if c["state"] == "committed"]
        return done[-1] if done else None

    def rollback_to(self, cut_id: int, also: Callable[[Any, list[str]], None] | None = None) -> list[str]:
        """Roll the DDS back to a committed cut; returns the shards returned to TODO.

        Args:
            also: called inside the rollback's LMDB transaction (``DynamicDataSharding.rollback_to``).
        """
        body = next((c for c in self.cuts() if c["cut_id"] == cut_id), None)
        if body is None or body["state"] != "committed":
            raise UnknownCut(f"checkpoint cut {cut_id} is {'unknown' if body is None else body['state']}; "
                             f"only committed cuts can be rolled back to")
        return self._dds.rollback_to(DdsCut.from_json(body["dds"]), also)

    def rollback_to_latest(self) -> list[str]:
        latest = self.latest_committed()
        if latest is None:
            raise UnknownCut("no committed checkpoint cut to roll back to")
        return self.rollback_to(int(latest["cut_id"]))


__all__ = ["FINAL_CUT", "CheckpointCoordinator", "RunNotFinished", "UnknownCut", "key_seq"]
