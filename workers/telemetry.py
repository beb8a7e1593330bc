"""Live telemetry of a worker process: Prometheus metrics, TensorBoard scalars, incarnation reports.

Everything here is written *while* the worker trains, so a run can be watched
live and a worker that is killed or restarted leaves its history behind.

Prometheus (served by ``metaps worker --metrics-port``, :func:`common.metrics.serve_metrics`;
every series is labelled ``rank``)::

    metaps_worker_steps_total                 counter   training steps done by this process
    metaps_worker_samples_total               counter   samples trained (rate() = samples/s)
    metaps_worker_step                        gauge     the current step number (resumes after a restart)
    metaps_worker_loss{head,kind}             gauge     last step's loss; head = each head (click, conversion,
                                                        ...) and "all" (their sum), kind total / query /
                                                        support_before / support_after (meta mode)
    metaps_worker_step_seconds{phase}         histogram data_wait, pull, compute, push, dense_sync, total
                                                        (with one message per shard per step the dense
                                                        exchange travels with the push: counted in push,
                                                        dense_sync stays 0)
    metaps_worker_row_staleness_steps         gauge     steps between the rows a step used and the step
                                                        (1 with [train] overlap, else 0); the fleet
                                                        clock lag is max(metaps_worker_step) - metaps_worker_step
    metaps_worker_rows_pulled_total           counter   embedding rows pulled (unique ids, all tables)
    metaps_worker_rows_pushed_total           counter   embedding row gradients pushed
    metaps_worker_leases_held                 gauge     train shard leases this worker holds now
    metaps_worker_incarnation                 gauge     1 for the first start, 2 after one restart, ...
    metaps_worker_eval_auc{kind,head}         gauge     last periodic evaluation's AUC
    metaps_worker_stale_waits_total{kind}     counter   calls held back by the staleness bound or a barrier
                                                        (kind pull / push / barrier / <RPC>), read from the
                                                        PS client (:class:`ps.client.StaleWaits`) at scrape
    metaps_worker_stale_wait_seconds_total{kind} counter seconds those calls waited for slower workers
                                                        (a wait in progress counts as it goes)

TensorBoard: ``<run>/tb/worker-R.inc-N/`` (one TensorBoard run per worker
incarnation), ``train/*`` scalars (``train/loss`` and ``train/loss/<head>``, ...) every ``[train] tb_every_steps`` steps and
``eval/<kind>/<head>/auc`` at every periodic evaluation, flushed at once.

Incarnation reports: ``<run>/workers/worker-R.inc-N.json`` is claimed (created
exclusively) when the process starts and rewritten every ``tb_every_steps``
steps (``"state": "running"``, ``"last"``: the newest step's figures) and at the
end (``"finished"``): an incarnation
that is killed keeps its last snapshot, and :func:`metaps.run_report.read_worker_reports`
sums every incarnation of a rank.

Example::

    tel = Telemetry(run_dir, rank=0, every=10, overlap=True)
    rows = CountingRowSource(rows, tel)
    tel.on_step(stats, data_wait_s=0.01)
    tel.close()
"""

from __future__ import annotations

import json
import logging
import math
import os
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import Future
from pathlib import Path
from typing import Any

import numpy as np
from prometheus_client import REGISTRY, Counter, Gauge, Histogram
from prometheus_client.core import CounterMetricFamily

from common.atomic_write import json_default, write_text_atomic
from common.log import kv
from workers.row_source import GroupedIds

log = logging.getLogger(__name__)

_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0)
PHASES = ("data_wait", "pull", "compute", "push", "dense_sync", "total")

STEPS = Counter("metaps_worker_steps", "Training steps done by this worker process", ["rank"])
SAMPLES = Counter("metaps_worker_samples", "Samples trained by this worker process", ["rank"])
STEP = Gauge("metaps_worker_step", "Current step number of this worker", ["rank"])
LOSS = Gauge("metaps_worker_loss", "Last training loss (head: each head, and all = their sum; kind: total, "
             "query, support_before, support_after)", ["rank", "head", "kind"])
STEP_SECONDS = Histogram("metaps_worker_step_seconds", "Step time by phase", ["rank", "phase"], buckets=_BUCKETS)
STALENESS = Gauge("metaps_worker_row_staleness_steps", "Steps between the rows a step used and the step",
                  ["rank"])
ROWS_PULLED = Counter("metaps_worker_rows_pulled", "Embedding rows pulled (unique ids over all tables)", ["rank"])
ROWS_PUSHED = Counter("metaps_worker_rows_pushed", "Embedding row gradients pushed", ["rank"])
LEASES = Gauge("metaps_worker_leases_held", "Train shard leases held by this worker now", ["rank"])
INCARNATION = Gauge("metaps_worker_incarnation", "Incarnation of this worker (1 = first start)", ["rank"])
EVAL_AUC = Gauge("metaps_worker_eval_auc", "AUC of the last periodic evaluation", ["rank", "kind", "head"])

class _WaitCollector:
    """``metaps_worker_stale_waits_total`` / ``..._stale_wait_seconds_total`` read from each rank's
    PS client at scrape time (a worker held back for long shows its wait while it lasts)."""

    def __init__(self) -> None:
        self.sources: dict[str, Callable[[], Mapping[str, tuple[int, float]]]] = {}

    def collect(self) -> Iterator[CounterMetricFamily]:
        waits = CounterMetricFamily("metaps_worker_stale_waits", "Calls that waited for slower workers "
                                    "(staleness bound, barriers)", labels=["rank", "kind"])
        secs = CounterMetricFamily("metaps_worker_stale_wait_seconds", "Seconds spent waiting for slower workers",
                                   labels=["rank", "kind"])
        for rank, totals in list(self.sources.items()):
            for kind, (n, s) in sorted(totals().items()):
                waits.add_metric([rank, kind], float(n))
                secs.add_metric([rank, kind], float(s))
        yield waits
        yield secs


WAITS = _WaitCollector()
REGISTRY.register(WAITS)

METRIC_NAMES = (
    "metaps_worker_steps_total", "metaps_worker_samples_total", "metaps_worker_step", "metaps_worker_loss",
    "metaps_worker_step_seconds_bucket", "metaps_worker_step_seconds_sum", "metaps_worker_step_seconds_count",
    "metaps_worker_row_staleness_steps", "metaps_worker_rows_pulled_total", "metaps_worker_rows_pushed_total",
    "metaps_worker_leases_held", "metaps_worker_incarnation", "metaps_worker_eval_auc",
    "metaps_worker_stale_waits_total", "metaps_worker_stale_wait_seconds_total",
)
"""Every series name this module exports (the Grafana dashboard test checks its queries against it)."""

_REPORT_NAME = "worker-{rank}.inc-{inc}.json"


def claim_incarnation(workers_dir: Path, rank: int, limit: int = 10_000) -> int:
    """Claim the next free incarnation number of ``rank``: creates ``worker-R.inc-N.json`` exclusively.

    Works whoever restarts the process (agent, launcher, Kubernetes): the files in the
    run directory are the only shared state.

    Args:
        workers_dir: ``<run>/workers`` (created).
        rank: the worker's rank.
        limit: give up after this many incarnations.

    Returns:
        N >= 1, the incarnation of this process.
    """
    from common.errors import MetapsError

    workers_dir.mkdir(parents=True, exist_ok=True)
    for inc in range(1, limit + 1):
        path = workers_dir / _REPORT_NAME.format(rank=rank, inc=inc)
        try:
            fd = os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o640)  # a run file: the group reads it
        except FileExistsError:
            continue
        with os.fdopen(fd, "w") as fh:
            json.dump({"rank": rank, "incarnation": inc, "state": "starting", "time": time.time()}, fh)
        return inc
    raise MetapsError(f"{workers_dir}: worker {rank} has {limit} incarnation reports already; "
                      f"expected a fresh run directory")


def loss_labels(name: str) -> tuple[str, str] | None:
    """``(head, kind)`` of a step metric that is a loss, None for other metrics.

    ``loss/click`` -> (click, total); ``query_loss`` -> (all, query);
    ``query_loss/click`` -> (click, query); ``support_loss_before`` -> (all, support_before).

    Args:
        name: a key of :attr:`workers.trainer.StepStats.metrics`.
    """
    base, _, head = name.partition("/")
    if base == "loss":
        return (head, "total") if head else None
    if not (base.endswith("_loss") or "_loss_" in base):
        return None
    return head or "all", base.replace("_loss", "")


def _finite(v: Any) -> bool:
    return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)


class Telemetry:
    """One worker incarnation's live metrics, TensorBoard scalars and report snapshots.

    Args:
        run_dir: the run directory (``tb/`` and ``workers/`` go under it).
        rank: the worker's rank.
        every: write TensorBoard scalars and the report snapshot every this many steps (0: never live).
        overlap: ``[train] overlap`` (rows are one step stale).
        incarnation: None claims the next free one (:func:`claim_incarnation`).
    """

    def __init__(self, run_dir: Path, rank: int, every: int, overlap: bool = False,
                 incarnation: int | None = None) -> None:
        self.run_dir, self.rank, self.every = Path(run_dir), rank, every
        self.incarnation = incarnation or claim_incarnation(self.run_dir / "workers", rank)
        self.tb_dir = self.run_dir / "tb" / f"worker-{rank}.inc-{self.incarnation}"
        self.report_path = self.run_dir / "workers" / _REPORT_NAME.format(rank=rank, inc=self.incarnation)
        self._history_json: list[str] = []  # each history record's JSON text, encoded once (snapshot)
        r = str(rank)
        self._steps, self._samples, self._step = STEPS.labels(r), SAMPLES.labels(r), STEP.labels(r)
        self._phase = {p: STEP_SECONDS.labels(r, p) for p in PHASES}
        self._pulled, self._pushed = ROWS_PULLED.labels(r), ROWS_PUSHED.labels(r)
        self._leases = LEASES.labels(r)
        self._staleness = STALENESS.labels(r)
        self._staleness.set(1 if overlap else 0)
        INCARNATION.labels(r).set(self.incarnation)
        self._writer: Any = None
        self._pending: list[dict[str, Any]] = []
        self.dense_sync_s = 0.0
        self.last_tb_step: int | None = None
        self.eval_points: list[dict[str, Any]] = []
        self.last: dict[str, Any] = {}
        """The last step's figures (step, time, loss, samples_per_s, loss/<head>, ...): the snapshot's ``last``."""
        log.info("telemetry ready", extra=kv(rank=rank, incarnation=self.incarnation, tb=str(self.tb_dir)))

    # -- counters fed by the row source and the loop --------------------------------------
    def rows(self, pulled: int = 0, pushed: int = 0) -> None:
        if pulled:
            self._pulled.inc(pulled)
        if pushed:
            self._pushed.inc(pushed)

    def watch_waits(self, totals: Callable[[], Mapping[str, tuple[int, float]]]) -> None:
        """Export this rank's waits for slower workers from ``totals`` (``PsClient.waits.totals``)."""
        WAITS.sources[str(self.rank)] = totals

    def leases(self, held: int) -> None:
        self._leases.set(held)

    def staleness(self, steps: int) -> None:
        """The rows of the latest step were ``steps`` steps old (1 overlapped, 0 serial: ``overlap = "auto"``
        may switch)."""
        self._staleness.set(steps)

    def on_step(self, step: int, samples: int, loss: float, phases: Mapping[str, float],
                parts: Mapping[str, float] | None = None) -> None:
        """Account one step.

        Args:
            step: the step number just finished.
            samples: samples of the step.
            loss: the step's loss.
            phases: seconds per phase (keys of :data:`PHASES`; missing ones are not observed).
            parts: the step's metrics; its losses (``loss/<head>``, ``query_loss``, ``query_loss/<head>``,
                ``support_loss_before``, ...; :func:`loss_labels`) set the loss gauge.
        """
        self._steps.inc()
        self._samples.inc(samples)
        self._step.set(step)
        if _finite(loss):
            LOSS.labels(str(self.rank), "all", "total").set(loss)
        for name, v in (parts or {}).items():
            labels = loss_labels(name)
            if labels is not None and _finite(v):
                LOSS.labels(str(self.rank), *labels).set(v)
        for p, v in phases.items():
            if p in self._phase and _finite(v):
                self._phase[p].observe(max(float(v), 0.0))
        total = phases.get("total")
        self.last = {"step": step, "time": time.time(), "loss": loss, "samples": samples,
                     # a step too short to time (total 0) has no rate, not samples / 1e-9
                     **({"samples_per_s": samples / total} if total is not None and _finite(total) and total > 0
                        else {}),
                     **{k: v for k, v in (parts or {}).items() if loss_labels(k) is not None and _finite(v)}}

    def due(self, step: int) -> bool:
        """Whether ``step`` is one where scalars and the snapshot are written."""
        return self.every > 0 and step % self.every == 0

    # -- TensorBoard --------------------------------------------------------------------
    def _tb(self) -> Any:
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter

            self._writer = SummaryWriter(log_dir=str(self.tb_dir), flush_secs=5)
        return self._writer

    def scalars(self, step: int, values: Mapping[str, Any], prefix: str = "train", walltime: float | None = None) -> None:
        """Write the finite numeric ``values`` as ``prefix/<key>`` at ``step`` and flush."""
        w = self._tb()
        for k, v in values.items():
            if k in ("step", "time") or not _finite(v):
                continue
            w.add_scalar(f"{prefix}/{k}", float(v), global_step=step, walltime=walltime)
        w.flush()
        if prefix == "train":
            self.last_tb_step = step

    def on_eval(self, step: int, metrics: Mapping[str, Any]) -> dict[str, float]:
        """A periodic evaluation's result: gauges, TensorBoard ``eval/<kind>/<head>/auc``; returns the flat AUCs."""
        flat: dict[str, float] = {}
        for kind, heads in metrics.items():
            if not isinstance(heads, Mapping):
                continue
            for head, m in heads.items():
                if not isinstance(m, Mapping):
                    continue
                for key in ("auc", "oracle_auc"):
                    if _finite(m.get(key)):
                        flat[f"{kind}/{head}/{key}"] = float(m[key])
                if _finite(m.get("auc")):
                    EVAL_AUC.labels(str(self.rank), kind, head).set(float(m["auc"]))
        self.scalars(step, flat, prefix="eval")
        self.eval_points.append({"step": step, "time": time.time(), **flat})
        return flat

    # -- report snapshots ------------------------------------------------------------------
    def snapshot(self, report: Mapping[str, Any]) -> None:
        """Rewrite this incarnation's report file (atomic); ``last`` is the newest step's figures
        (what the launcher's live view shows, :class:`metaps.progress.LiveWorkers`).

        The report's ``history`` only grows (records are never changed once in it), so each
        record is encoded once and kept: a snapshot joins the cached texts instead of encoding
        the whole history again (which made every snapshot cost O(steps) of JSON encoding).
        """
        # the pid tells a reader whether a ``running`` snapshot's process is still there
        body = {**report, "incarnation": self.incarnation, "pid": os.getpid(), "eval_history": list(self.eval_points),
                "last": dict(self.last)}
        hist = body.pop("history", None) or []
        cache = self._history_json
        if len(cache) > len(hist):  # a new history list (another report): encode afresh
            cache.clear()
        cache.extend(json.dumps(rec, default=json_default) for rec in hist[len(cache):])
        head = json.dumps(body, indent=1, default=json_default)  # "{ ... \n}"
        text = head[:-1].rstrip() + (",\n" if body else "") + ' "history": [' + ",\n  ".join(cache) + "]\n}\n"
        write_text_atomic(self.report_path, text)

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()
            self._writer = None


class CountingRowSource:
    """A RowSource that counts rows pulled/pushed and times dense syncs into a :class:`Telemetry`.

    Counting is one ``len`` per table per call (no per-row work).

    Args:
        inner: the real row source.
        tel: where counts go.
    """

    def __init__(self, inner: Any, tel: Telemetry) -> None:
        self.inner, self.tel = inner, tel
        waits = getattr(getattr(inner, "client", None), "waits", None)  # a RemoteRowSource's PsClient
        if waits is not None:
            tel.watch_waits(waits.totals)

    def __getattr__(self, name: str) -> Any:  # clocks, checkpoints, close, ... pass through
        return getattr(self.inner, name)

    @staticmethod
    def _n(by_table: Mapping[str, Any]) -> int:
        return int(sum(len(np.asarray(v)) for v in by_table.values()))

    def pull(self, ids: Any, step: int | None = None) -> Any:
        self.tel.rows(pulled=self._n(ids))
        return self.inner.pull(ids, step)

    def pull_async(self, ids: Any, step: int | None = None) -> "Future[Any]":
        self.tel.rows(pulled=self._n(ids))
        return self.inner.pull_async(ids, step)

    def push(self, grads: Any, step: int) -> None:
        self.tel.rows(pushed=self._grad_rows(grads))
        self.inner.push(grads, step)

    def _count_exchange(self, push: Any, pull: Any) -> None:
        self.tel.rows(pulled=self._group_rows(pull) if pull is not None else 0,
                      pushed=self._group_rows(push[0]) if push is not None else 0)

    def exchange(self, push: Any, dense: Any, pull: Any, step: int | None) -> Any:
        self._count_exchange(push, pull)
        return self.inner.exchange(push, dense, pull, step)

    def exchange_async(self, push: Any, dense: Any, pull: Any, step: int | None) -> "Future[Any]":
        self._count_exchange(push, pull)
        return self.inner.exchange_async(push, dense, pull, step)

    def pull_groups(self, index: GroupedIds, step: int | None = None) -> Any:
        self.tel.rows(pulled=self._group_rows(index))
        return self.inner.pull_groups(index, step)

    def pull_groups_async(self, index: GroupedIds, step: int | None = None) -> "Future[Any]":
        self.tel.rows(pulled=self._group_rows(index))
        return self.inner.pull_groups_async(index, step)

    def push_groups(self, index: GroupedIds, grads: Any, step: int) -> None:
        self.tel.rows(pushed=self._group_rows(index))
        self.inner.push_groups(index, grads, step)

    def push_groups_async(self, index: GroupedIds, grads: Any, step: int) -> "Future[None]":
        self.tel.rows(pushed=self._group_rows(index))
        return self.inner.push_groups_async(index, grads, step)

    def push_async(self, grads: Any, step: int) -> "Future[None]":
        self.tel.rows(pushed=self._grad_rows(grads))
        return self.inner.push_async(grads, step)

    @staticmethod
    def _group_rows(index: GroupedIds) -> int:
        """Rows of a step's grouped ids (per group one id tensor)."""
        return sum(int(i.numel()) for i in index.ids)

    @staticmethod
    def _grad_rows(grads: Mapping[str, Any]) -> int:
        n = 0
        for v in grads.values():
            ids = v[0] if isinstance(v, tuple) else v
            n += len(ids)
        return n

    def _timed(self, fn: Any, *args: Any) -> Any:
        t0 = time.perf_counter()
        try:
            return fn(*args)
        finally:
            self.tel.dense_sync_s += time.perf_counter() - t0

    def pull_dense(self, names: list[str]) -> Any:
        return self._timed(self.inner.pull_dense, names)

    def push_dense(self, grads: Any, step: int) -> None:
        self._timed(self.inner.push_dense, grads, step)

    def push_pull_dense(self, grads: Any, step: int) -> Any:
        return self._timed(self.inner.push_pull_dense, grads, step)
