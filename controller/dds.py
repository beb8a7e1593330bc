"""Stateful Dynamic Data Sharding (DDS): who trains on which batches, durably.

A shard is a range of record batches of one file of one dataset in one epoch.
Each dataset (train and eval side by side) walks its epochs in order; inside
an epoch every shard goes through::

              get_shard (head of TODO; split if the worker wants smaller shards)
     TODO  ----------------------------------------------->  DOING(worker, attempt, deadline)
      ^  ^                                                      |   |
      |  +---- worker died / lease expired / hang / failed -----+   | report done
      |        (back to the HEAD of TODO, never dropped;            v
      |         ledger ``abandoned``: the holder may have pushed some of it)
      +------------- rollback_to(cut) <----------------------    DONE
                                                (ledger entry replayed)

    split:  TODO [s, e)  --(worker wants k < e-s)-->  DOING [s, s+k) + TODO head [s+k, e)
            the parent record becomes SPLIT (kept, so late reports on it are recognised)

    tail:   DOING [s, e) held by W, TODO empty, another worker told WAIT
            --tail_split: stop_at = W's first batch not started (durable)-->  `truncate` command to W
            W reports done with stop p (s < p <= e; p >= stop_at unless it stopped sooner):
            ONE transaction: [s, e) -> SPLIT, [s, p) DONE (one ledger entry), [p, e) head of TODO
            (p == e, or no stop: the whole shard, as usual; lease lost meanwhile: stale, and
            [s, e) went back whole)

When TODO is empty but shards are DOING, ``get_shard`` answers WAIT (one of
them may come back). **Tail fix** (``tail_split_min_batches``): a slow worker's
last lease would otherwise keep the others idle until it finishes. The worker
itself decides where it stops (never before a batch it already trained), so the
ledger still tiles every batch exactly once: [s, p) by W, [p, e) by whoever takes
the tail; a retried partial report (reply lost) is a ``retry``, a partial report
nobody asked for is refused and changes nothing. No batch is trained twice (this is
not a backup lease). When every shard of an epoch is DONE the next epoch is
created (shuffled with ``seed + epoch`` by :func:`common.shard_order.shard_order`,
the order train-local reads too) in the same transaction; after the last epoch the
dataset answers DONE.

Every transition is one LMDB write transaction (records + ledger + events), so
a controller killed at any point restarts from the last committed transition.
Memory holds the current epoch's records for speed and is rebuilt from LMDB on
start (and after any failed transaction).

This module is the engine; the values it takes and returns (DatasetSpec,
ShardLease, GetResult, ReportResult, DdsCut, the DDS errors) are the controller's
vocabulary in :mod:`controller.types` (re-exported here for old importers).

Example::

    dds = DynamicDataSharding(StateStore(tmp), DdsConfig(batches_per_shard=4),
                              [DatasetSpec("train", [10, 7], DatasetKind.TRAIN, epochs=2)])
    got = dds.get_shard(worker=0, dataset="train")
    if got.status is GetStatus.SHARD:
        dds.report(0, got.lease.shard_id, got.lease.attempt, "done", samples=256)
"""

from __future__ import annotations

import enum
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import lmdb

from controller.config import DdsConfig
from controller.ledger import Coverage, EntryKind, Ledger
from controller.state import Event, EventLog, StateStore, dumps, loads
from controller.types import (DatasetKind, DatasetSpec, DdsCut, DdsError, GetResult, GetStatus, ReportResult,
                              ReportStatus, ShardLease, StateMismatch, UnknownDataset, UnknownShard,
                              parse_shard_id)
from common.log import kv
from common.shard_order import shard_order

log = logging.getLogger(__name__)


class ShardState(str, enum.Enum):
    TODO = "todo"
    DOING = "doing"
    DONE = "done"
    SPLIT = "split"


@dataclass
class _Shard:
    dataset: str
    epoch: int
    file: int
    start: int
    stop: int
    state: ShardState = ShardState.TODO
    order: int = 0
    worker: int = -1
    attempt: int = 0
    failures: int = 0
    done_worker: int = -1
    done_attempt: int = 0
    # "<shard id>#<attempt>" of the done report this lease was granted with (report_and_get):
    # a retried combined request (reply lost) gets this lease back instead of a second one
    granted_with: str = ""
    # tail split: the holder was asked to stop this lease at this batch (0: not asked); durable
    stop_at: int = 0
    # memory only: a restart grants a fresh lease instead of trusting old clocks
    deadline: float = 0.0
    leased_at: float = 0.0
    progress: int = -1  # the next batch its holder will train (heartbeats); -1: not reported
    not_for: int = -1  # a tail split off this worker's lease: it does not take it back while another waits

    @property
    def id(self) -> str:
        return f"{self.dataset}:{self.epoch}:{self.file}:{self.start}-{self.stop}"

    @property
    def key(self) -> bytes:
        return shard_key(self.dataset, self.epoch, self.file, self.start, self.stop)

    @property
    def batches(self) -> int:
        return self.stop - self.start

    def to_json(self) -> dict[str, Any]:
        return {"dataset": self.dataset, "epoch": self.epoch, "file": self.file, "start": self.start,
                "stop": self.stop, "state": self.state.value, "order": self.order, "worker": self.worker,
                "attempt": self.attempt, "failures": self.failures, "done_worker": self.done_worker,
                "done_attempt": self.done_attempt, "granted_with": self.granted_with, "stop_at": self.stop_at}

    @staticmethod
    def from_json(d: dict[str, Any]) -> "_Shard":
        return _Shard(**{"stop_at": 0, **d, "state": ShardState(d["state"])})


def _abandoned_key(shard_id: str, worker: int, attempt: int) -> bytes:
    return f"abandoned/{shard_id}#{worker}#{attempt}".encode()


def shard_key(dataset: str, epoch: int, file: int, start: int, stop: int) -> bytes:
    return f"{dataset}\x00{epoch:08d}\x00{file:08d}\x00{start:012d}\x00{stop:012d}".encode()


@dataclass
class _Live:
    """In-memory mirror of one dataset's current epoch."""

    spec: DatasetSpec
    epoch: int = 0
    order_head: int = 0
    finished: bool = False
    records: dict[str, _Shard] = field(default_factory=dict)
    todo: deque[str] = field(default_factory=deque)
    doing: dict[str, _Shard] = field(default_factory=dict)
    sec_per_batch: float = 0.0  # EMA of completed shards, for the hang timeout
    waiting: dict[int, float] = field(default_factory=dict)  # worker -> when it was last told WAIT (memory)
    rolled_back_from: int = -1  # the latest epoch a rollback discarded (-1: none): its leases report "stale"
    closed: str = ""  # why it was closed before it was done ('' = not closed)

    def meta(self) -> dict[str, Any]:
        return {"spec": self.spec.to_json(), "epoch": self.epoch, "order_head": self.order_head,
                "finished": self.finished, "rolled_back_from": self.rolled_back_from, "closed": self.closed}


class DynamicDataSharding:
    """The DDS service object (thread-safe). See the module docstring for the states.

    Args:
        store: the controller's LMDB state.
        cfg: shard size, lease, hang timeout, seed.
        datasets: the job's datasets; on restart they must match what the state holds.
        events: where incidents go (requeues, failing shards, epochs).
        clock: ``time.time``-like, injectable for tests.
    """

    def __init__(self, store: StateStore, cfg: DdsConfig, datasets: Sequence[DatasetSpec],
                 events: EventLog | None = None, clock: Callable[[], float] = time.time) -> None:
        cfg.validate()
        self._store = store
        self._cfg = cfg
        self._events = events
        self._clock = clock
        self._lock = threading.RLock()
        self._batch: lmdb.Transaction | None = None  # the open txn of a combined transition
        self.ledger = Ledger(store)
        self._live: dict[str, _Live] = {}
        self._slow: set[int] = set()
        self._sizes: dict[int, int] = {}
        self._spb: dict[int, float] = {}  # worker -> EMA of its seconds per batch (done reports; memory)
        names = [d.name for d in datasets]
        if len(set(names)) != len(names):
            raise DdsError(f"duplicate dataset names: {names}")
        for d in datasets:
            try:
                d.validate()
            except ValueError as exc:
                raise DdsError(str(exc)) from None
        self._init(datasets)

    # ---------------------------------------------------------------- loading

    def _init(self, datasets: Sequence[DatasetSpec]) -> None:
        stored = {k.decode()[3:]: v for k, v in self._store.items("meta", b"ds/")}
        with self._store.begin(write=True) as txn:
            for spec in datasets:
                if spec.name in stored:
                    old = DatasetSpec.from_json(stored[spec.name]["spec"])
                    if old != spec:
                        raise StateMismatch(
                            f"dataset {spec.name}: state dir {self._store.path} holds "
                            f"{old.to_json()} but the job gives {spec.to_json()}; "
                            f"use a fresh state dir or the original dataset"
                        )
                    continue
                live = _Live(spec)
                self._create_epoch(txn, live, 0)
                self._put_meta(txn, live)
                log.info("dataset added", extra=kv(dataset=spec.name, kind=spec.kind.value,
                                                    batches=spec.total_batches, epochs=spec.epochs))
        self._load_all()

    def _load_all(self) -> None:
        """Rebuild memory from LMDB (start, restart, after a rollback or a failed txn)."""
        now = self._clock()
        live_map: dict[str, _Live] = {}
        for key, meta in self._store.items("meta", b"ds/"):
            live = _Live(DatasetSpec.from_json(meta["spec"]), int(meta["epoch"]),
                         int(meta["order_head"]), bool(meta["finished"]),
                         rolled_back_from=int(meta.get("rolled_back_from", -1)),  # (absent in older state)
                         closed=str(meta.get("closed", "")))
            prefix = f"{live.spec.name}\x00{live.epoch:08d}\x00".encode()
            todo = []
            for _, body in self._store.items("shards", prefix):
                rec = _Shard.from_json(body)
                live.records[rec.id] = rec
                if rec.state is ShardState.TODO:
                    todo.append(rec)
                elif rec.state is ShardState.DOING:
                    rec.deadline, rec.leased_at = now + self._cfg.lease_s, now
                    live.doing[rec.id] = rec
            live.todo = deque(r.id for r in sorted(todo, key=lambda r: r.order))
            live_map[live.spec.name] = live
        self._live = live_map
        self._slow = set(self._store.get_json("meta", "slow_workers", []))
        self._sizes = {int(k): int(v) for k, v in self._store.get_json("meta", "worker_sizes", {}).items()}

    def _create_epoch(self, txn: lmdb.Transaction, live: _Live, epoch: int) -> None:
        spec, bps = live.spec, self._cfg.batches_per_shard
        shards = shard_order(spec.batches_per_file, bps, self._cfg.seed, epoch, spec.name)  # train-local reads it too
        live.epoch, live.order_head, live.records, live.doing = epoch, 0, {}, {}
        live.todo = deque()
        for i, (f, s, e) in enumerate(shards):
            rec = _Shard(spec.name, epoch, f, s, e, order=i)
            live.records[rec.id] = rec
            live.todo.append(rec.id)
            txn.put(rec.key, dumps(rec.to_json()), db=self._store.db("shards"))

    def _put_meta(self, txn: lmdb.Transaction, live: _Live) -> None:
        txn.put(f"ds/{live.spec.name}".encode(), dumps(live.meta()), db=self._store.db("meta"))

    def _put(self, txn: lmdb.Transaction, rec: _Shard) -> None:
        txn.put(rec.key, dumps(rec.to_json()), db=self._store.db("shards"))

    def _txn(self) -> "_Transition | _Joined":
        if self._batch is not None:  # inside report_and_get: join its one transaction
            return _Joined(self._batch)
        return _Transition(self)

    # ---------------------------------------------------------------- queries

    @property
    def specs(self) -> dict[str, DatasetSpec]:
        return {n: l.spec for n, l in self._live.items()}

    def _get_live(self, dataset: str) -> _Live:
        live = self._live.get(dataset)
        if live is None:
            raise UnknownDataset(f"unknown dataset {dataset!r}; known: {sorted(self._live)}")
        return live

    def shard_size(self, worker: int) -> int:
        """Batches per shard this worker gets now (per-worker config, slow shrink)."""
        base = self._sizes.get(worker) or self._cfg.worker_batches_per_shard.get(str(worker), self._cfg.batches_per_shard)
        if worker in self._slow:
            return max(1, base // self._cfg.slow_shrink)
        return base

    def finished(self) -> bool:
        with self._lock:
            return all(l.finished for l in self._live.values())

    def holders(self) -> dict[int, list[str]]:
        """Shard ids currently DOING, by worker."""
        with self._lock:
            out: dict[int, list[str]] = {}
            for live in self._live.values():
                for rec in live.doing.values():
                    out.setdefault(rec.worker, []).append(rec.id)
            return out

    def progress(self) -> list[dict[str, Any]]:
        """Per dataset: epoch, shard counts by state and batches done in this epoch."""
        with self._lock:
            out = []
            for name, live in sorted(self._live.items()):
                counts = {s.value: 0 for s in ShardState}
                done_batches = 0
                for rec in live.records.values():
                    counts[rec.state.value] += 1
                    if rec.state is ShardState.DONE:
                        done_batches += rec.batches
                out.append({
                    "dataset": name, "kind": live.spec.kind.value, "epoch": live.epoch,
                    "epochs": live.spec.epochs, "finished": live.finished,
                    "shards_done": counts["done"], "shards_doing": counts["doing"],
                    "shards_todo": counts["todo"],
                    "shards_total": counts["done"] + counts["doing"] + counts["todo"],
                    "batches_done": done_batches if not live.finished else live.spec.total_batches,
                    "batches_total": live.spec.total_batches,
                })
            return out

    def coverage(self) -> Coverage:
        """Ledger coverage of every requested epoch: gaps are checked in the epochs
        finished so far (all once the dataset finished); ``complete`` only when every
        shard of every epoch of every dataset is done, ``state`` ``in_progress``
        while the DDS still hands out shards, ``fraction`` of the batches covered."""
        with self._lock:
            # gaps are problems in the epochs finished so far; a dataset closed on request left
            # its current epoch's rest undone on purpose (coverage says partial_by_request)
            epochs = {n: (l.spec.epochs if l.finished and not l.closed else l.epoch) for n, l in self._live.items()}
            cov = self.ledger.coverage(self.specs, epochs)
            cov.finished = all(l.finished for l in self._live.values())
            cov.closed = {n: l.closed for n, l in self._live.items() if l.closed}
            return cov

    def close(self, dataset: str, reason: str) -> bool:
        """Stop handing out ``dataset`` before it is done (a request: e.g. every worker reached its
        step limit). Its remaining shards stay undone (coverage says so, ``partial_by_request``);
        leases still out may report. Durable. Returns False when it was already finished.

        Raises:
            UnknownDataset: no such dataset.
        """
        with self._lock:
            live = self._get_live(dataset)
            if live.finished:
                return False
            live.finished, live.closed = True, reason
            with self._txn() as txn:
                self._put_meta(txn, live)
                self._event(txn, "controller", "dataset_closed", {"dataset": dataset, "reason": reason,
                                                                  "epoch": live.epoch}, "")
        log.warning("dataset closed before it was done", extra=kv(dataset=dataset, reason=reason))
        return True

    # ---------------------------------------------------------------- transitions

    def get_shard(self, worker: int, dataset: str) -> GetResult:
        """Lease the head of TODO to ``worker`` (split to its shard size), or WAIT / DONE."""
        _check_worker(worker)
        with self._lock:
            return self._get_locked(worker, dataset)

    def _get_locked(self, worker: int, dataset: str, granted_with: str = "") -> GetResult:
        live = self._get_live(dataset)
        if live.finished:
            return GetResult(GetStatus.DONE)
        now = self._clock()
        if not live.todo or self._tail_reserved(live, worker, now) or self._training_open(live):
            live.waiting[worker] = now
            return GetResult(GetStatus.WAIT)
        live.waiting.pop(worker, None)
        with self._txn() as txn:
            rec = live.records[live.todo.popleft()]
            size = self.shard_size(worker)
            if rec.batches > size:
                rec = self._split(txn, live, rec, size)
            rec.state, rec.worker, rec.attempt = ShardState.DOING, worker, rec.attempt + 1
            rec.deadline, rec.leased_at = now + self._cfg.lease_s, now
            rec.granted_with = granted_with
            live.doing[rec.id] = rec
            self._put(txn, rec)
        return GetResult(GetStatus.SHARD, ShardLease(rec.id, dataset, rec.epoch, rec.file, rec.start,
                                                      rec.stop, rec.attempt, self._cfg.lease_s))

    def _training_open(self, live: _Live) -> bool:
        """An eval dataset waits while any train dataset is unfinished: eval scores the final model.

        Workers evaluate only once training is DONE, so in a healthy run this never holds; it holds
        after a rollback (a PS recovery) reopened a finished train dataset: the eval shards the
        rollback returned must be scored again after the retraining, not by the rolled-back rows.
        """
        return live.spec.kind == DatasetKind.EVAL and any(
            not other.finished and other.spec.kind == DatasetKind.TRAIN for other in self._live.values())

    def _split(self, txn: lmdb.Transaction, live: _Live, parent: _Shard, size: int) -> _Shard:
        head = _Shard(parent.dataset, parent.epoch, parent.file, parent.start, parent.start + size,
                      order=parent.order)
        rest = _Shard(parent.dataset, parent.epoch, parent.file, parent.start + size, parent.stop,
                      order=parent.order, failures=parent.failures)
        parent.state = ShardState.SPLIT
        self._put(txn, parent)
        self._put(txn, rest)
        live.records[head.id] = head
        live.records[rest.id] = rest
        live.todo.appendleft(rest.id)  # the remainder keeps the parent's place: the head
        return head

    def report(self, worker: int, shard_id: str, attempt: int, status: ReportStatus | str,
               samples: int = 0, elapsed_s: float = 0.0, error: str = "", stop: int = 0,
               step_limit: bool = False) -> ReportResult:
        """Record a worker's result for a shard it leased.

        ``done`` by the lease holder -> DONE + ledger ``done``; the same report again
        -> ``retry`` (no-op); a done shard reported by another attempt -> ledger
        ``duplicate``; a report after the lease was lost -> ledger ``stale``.
        ``failed`` -> the shard returns to the head of TODO (never dropped).

        Args:
            stop: ``done`` only: the batch the worker stopped at when it was asked to stop
                the lease early (:meth:`tail_split`); ``start < stop < shard stop`` makes it a
                *partial* done (see the module doc). 0 or the shard's stop: the whole shard.
            step_limit: the worker reached its step limit at ``stop`` (a partial done it was
                not asked for: the rest of the lease goes back to TODO as for a tail split).
        """
        status = _check_report(worker, shard_id, attempt, status, samples, elapsed_s, stop)
        with self._lock:
            return self._report_locked(worker, shard_id, attempt, status, samples, elapsed_s, error, stop,
                                       step_limit)[0]

    def _report_locked(self, worker: int, shard_id: str, attempt: int, status: ReportStatus, samples: int,
                       elapsed_s: float, error: str, stop_at: int = 0,
                       step_limit: bool = False) -> tuple[ReportResult, _Shard]:
        ds, epoch, f, start, stop = parse_shard_id(shard_id)
        live = self._get_live(ds)
        rec = live.records.get(shard_id) if epoch == live.epoch else None
        if rec is None and epoch < live.epoch:
            body = self._read_shard(ds, epoch, f, start, stop)
            rec = _Shard.from_json(body) if body else None
        now = self._clock()
        entry = dict(time=now, dataset=ds, epoch=epoch, file=f, start=start, stop=stop,
                     worker=worker, attempt=attempt, samples=int(samples), elapsed_s=float(elapsed_s))
        bpf = live.spec.batches_per_file
        discarded = live.epoch < epoch <= live.rolled_back_from and f < len(bpf) and 0 <= start < stop <= bpf[f]
        if rec is None and discarded:
            # a lease of an epoch a rollback discarded (the worker held it across the fleet's recovery):
            # its samples trained a model state that was rolled back, so they count as replays
            with self._txn() as txn:
                self._stale(txn, shard_id, worker, attempt, entry)
            return ReportResult(False, False, "stale",
                                f"shard {shard_id}: epoch {epoch} was discarded by a rollback to epoch {live.epoch}; "
                                f"the report counts as a replay"), _Shard(ds, epoch, f, start, stop)
        if rec is None:
            raise UnknownShard(
                f"worker {worker}: unknown shard {shard_id} (dataset {ds} is in epoch {live.epoch}"
                f" with {len(live.records)} shards; file {f} has "
                f"{live.spec.batches_per_file[f] if f < len(live.spec.batches_per_file) else 'no such file'}"
                f" batches)"
            )
        holder = rec.state is ShardState.DOING and rec.worker == worker and rec.attempt == attempt
        if stop_at and status is ReportStatus.DONE:
            if not start < stop_at <= stop:
                raise DdsError(f"worker {worker}: shard {shard_id}: stopped at batch {stop_at}, expected a batch in "
                               f"({start}, {stop}]")
            if stop_at < stop:
                partial = self._partial_done(live, rec, worker, attempt, stop_at, samples, elapsed_s, now, holder,
                                             step_limit)
                if partial is not None:
                    return partial, rec
        if status is ReportStatus.FAILED:
            if not holder:
                return ReportResult(False, rec.state is ShardState.DONE, "stale",
                                    f"shard {shard_id} is {rec.state.value}, not held by worker {worker} attempt {attempt}"), rec
            with self._txn() as txn:
                rec.failures += 1
                self._requeue(txn, live, rec)
                if rec.failures >= self._cfg.warn_failures:
                    log.error("shard keeps failing; requeued, not dropped",
                              extra=kv(shard=shard_id, failures=rec.failures, worker=worker, error=error))
                    self._event(txn, f"dataset:{ds}", "shard_failing",
                                {"shard": shard_id, "failures": rec.failures, "worker": worker, "error": error},
                                "requeue")
            return ReportResult(True, False, "requeued", f"shard {shard_id} requeued (failure {rec.failures})"), rec
        if rec.state is ShardState.DONE:
            if rec.done_worker == worker and rec.done_attempt == attempt:
                return ReportResult(True, True, "retry", f"shard {shard_id} already recorded for this attempt"), rec
            with self._txn() as txn:
                self._stale(txn, shard_id, worker, attempt, entry, EntryKind.DUPLICATE)
            return ReportResult(False, True, "duplicate", f"shard {shard_id} was already done by worker {rec.done_worker}"), rec
        if not holder:
            with self._txn() as txn:
                self._stale(txn, shard_id, worker, attempt, entry)
            return ReportResult(False, False, "stale",
                                f"worker {worker} attempt {attempt} lost the lease on {shard_id} "
                                f"(now {rec.state.value}{' by worker %d' % rec.worker if rec.state is ShardState.DOING else ''})"), rec
        with self._txn() as txn:
            rec.state, rec.done_worker, rec.done_attempt = ShardState.DONE, worker, attempt
            live.doing.pop(rec.id, None)
            self._put(txn, rec)
            self.ledger.append(txn, kind=EntryKind.DONE, **entry)
            took = elapsed_s if elapsed_s > 0 else max(now - rec.leased_at, 0.0)
            self._note_speed(worker, rec.batches, took)
            per = took / max(rec.batches, 1)
            live.sec_per_batch = per if live.sec_per_batch == 0 else 0.8 * live.sec_per_batch + 0.2 * per
            if not live.todo and not live.doing and not live.closed:
                self._advance(txn, live)
        return ReportResult(True, False, "done"), rec

    def _partial_done(self, live: _Live, rec: _Shard, worker: int, attempt: int, stop_at: int, samples: int,
                      elapsed_s: float, now: float, holder: bool, step_limit: bool = False) -> ReportResult | None:
        """A lease stopped early at ``stop_at`` (tail split), in ONE transaction: the record
        [s, e) becomes SPLIT, its head [s, stop_at) DONE (one ledger ``done`` entry), its rest
        [stop_at, e) TODO at the head of the queue. None: not a partial done after all (the
        caller records the report as usual: ``stale`` or ``duplicate``)."""
        head_id = f"{rec.dataset}:{rec.epoch}:{rec.file}:{rec.start}-{stop_at}"
        if rec.state is ShardState.SPLIT:  # the same report again (its reply was lost)?
            head = live.records.get(head_id)
            if head is not None and head.state is ShardState.DONE and (head.done_worker, head.done_attempt) == (worker, attempt):
                return ReportResult(True, True, "retry", f"shard {rec.id} already recorded as done up to batch {stop_at}")
            return None
        if not holder:
            return None
        if rec.stop_at <= 0 and not step_limit:
            raise DdsError(f"worker {worker}: shard {rec.id} reported done up to batch {stop_at}, but it was never "
                           f"asked to stop early (report the whole shard)")
        with self._txn() as txn:
            head = _Shard(rec.dataset, rec.epoch, rec.file, rec.start, stop_at, state=ShardState.DONE,
                          order=rec.order, worker=worker, attempt=attempt, done_worker=worker, done_attempt=attempt)
            rest = _Shard(rec.dataset, rec.epoch, rec.file, stop_at, rec.stop, failures=rec.failures, not_for=worker)
            self._note_speed(worker, stop_at - rec.start, elapsed_s if elapsed_s > 0 else now - rec.leased_at)
            live.doing.pop(rec.id, None)
            rec.state, rec.stop_at = ShardState.SPLIT, 0
            self._put(txn, rec)
            self._put(txn, head)
            live.records[head.id] = head
            live.records[rest.id] = rest
            live.order_head -= 1
            rest.order = live.order_head
            live.todo.appendleft(rest.id)  # the tail goes next, to the worker that waits
            self._put(txn, rest)
            self._put_meta(txn, live)
            self.ledger.append(txn, kind=EntryKind.DONE, time=now, dataset=rec.dataset, epoch=rec.epoch, file=rec.file,
                               start=rec.start, stop=stop_at, worker=worker, attempt=attempt, samples=int(samples),
                               elapsed_s=float(elapsed_s))
            self._event(txn, f"worker:{worker}", "tail_split_done",
                        {"shard": rec.id, "done": head.id, "requeued": rest.id}, "requeue_tail")
        log.info("lease stopped early; its tail is next in TODO",
                 extra=kv(worker=worker, shard=rec.id, done=head.id, tail=rest.id))
        return ReportResult(True, False, "done", f"done up to batch {stop_at}; [{stop_at}, {rec.stop}) requeued")

    def _tail_reserved(self, live: _Live, worker: int, now: float, waiting_s: float = 5.0) -> bool:
        """The head of TODO is a tail split off ``worker``'s own lease and another worker waits for it."""
        head = live.records[live.todo[0]]
        return head.not_for == worker and any(w != worker and now - t <= waiting_s for w, t in live.waiting.items())

    def _note_speed(self, worker: int, batches: int, seconds: float) -> None:
        if batches > 0 and seconds > 0:
            per = seconds / batches
            old = self._spb.get(worker)
            self._spb[worker] = per if old is None else 0.5 * old + 0.5 * per

    def note_progress(self, worker: int, shard_id: str, next_batch: int) -> None:
        """The first batch of the lease ``shard_id`` that ``worker`` has not started (heartbeats; memory only)."""
        with self._lock:
            for live in self._live.values():
                rec = live.doing.get(shard_id)
                if rec is not None and rec.worker == worker and rec.start <= next_batch <= rec.stop:
                    rec.progress = next_batch

    def tail_split(self, waiting_s: float = 5.0) -> list[tuple[int, str, int]]:
        """The tail fix: ask lease holders to stop early so that waiting workers get the rest.

        For each dataset whose TODO is empty and where a worker was told WAIT within
        ``waiting_s`` and holds nothing: the lease (held by another worker, at least one batch
        trained, not asked already, its holder's pace in it 1.5x slower than the waiter's
        seconds per batch, if known) with the most batches left after ``progress`` (the first
        batch its holder has not started: it stops after the one in progress), if that is at
        least ``tail_split_min_batches``, is marked ``stop_at = progress``
        (durable, one transaction, event ``tail_split``). One lease per waiting worker per call.

        Args:
            waiting_s: a worker told WAIT longer ago than this no longer counts as waiting.

        Returns:
            (holder, shard id, stop batch) for each lease to stop: the controller sends the
            holder a ``truncate`` command. Leases asked before and still held are included
            again (idempotent; a restarted controller re-sends them).
        """
        if self._cfg.tail_split_min_batches <= 0:
            return []
        out: list[tuple[int, str, int]] = []
        with self._lock:
            now = self._clock()
            held = {rec.worker for live in self._live.values() for rec in live.doing.values()}
            for live in self._live.values():
                for rec in live.doing.values():
                    if rec.stop_at > 0:
                        out.append((rec.worker, rec.id, rec.stop_at))
                if live.finished or live.todo:
                    continue
                idle = [w for w, t in live.waiting.items() if now - t <= waiting_s and w not in held]
                for w in idle:
                    # only for a waiter faster than the holder's pace in this lease (or of unknown speed):
                    # a slow worker waiting must not take the tail back from a fast one
                    mine = self._spb.get(w)
                    cands = [r for r in live.doing.values() if r.stop_at <= 0 and r.progress > r.start
                             and r.stop - r.progress >= self._cfg.tail_split_min_batches
                             and (mine is None or 1.5 * mine < (now - r.leased_at) / (r.progress - r.start))]
                    if not cands:
                        break
                    rec = max(cands, key=lambda r: (r.stop - r.progress, r.id))
                    with self._txn() as txn:
                        rec.stop_at = rec.progress
                        self._put(txn, rec)
                        self._event(txn, f"worker:{rec.worker}", "tail_split",
                                    {"shard": rec.id, "progress": rec.progress, "stop_at": rec.stop_at,
                                     "waiting": sorted(idle)}, "truncate")
                    out.append((rec.worker, rec.id, rec.stop_at))
        return out

    def report_and_get(self, worker: int, dataset: str, shard_id: str, attempt: int,
                       status: ReportStatus | str = ReportStatus.DONE, samples: int = 0, elapsed_s: float = 0.0,
                       error: str = "", stop: int = 0, step_limit: bool = False) -> tuple[ReportResult, GetResult]:
        """Report a shard and lease the next one of ``dataset`` in ONE LMDB transaction.

        The same outcome as :meth:`report` followed by :meth:`get_shard` (same ledger,
        same records), at one commit instead of two. The report is committed before the
        lease is returned, so a controller killed after the commit and before its reply
        loses nothing; the worker's retried request then gets the report's ``retry`` and
        the SAME lease (its record carries the report as ``granted_with``), not a second
        one that nobody would train. A refused report (unknown shard, bad fields) leases
        nothing and changes nothing.

        Args:
            worker: the reporting worker (it also gets the lease).
            dataset: the dataset to lease from (may differ from the reported shard's).
            shard_id, attempt, status, samples, elapsed_s, error: as for :meth:`report`.

        Returns:
            ``(report result, lease result)``.
        """
        parsed = _check_report(worker, shard_id, attempt, status, samples, elapsed_s, stop)
        with self._lock:
            self._get_live(dataset)  # an unknown dataset refuses before the report is recorded
            with _Transition(self) as txn:
                self._batch = txn
                try:
                    rep, _ = self._report_locked(worker, shard_id, attempt, parsed, samples, elapsed_s, error, stop,
                                                 step_limit)
                    tag = f"{shard_id}#{attempt}" if rep.kind in ("done", "retry") else ""
                    got = self._regrant(worker, dataset, tag) if rep.kind == "retry" else None
                    if got is None:
                        got = self._get_locked(worker, dataset, tag)
                finally:
                    self._batch = None
            return rep, got

    def _regrant(self, worker: int, dataset: str, tag: str) -> GetResult | None:
        """The lease granted with report ``tag`` (a reply that was lost), if ``worker`` still holds it."""
        live = self._live.get(dataset)
        rec = next((r for r in live.doing.values() if r.worker == worker and r.granted_with == tag), None) \
            if live is not None else None
        if rec is None:
            return None
        rec.deadline = max(rec.deadline, self._clock() + self._cfg.lease_s)
        return GetResult(GetStatus.SHARD, ShardLease(rec.id, dataset, rec.epoch, rec.file, rec.start, rec.stop,
                                                      rec.attempt, self._cfg.lease_s))

    def _read_shard(self, ds: str, epoch: int, f: int, start: int, stop: int) -> dict[str, Any] | None:
        with self._store.begin() as txn:
            raw = txn.get(shard_key(ds, epoch, f, start, stop), db=self._store.db("shards"))
        return None if raw is None else loads(raw)

    def _advance(self, txn: lmdb.Transaction, live: _Live) -> None:
        done_epoch = live.epoch
        if live.epoch + 1 < live.spec.epochs:
            self._create_epoch(txn, live, live.epoch + 1)
        else:
            live.finished = True
        self._put_meta(txn, live)
        self._event(txn, f"dataset:{live.spec.name}", "epoch_done",
                    {"epoch": done_epoch, "finished": live.finished})

    def _stale(self, txn: lmdb.Transaction, shard_id: str, worker: int, attempt: int, entry: dict[str, Any],
               kind: EntryKind = EntryKind.STALE) -> None:
        """Ledger a report by a worker that lost the lease: it replaces the ``abandoned`` entry
        its lease left (same worker and attempt) by ``kind``, else appends a ``kind`` entry."""
        key = _abandoned_key(shard_id, worker, attempt)
        meta = self._store.db("meta")
        raw = txn.get(key, db=meta)
        if raw is not None and self.ledger.supersede(txn, int(loads(raw)), kind, **entry) is not None:
            txn.delete(key, db=meta)
            return
        self.ledger.append(txn, kind=kind, **entry)

    def _abandon(self, txn: lmdb.Transaction, spec: DatasetSpec, rec: _Shard, worker: int, attempt: int) -> None:
        """Ledger a train lease taken from ``worker`` mid-way (``abandoned``: its pushes may be in
        the model) and remember the entry (meta ``abandoned/<shard>#<worker>#<attempt>``) for the
        holder's late report."""
        if spec.kind != DatasetKind.TRAIN or worker < 0:
            return  # an eval lease updates nothing
        got = self.ledger.append(txn, kind=EntryKind.ABANDONED, time=self._clock(), dataset=rec.dataset,
                                 epoch=rec.epoch, file=rec.file, start=rec.start, stop=rec.stop, worker=worker,
                                 attempt=attempt, samples=0, elapsed_s=0.0)
        txn.put(_abandoned_key(rec.id, worker, attempt), dumps(got.seq), db=self._store.db("meta"))

    def _requeue(self, txn: lmdb.Transaction, live: _Live, rec: _Shard) -> None:
        """A DOING lease back to the head of TODO; its holder may have pushed some of it (``abandoned``)."""
        self._abandon(txn, live.spec, rec, rec.worker, rec.attempt)
        live.doing.pop(rec.id, None)
        live.order_head -= 1
        rec.state, rec.worker, rec.order = ShardState.TODO, -1, live.order_head
        rec.stop_at, rec.progress = 0, -1
        live.todo.appendleft(rec.id)
        self._put(txn, rec)
        self._put_meta(txn, live)

    def renew(self, worker: int) -> int:
        """Extend the leases of every shard ``worker`` holds (called on its heartbeat)."""
        with self._lock:
            deadline = self._clock() + self._cfg.lease_s
            n = 0
            for live in self._live.values():
                for rec in live.doing.values():
                    if rec.worker == worker:
                        rec.deadline = max(rec.deadline, deadline)
                        n += 1
            return n

    def requeue_worker(self, worker: int, reason: str) -> list[str]:
        """Return every shard ``worker`` holds, in EVERY dataset, to the head of TODO."""
        with self._lock:
            victims = [(live, rec) for live in self._live.values()
                       for rec in list(live.doing.values()) if rec.worker == worker]
            if not victims:
                return []
            with self._txn() as txn:
                for live, rec in victims:
                    self._requeue(txn, live, rec)
                ids = [rec.id for _, rec in victims]
                self._event(txn, f"worker:{worker}", "shards_requeued", {"shards": ids, "reason": reason}, "requeue")
            return ids

    def hang_limit_s(self, dataset: str, batches: int) -> float:
        """Longest a shard may stay DOING even with heartbeats (hung-worker guard)."""
        live = self._get_live(dataset)
        if live.sec_per_batch <= 0:
            return float("inf")
        return max(self._cfg.hang_min_s, self._cfg.hang_factor * live.sec_per_batch * batches)

    def expire(self) -> list[str]:
        """Requeue shards whose lease ran out (no heartbeat) or that look hung."""
        with self._lock:
            now = self._clock()
            victims = []
            for live in self._live.values():
                for rec in list(live.doing.values()):
                    hung = now - rec.leased_at > self.hang_limit_s(live.spec.name, rec.batches)
                    if now > rec.deadline or hung:
                        victims.append((live, rec, "hang" if hung and now <= rec.deadline else "lease_expired"))
            if not victims:
                return []
            with self._txn() as txn:
                for live, rec, why in victims:
                    worker = rec.worker
                    self._requeue(txn, live, rec)
                    self._event(txn, f"worker:{worker}", why, {"shard": rec.id, "attempt": rec.attempt}, "requeue")
            return [rec.id for _, rec, _ in victims]

    def set_slow(self, worker: int, slow: bool) -> None:
        """Mark a worker slow (its next shards are ``slow_shrink`` times smaller) or not."""
        with self._lock:
            if (worker in self._slow) == slow:
                return
            (self._slow.add if slow else self._slow.discard)(worker)
            self._store.put_json("meta", "slow_workers", sorted(self._slow))

    def set_shard_size(self, worker: int, batches: int | None) -> None:
        """Override one worker's base shard size (``None`` restores the config)."""
        with self._lock:
            if batches is None:
                self._sizes.pop(worker, None)
            else:
                if batches < 1:
                    raise DdsError(f"worker {worker}: shard size must be >= 1, got {batches}")
                self._sizes[worker] = batches
            self._store.put_json("meta", "worker_sizes", {str(k): v for k, v in self._sizes.items()})

    @property
    def slow_workers(self) -> set[int]:
        return set(self._slow)

    # ---------------------------------------------------------------- checkpoint cuts

    def snapshot(self) -> DdsCut:
        """The DDS position now: ledger head + each dataset's epoch."""
        with self._lock:
            return DdsCut(self.ledger.last_seq(), {n: l.epoch for n, l in self._live.items()}, self._clock())

    def rollback_to(self, cut: DdsCut,
                    also: Callable[[lmdb.Transaction, list[str]], None] | None = None) -> list[str]:
        """Roll back to ``cut``: shards done after it (and all DOING) return to TODO.

        Ledger entries after the cut are marked ``replayed``; epochs started after
        the cut are discarded, and a later report of a lease from one of them (a worker
        that held it across the recovery) is ``stale`` (ledger ``stale``: its samples are
        replays), not an unknown shard. Returns the ids of the shards returned to TODO.

        Args:
            also: called inside the rollback's transaction with the shards returned, so a
                caller's record of the rollback commits with it (a PS recovery's, exactly once).
        """
        with self._lock:
            returned: list[str] = []
            try:
                with self._store.begin(write=True) as txn:
                    replayed = self.ledger.mark_replayed_after(txn, cut.ledger_seq)
                    shards_db = self._store.db("shards")
                    for name, live in self._live.items():
                        cut_epoch = cut.epochs.get(name, 0)
                        # drop epochs begun after the cut
                        for e in range(cut_epoch + 1, live.epoch + 1):
                            prefix = f"{name}\x00{e:08d}\x00".encode()
                            cur = txn.cursor(shards_db)
                            keys = []
                            if cur.set_range(prefix):
                                for k, v in cur:
                                    if not bytes(k).startswith(prefix):
                                        break
                                    keys.append(bytes(k))
                                    dropped = _Shard.from_json(loads(v))
                                    if dropped.state is ShardState.DOING:  # its holder trains on
                                        self._abandon(txn, live.spec, dropped, dropped.worker, dropped.attempt)
                            for k in keys:
                                txn.delete(k, db=shards_db)
                        head = live.order_head if cut_epoch == live.epoch else self._min_order(txn, name, cut_epoch)
                        back = []
                        for ent in replayed:
                            if ent.dataset == name and ent.epoch == cut_epoch:
                                back.append(shard_key(name, cut_epoch, ent.file, ent.start, ent.stop))
                        prefix = f"{name}\x00{cut_epoch:08d}\x00".encode()
                        cur = txn.cursor(shards_db)
                        if cur.set_range(prefix):
                            for k, v in cur:
                                if not bytes(k).startswith(prefix):
                                    break
                                if loads(v)["state"] == ShardState.DOING.value:
                                    back.append(bytes(k))
                        for k in back:
                            raw = txn.get(k, db=shards_db)
                            if raw is None:
                                raise DdsError(f"rollback of dataset {name!r}: shard {k!r} of epoch {cut_epoch} "
                                               f"is not in the shard table")
                            body = loads(raw)
                            if body["state"] == ShardState.DOING.value:  # its holder trains on: abandoned
                                held = _Shard.from_json(body)
                                self._abandon(txn, live.spec, held, held.worker, held.attempt)
                            head -= 1
                            body.update(state=ShardState.TODO.value, worker=-1, order=head,
                                        done_worker=-1, done_attempt=0, granted_with="")
                            txn.put(k, dumps(body), db=shards_db)
                            returned.append(_Shard.from_json(body).id)
                        meta = {"spec": live.spec.to_json(), "epoch": cut_epoch, "order_head": head,
                                "finished": live.finished and not back and cut_epoch == live.epoch,
                                "rolled_back_from": max(live.rolled_back_from,
                                                        live.epoch if live.epoch > cut_epoch else -1)}
                        txn.put(f"ds/{name}".encode(), dumps(meta), db=self._store.db("meta"))
                    self._event(txn, "controller", "rollback",
                                {"cut_ledger_seq": cut.ledger_seq, "epochs": cut.epochs,
                                 "replayed_entries": len(replayed), "shards_returned": len(returned)},
                                "rollback")
                    if also is not None:
                        also(txn, returned)
            finally:
                self._load_all()
            return returned

    def _min_order(self, txn: lmdb.Transaction, name: str, epoch: int) -> int:
        prefix = f"{name}\x00{epoch:08d}\x00".encode()
        cur = txn.cursor(self._store.db("shards"))
        low = 0
        if cur.set_range(prefix):
            for k, v in cur:
                if not bytes(k).startswith(prefix):
                    break
                low = min(low, int(loads(v)["order"]))
        return low

    def _event(self, txn: lmdb.Transaction, node: str, kind: str, evidence: dict[str, Any], action: str = "") -> None:
        if self._events is not None:
            self._events.record(Event(self._clock(), node, kind, evidence, action), txn)


class _Joined:
    """A transition run inside :meth:`DynamicDataSharding.report_and_get`: it joins that
    one transaction (commit, abort and the memory rebuild on error are the outer one's)."""

    def __init__(self, txn: lmdb.Transaction) -> None:
        self._txn = txn

    def __enter__(self) -> lmdb.Transaction:
        return self._txn

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        return None


class _Transition:
    """One LMDB write txn per transition; on any error memory is rebuilt from LMDB."""

    def __init__(self, dds: DynamicDataSharding) -> None:
        self._dds = dds
        self._txn: lmdb.Transaction | None = None

    def __enter__(self) -> lmdb.Transaction:
        self._txn = self._dds._store.begin(write=True)
        return self._txn

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        assert self._txn is not None
        if exc_type is None:
            try:
                self._txn.commit()
                return
            except BaseException:
                self._dds._load_all()
                raise
        self._txn.abort()
        self._dds._load_all()


def _check_report(worker: int, shard_id: str, attempt: int, status: ReportStatus | str, samples: int,
                  elapsed_s: float, stop: int = 0) -> ReportStatus:
    """Validate a report's fields (before any lock or transaction); returns the parsed status."""
    if not isinstance(stop, int) or stop < 0:
        raise DdsError(f"shard {shard_id}: stop must be a batch index >= 0 (0 = the whole shard), got {stop!r}")
    _check_worker(worker)
    try:
        parsed = ReportStatus(status)
    except ValueError:
        raise DdsError(f"shard {shard_id}: status must be 'done' or 'failed', got {status!r}") from None
    if attempt < 1:
        raise DdsError(f"shard {shard_id}: attempt must be >= 1 (from the lease), got {attempt}")
    if samples < 0 or elapsed_s < 0:
        raise DdsError(f"shard {shard_id}: samples and elapsed_s must be >= 0, got {samples}, {elapsed_s}")
    return parsed


def _check_worker(worker: int) -> None:
    if not isinstance(worker, int) or worker < 0:
        raise DdsError(f"worker index must be an int >= 0, got {worker!r}")


__all__: list[str] = [
    "DatasetKind", "DatasetSpec", "DdsCut", "DdsError", "DynamicDataSharding", "GetResult", "GetStatus",
    "ReportResult", "ReportStatus", "ShardLease", "ShardState", "StateMismatch", "UnknownDataset",
    "UnknownShard", "parse_shard_id",
]
