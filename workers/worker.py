"""``metaps worker``: one trainer process of a fleet.

Life of a worker::

    register with the controller ---- heartbeat thread (leases, commands)
    for each train shard leased by the DDS (without a controller: one worker reads the shards
    a one-worker fleet would be leased, common.shard_order; rank r of w > 1 a static slice):
        read batches (prefetch) -> pull rows -> step -> push grads -> report metrics
        report the shard done
    pull final dense params; score the eval shards it is leased -> run/eval/*.npz
    the checkpoint leader (the controller's choice: the live worker with the lowest index;
    rank 0 without a controller), once every dataset is done: merge eval scores, final
    checkpoint; the others wait for that (and take over if the leader leaves); report

With ``dense_sync = "allreduce"`` every step is a collective, so a worker with no
batch at hand still joins it with zero gradients (and the step's sample count
weights the average); the loop ends when no worker has data left.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, Literal, overload

import torch

from meta_io.prefetch import prefetch
from meta_io.reader import MetaIODataset
from common.atomic_write import write_json_atomic
from common import exit_codes
from common.config import to_dict
from common.errors import MetapsError
from common.eta import JobEta
from common.log import kv
from common.shard_order import shard_order
from workers.callbacks import NO_CALLBACKS, CheckpointEvent, EvalEvent, StepEvent, TrainingCallbacks
from workers.config import DenseSync, TrainMode
from workers.data_feed import BatchRange, static_ranges
from workers.evaluation import merge_eval_files, score_batches, write_eval_file
from workers.row_source import RemoteRowSource, RowSource
from workers.telemetry import CountingRowSource, Telemetry
from workers.trainer import StepStats, Trainer

if TYPE_CHECKING:
    from models.base import CtrModel

log = logging.getLogger(__name__)

_WAIT_POLL_S = 0.2
"""How often an all-reduce worker told to WAIT asks the DDS again (it joins every step meanwhile)."""


class FinalCheckpointFailed(MetapsError):
    """Training finished but the run's final checkpoint could not be written (a full disk, an
    I/O error, no permission: ``ps.coordinator.CheckpointWriteFailed``); its partial files were
    removed. Deterministic, so the worker tells the controller (which fails the run once) and
    exits with :data:`~common.exit_codes.RUN_FAILED`, which its agent does not restart.

    Args:
        message: one line naming the checkpoint path and the OS error.
        path: the checkpoint directory that was not written.
    """

    exit_code = exit_codes.RUN_FAILED

    def __init__(self, message: str, path: Path) -> None:
        super().__init__(message)
        self.path = path


def checkpoint_info(job: Any, step: int, metrics: dict[str, Any] | None = None) -> dict[str, Any]:
    """What a checkpoint manifest carries so delivery can rebuild the model."""
    return {
        "schema": job.schema().to_dict(),
        "model": to_dict(job.model),
        "step": step,
        "data_range": {"train": job.data.train, "eval": job.data.eval},
        "metrics": metrics or {},
        "job": job.to_dict(),
    }


def build_model(job: Any) -> CtrModel:
    from models.factory import build_model as _build

    torch.manual_seed(job.train.seed)
    return _build(job.schema(), job.model)


class _Heartbeat(threading.Thread):
    """Renews leases and collects controller commands in the background."""

    def __init__(self, ctl: Any, period_s: float, worker: "Worker") -> None:
        super().__init__(name="heartbeat", daemon=True)
        self.ctl, self.period_s, self.worker = ctl, period_s, worker
        self.stop_event = threading.Event()
        self.commands: list[Any] = []
        self.lock = threading.Lock()
        self.leader = False  # the controller's last word: this worker is the checkpoint leader

    def run(self) -> None:
        while not self.stop_event.wait(self.period_s):
            try:
                shard_id, next_batch = self.worker.lease_progress
                reply = self.ctl.heartbeat(step=self.worker.trainer.step_no, rss_bytes=_rss_bytes(),
                                           shard_id=shard_id, next_batch=next_batch,
                                           stopped=self.worker.stopped_reason)
            except Exception as exc:  # the controller may restart; keep training
                log.warning("heartbeat failed", extra=kv(error=str(exc)[:200]))
                continue
            self.leader = reply.leader
            for cmd in reply.commands:
                if cmd.kind == "stop" and exit_codes.for_stop(cmd.reason) != exit_codes.OK:
                    _exit_now(cmd.reason)
            if reply.commands:
                with self.lock:
                    self.commands.extend(reply.commands)

    def take(self) -> list[Any]:
        with self.lock:
            cmds, self.commands = self.commands, []
        return cmds


def _exit_now(reason: str) -> None:
    """The controller failed the run or fenced this process off: exit at once with the code
    :mod:`common.exit_codes` gives ``reason``, writing nothing more (no report, no
    checkpoint, no push: a superseded process must not touch the fleet's state)."""
    code = exit_codes.for_stop(reason)
    log.error("controller says stop; exiting", extra=kv(reason=reason, exit_code=code))
    logging.shutdown()
    os._exit(code)


def _rss_bytes() -> float:
    try:
        with open("/proc/self/statm") as fh:
            return float(fh.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    except OSError:
        return 0.0


class Worker:
    """One worker process's state: data, model, trainer, controller link.

    Args:
        job: the parsed job file.
        rank: this worker's index.
        rows: where rows come from (RemoteRowSource for a fleet).
        controller: a controller.client.ControllerClient, or None for a static split.
        run_dir: where eval scores, reports and checkpoints go.
    """

    def __init__(self, job: Any, rank: int, rows: RowSource, controller: Any = None, run_dir: Path | None = None,
                 world: int | None = None, barrier: Any = None) -> None:
        from common.faults import FaultInjector

        self.job, self.rank, self.ctl = job, rank, controller
        self.world = job.train.workers if world is None else world
        self.run_dir = Path(run_dir or job.run.dir)
        self.telemetry = Telemetry(self.run_dir, rank, job.train.tb_every_steps, overlap=job.train.overlap is not False)
        self.rows: Any = CountingRowSource(rows, self.telemetry)
        self.dataset = MetaIODataset(job.data.train)
        self.model = build_model(job)
        torch.set_num_threads(job.train.threads)
        self._init_allreduce()
        from ps.grouping import group_tables

        self.trainer = Trainer(
            self.model, self.rows, job.train, job.meta, job.ps.dense_optimizer, rank=rank, world=self.world,
            barrier=barrier, ps_cfg=job.ps, groups=[g.names for g in group_tables(job.table_configs())],
        )
        self._born = time.time()
        self._warmed = False  # this incarnation's first step is done (see _after_step)
        # what fired goes to RUN/faults/ (metaps.run_report reads it: reports name only faults that fired)
        self.faults = FaultInjector(job.faults, "worker", rank, t0=float(os.environ.get("METAPS_T0", self._born)),
                                    record_dir=self.run_dir / "faults")
        self.history: list[dict[str, Any]] = []
        self.samples = 0
        self.busy_s = 0.0
        self.shards_done = 0
        self._hb: _Heartbeat | None = None
        self.final = False  # this worker wrote the run's final checkpoint (finish_run)
        self.final_metrics: dict[str, Any] | None = None  # the merged eval metrics of the final checkpoint
        self.checkpoint_error = ""  # the final checkpoint could not be written (FinalCheckpointFailed)
        self.stopped_reason = ""  # why it stopped training early ("max_steps"), for the controller
        self.callbacks: TrainingCallbacks = NO_CALLBACKS  # in-process callers (workers/callbacks.py)
        self.stop_asked = ""  # a callback's reason to stop: training ends after the current step
        self._draining = False
        self._stale_wait_seen = 0.0  # PsClient.stale_wait_s when _step_waits last read it
        self.lease_progress: tuple[str, int] = ("", 0)  # (lease, next batch of it): heartbeats, tail split
        self._lease_stop = 0  # the batch the current lease ends before (lowered by a `truncate` command)
        self._clock_released = False  # the controller took this worker out of the PS step clocks (flagged slow)
        self._dd: Any = None
        self._last_step_end = 0.0
        self._last_overlapped: bool | None = None
        self.start_step = 0
        self.first_step = 0  # the first step this incarnation ran (a rejoined clock can skip numbers)
        self.steps_run = 0  # steps this incarnation ran (not the span of its step numbers)
        self.wall_s = 0.0
        self._rounds = 0  # train() calls: more than one when a rollback reopened finished training
        self._last_rec: dict[str, Any] | None = None
        self._last_dense_s = 0.0
        self._periodic: Any = None  # workers.evaluation.PeriodicEval, made at the leader's first due step
        """All-reduce + DD policy: the workers.dd.DdLoop that applies the controller's batch sizes."""

    def _init_allreduce(self) -> None:
        if self.job.train.dense_sync != DenseSync.ALLREDUCE or self.world == 1:
            return
        import torch.distributed as dist

        addr = os.environ.get("METAPS_ALLREDUCE", f"127.0.0.1:{self.job.train.allreduce_port}")
        dist.init_process_group("gloo", init_method=f"tcp://{addr}", rank=self.rank, world_size=self.world)
        log.info("joined all-reduce group", extra=kv(rank=self.rank, world=self.world, addr=addr))

    # -- data -------------------------------------------------------------------------
    def _own_ranges(self, epoch: int) -> list[BatchRange]:
        """Without a controller: one worker (train-local) reads a one-worker fleet's order, the
        DDS's shuffled shards (:func:`common.shard_order.shard_order` with ``[controller.dds]
        batches_per_shard`` and ``seed``), so train-local and the fleet differ in nothing but the
        process layout; rank ``r`` of ``w > 1`` reads its static slice of every file."""
        if self.world > 1:
            return static_ranges(self.dataset, self.rank, self.world)
        dds = self.job.controller.dds
        files = [int(self.dataset.num_batches(f)) for f in range(self.dataset.num_files)]
        return [BatchRange(f, a, b) for f, a, b in shard_order(files, dds.batches_per_shard, dds.seed, epoch, "train")]

    @overload
    def _ranges(self, idle: Literal[False] = False) -> Iterator[tuple[BatchRange, Any]]: ...

    @overload
    def _ranges(self, idle: bool) -> Iterator[tuple[BatchRange | None, Any]]: ...

    def _ranges(self, idle: bool = False) -> Iterator[tuple[BatchRange | None, Any]]:
        """(range, lease) pairs: controller leases, or per epoch :meth:`_own_ranges` (no lease).

        Args:
            idle: while the DDS answers WAIT, yield ``(None, None)`` instead of sleeping, and ask it
                again only every ``_WAIT_POLL_S`` (an all-reduce worker joins each collective step
                idle meanwhile: blocking here would hold every other worker's step).
        """
        if self.ctl is None:
            for epoch in range(self.job.train.epochs):
                for r in self._own_ranges(epoch):
                    yield r, None
            self.rows.leave_clock()  # no more data: stop holding the others back (sync barriers too)
            return
        from controller.types import GetStatus

        waiting = False
        next_poll = 0.0
        while True:
            if idle and waiting and time.monotonic() < next_poll:
                yield None, None
                continue
            got = self.ctl.get_shard("train")
            if got.status is GetStatus.DONE:
                break
            if got.status is GetStatus.WAIT:
                # Idle on the data queue: stop holding back workers that are still training
                # (bounded staleness would otherwise block them on our frozen clock).
                if not waiting:
                    self.rows.leave_clock()
                    waiting = True
                next_poll = time.monotonic() + _WAIT_POLL_S
                if idle:
                    yield None, None
                else:
                    time.sleep(_WAIT_POLL_S)
                continue
            if waiting and not self._clock_released:
                # rejoin at no less than the fleet's slowest clock: never drag it back to missed steps
                self.trainer.resume(self.rows.join_clock(self.trainer.clock()))
                waiting = False
            lease = got.lease
            self.telemetry.leases(1)
            yield BatchRange(lease.file, lease.start, lease.stop), lease
            self.telemetry.leases(0)
        self.rows.leave_clock()

    # -- main loop --------------------------------------------------------------------
    def train(self) -> None:
        """Train on the leased shards (or this process's own order) until the train data is DONE.

        Called again by :func:`run_worker` when a rollback reopened finished training (a PS
        recovery after this worker finished, :meth:`work_reopened`): the worker registered once,
        rejoins the step clocks it left, and keeps its step numbering, counters and wall time.
        """
        again = self._rounds > 0
        self._rounds += 1
        if self.ctl is not None and self._hb is None:
            reg = self.ctl.register(pid=os.getpid())
            self._hb = _Heartbeat(self.ctl, max(0.2, reg.heartbeat_s), self)
            self._hb.start()
        t_start = time.perf_counter()
        wall_before = self.wall_s  # 0 on the first call
        if again:
            log.info("training reopened; training again", extra=kv(rank=self.rank, step=self.trainer.step_no))
            if not self._clock_released:  # it left the clocks when it finished: back at the fleet's slowest
                self.trainer.resume(self.rows.join_clock(self.trainer.clock()))
        else:
            self.train_start = time.time()
            self._eta = JobEta()
            self.start_step = self.trainer.step_no
        self._last_step_end = t_start
        if self._dd_mode():
            from workers.dd import DdLoop

            self._dd = DdLoop(self, self.job.controller.dd.global_batch)
            self._dd.run()
        elif self.job.train.dense_sync == DenseSync.ALLREDUCE and self.world > 1:
            self._train_allreduce()
        else:
            for rng, lease in self._ranges():
                t0 = time.perf_counter()
                n0 = self.samples
                batches = prefetch(self.read(rng.file, rng.start, rng.stop), depth=2)
                if lease is not None:
                    batches = self._stoppable(batches, lease.shard_id, rng.start, rng.stop)
                trained = 0
                for stats in self.trainer.run(batches):
                    self._after_step(stats)
                    trained += 1
                    if self.stop_asked:
                        break
                if self.ctl is not None and lease is not None:  # rides on the next GetShard (one RPC)
                    # a lease told to truncate reports where it stopped; the DDS requeues the rest
                    stop = self.lease_progress[1] if self._lease_stop < rng.stop else 0
                    cut = self.trainer._at_limit() and rng.start + trained < (stop or rng.stop)
                    if cut:
                        stop = rng.start + trained  # the step limit cut the lease: report what was trained
                    self.lease_progress = ("", 0)
                    self.ctl.defer_report(lease, "done", samples=self.samples - n0, elapsed_s=time.perf_counter() - t0,
                                          stop=stop, step_limit=cut)
                self.shards_done += 1
                if self._draining or self.trainer._at_limit() or self.stop_asked:
                    break
            if self.ctl is not None:
                self.ctl.flush_reports()  # stopped early (drain, step limit): the last report on its own
        if self.trainer._at_limit():
            self.stopped_reason = "max_steps"  # told in heartbeats: once every worker has, the run ends
        # Done training (data exhausted, step limit, drain): leave the step clocks now, not at
        # exit, so peers still training are not held at a barrier / the staleness bound while
        # this worker evaluates, waits for the job or checkpoints.
        self.rows.leave_clock()
        self.wall_s = wall_before + time.perf_counter() - t_start
        self.train_end = time.time()
        log.info(
            "training done",
            extra=kv(rank=self.rank, steps=self.trainer.step_no, samples=self.samples, shards=self.shards_done,
                     wall_s=round(self.wall_s, 2)),
        )
        self._finish_periodic()  # the last periodic evaluation still running: recorded before the final one
        self.faults.flush()

    def read(self, file: int, start: int, stop: int) -> Iterator[Any]:
        """Batches ``[start, stop)`` of ``file``, each :meth:`Trainer.prepare`d for its step.

        Meant to be iterated by the prefetch thread, so a batch's lookup index is built
        (and checked) there, off the step thread.
        """
        src = self.dataset.read_range(file, start, stop)
        try:
            for batch in src:
                yield self.trainer.prepare(batch)
        finally:
            close = getattr(src, "close", None)
            if close is not None:
                close()

    def _dd_mode(self) -> bool:
        """All-reduce workers under a controller running the DD policy: per-worker batch sizes."""
        from controller.config import PolicyKind

        return (self.job.train.dense_sync == DenseSync.ALLREDUCE and self.world > 1 and self.ctl is not None
                and self.job.controller.policy == PolicyKind.DD)

    def _train_allreduce(self) -> None:
        """Every step is a collective: idle workers join with zero gradients, also while the DDS
        tells them to WAIT (:meth:`_ranges` with ``idle``: a worker blocked asking for a lease would
        hold every other worker's step until the DDS's hang rule took a lease away, minutes at each
        epoch's tail). When every worker waits, the step is idle and they pause together."""
        ranges = self._ranges(idle=True)
        current: Iterator[Any] = iter(())
        lease, t0, n0 = None, 0.0, 0
        exhausted = waiting = False
        while True:
            batch = next(current, None)
            while batch is None and not exhausted:
                if lease is not None:
                    self.ctl.report_shard(lease, "done", samples=self.samples - n0, elapsed_s=time.perf_counter() - t0)
                    self.shards_done += 1
                    lease = None
                nxt = next(ranges, None)
                if nxt is None:
                    exhausted = True
                    break
                rng, lease = nxt
                waiting = rng is None
                if rng is None:
                    break  # told to WAIT: join this step idle
                t0, n0 = time.perf_counter(), self.samples
                current = iter(self.dataset.read_range(rng.file, rng.start, rng.stop))
                batch = next(current, None)
            stats = self.trainer.allreduce_step(batch, waiting=waiting and not exhausted)
            if stats is None:
                break
            if batch is not None:
                self._after_step(stats)
            elif stats.idle:
                time.sleep(_WAIT_POLL_S)  # nobody had a batch: everyone waits, pause together

    def _after_step(self, stats: StepStats) -> None:
        if self.faults.kill_due(born=self._born, step=stats.step, start_step=self.start_step):
            log.error("fault injection: killing this worker now", extra=kv(rank=self.rank, step=stats.step))
            os._exit(137)  # like SIGKILL: the agent restarts it, the DDS requeues its shard
        # a factor-x slower worker: x its forward/backward (basis "compute") or x its whole step
        # but its waits for slower workers (basis "step"); see faults.step_delay
        own_step_s = max(0.0, stats.total_s - self._step_waits())
        # an incarnation's first step is its warm-up (torch's lazy set-up: seconds of "compute"
        # against milliseconds later), not its speed: slowing it would make a 20x slower worker
        # sleep 20x its warm-up, minutes on a loaded box. A slow fault starts at the second step.
        first = not self._warmed
        if first:  # faults with since = "train" count from here (common/faults.py)
            self.faults.arm_training()
        delay = self.faults.step_delay(stats.compute_s, own_step_s, step=stats.step) if self._warmed else 0.0
        self._warmed = True
        if delay > 0:
            time.sleep(delay)
        self.samples += stats.samples
        self.busy_s += stats.total_s + delay
        step = stats.step
        self.steps_run += 1
        if first:
            self.first_step = step
        now = time.perf_counter()
        # data wait: the time between two steps' ends that the step itself did not use (reading,
        # waiting for a lease); the fault delay is neither
        data_wait = max(0.0, now - self._last_step_end - stats.total_s - delay)
        self._last_step_end = now
        dense_s, self._last_dense_s = self.telemetry.dense_sync_s - self._last_dense_s, self.telemetry.dense_sync_s
        if stats.overlapped != self._last_overlapped:  # overlap = "auto" may switch modes once
            self.telemetry.staleness(1 if stats.overlapped else 0)
            self._last_overlapped = stats.overlapped
        self.telemetry.on_step(step, stats.samples, stats.loss,
                               {"data_wait": data_wait, "pull": stats.pull_s, "compute": stats.compute_s,
                                "push": stats.push_s, "dense_sync": dense_s, "total": stats.total_s + delay},
                               stats.metrics)
        # live figures at the incarnation's first step (so its TensorBoard run and snapshot exist
        # at once; not start_step + 1: a worker told WAIT leaves the PS clocks and rejoins at the
        # fleet's, skipping step numbers) and every tb_every_steps; report() adds the last step
        due = self.telemetry.due(step) or (first and self.telemetry.every > 0)
        rec = {"step": step, "time": time.time(), "loss": stats.loss, "samples": self.samples,
               "samples_per_s": stats.samples / max(stats.total_s + delay, 1e-9),
               "pull_s": stats.pull_s, "compute_s": stats.compute_s, "push_s": stats.push_s,
               "data_wait_s": data_wait, "dense_sync_s": dense_s, "own_step_s": own_step_s, "fault_sleep_s": delay,
               "overlapped": stats.overlapped, **stats.metrics}
        self._last_rec = rec
        if step % self.job.train.log_every == 0 or step == 1:
            self.history.append(rec)
            log.info("step", extra=kv(rank=self.rank, step=step, loss=round(stats.loss, 4),
                                      samples_per_s=round(rec["samples_per_s"], 1), **self._eta_fields(step)))
        if due:
            self.telemetry.scalars(step, rec)
        self._periodic_eval(step)
        if due:
            self.telemetry.snapshot(self._report_dict(None, None, state="running"))
        if self.ctl is not None:
            self._report(stats, delay, telemetry=False, own_s=own_step_s + delay)
            self._handle_commands()
        total = int(getattr(self.trainer, "total_steps", 0) or 0)
        self._asked(self.callbacks.step(StepEvent(
            step, stats.loss, self.samples, total, dict(stats.metrics), min(1.0, step / total) if total > 0 else None)))

    def _asked(self, why: str) -> None:
        """A callback's answer: a reason to stop (the first one is kept), or '' to go on."""
        self.stop_asked = self.stop_asked or why

    def _step_waits(self) -> float:
        """Seconds this worker waited for slower workers (staleness bound, barriers) since the last call.

        Absent for in-process rows (no PS ``client``): 0.
        """
        waited = float(getattr(getattr(self.rows, "client", None), "stale_wait_s", 0.0))
        step_waits, self._stale_wait_seen = max(0.0, waited - self._stale_wait_seen), waited
        return step_waits

    def _report(self, stats: StepStats, delay: float, telemetry: bool = True, own_s: float | None = None) -> None:
        """Report one step to the controller's monitor (and, for loops that bypass :meth:`_after_step`
        such as the DD loop, to telemetry: ``telemetry=True``).

        Args:
            stats, delay: the step and the fault's sleep after it.
            telemetry: also record the step in telemetry.
            own_s: the step's own seconds (its time less its waits for slower workers, plus the
                fault's sleep); None: derived here from :meth:`_step_waits`.
        """
        if telemetry:
            self.telemetry.on_step(stats.step, stats.samples, stats.loss,
                                   {"pull": stats.pull_s, "compute": stats.compute_s, "push": stats.push_s,
                                    "total": stats.total_s + delay}, stats.metrics)
        # The monitor judges the worker's own speed: time spent waiting for slower workers at the
        # staleness bound is not counted (else under bounded staleness every worker runs at the slow
        # one's pace and none stands out).
        if own_s is None:
            own_s = stats.total_s + delay - self._step_waits()
        own_s = max(own_s, 1e-6)
        # One metrics RPC per step is cheap next to a training step and keeps the monitor's windows full.
        try:
            self.ctl.report_metrics(
                batch_times_s=[own_s],
                samples_per_s=stats.samples / own_s,
                samples=stats.samples,
                ps_pull_latency_s={0: stats.pull_s},
                ps_push_latency_s={0: stats.push_s},
            )
        except Exception as exc:
            log.warning("metrics report failed", extra=kv(error=str(exc)[:200]))

    def _handle_commands(self) -> None:
        if self._hb is None:
            return
        cmds = self._hb.take()
        cuts = [c.cut_id for c in cmds if c.kind == "checkpoint"]
        if cuts and self.is_leader:
            self._checkpoint_cuts(cuts)
        for cmd in cmds:
            if cmd.kind == "set_batch_size" and self._dd is not None:
                self._dd.plans.receive(cmd.cut_id, cmd.batch_size)  # cut_id carries the plan stamp
            if cmd.kind == "drain":
                log.info("draining on controller command", extra=kv(rank=self.rank, reason=cmd.reason))
                self._draining = True
            if cmd.kind == "truncate":
                self._truncate(cmd.shard_id, cmd.stop_batch)
            if cmd.kind in ("release_clock", "rejoin_clock"):
                self._set_clock_released(cmd.kind == "release_clock", cmd.reason)

    def _stoppable(self, batches: Iterator[Any], shard_id: str, start: int, stop: int) -> Iterator[Any]:
        """The lease's batches, ending early at a ``truncate`` command's stop; keeps :attr:`lease_progress`.

        Args:
            batches: the lease's batches, in order from ``start``.
            shard_id, start, stop: the lease.
        """
        self._lease_stop = stop
        pos = start
        self.lease_progress = (shard_id, pos)
        try:
            for b in batches:
                if pos >= self._lease_stop:
                    break
                pos += 1
                self.lease_progress = (shard_id, pos)  # batches before pos are handed to the trainer: they will be trained
                yield b
        finally:
            close = getattr(batches, "close", None)
            if close is not None:
                close()  # stops the read-ahead thread

    def _truncate(self, shard_id: str, stop_batch: int) -> None:
        """Stop the current lease before ``stop_batch``, or where it already is (the DDS tail split)."""
        current, pos = self.lease_progress
        if shard_id != current:
            log.info("truncate for a lease no longer held; ignored", extra=kv(rank=self.rank, shard=shard_id))
            return
        self._lease_stop = min(self._lease_stop, max(int(stop_batch), pos))
        log.info("lease truncated: its tail goes to a waiting worker",
                 extra=kv(rank=self.rank, shard=shard_id, stop=self._lease_stop, at=pos))

    def _set_clock_released(self, released: bool, reason: str = "") -> None:
        """Leave (``released``) or rejoin the PS step clocks on the controller's word (flagged slow / recovered).

        A released worker holds nobody back in bounded staleness; its own pulls never wait
        (it is behind) and its pushes are applied as in async mode. Rejoining numbers the
        next steps from the clock the PS answers (at least the slowest one present). Sync
        mode (PS barriers) keeps every worker in step: the command is ignored there.

        Args:
            released: True to leave the clocks, False to rejoin them.
            reason: the controller's reason, for the log.
        """
        if released == self._clock_released:
            return
        if self.trainer.barrier is not None:
            log.info("clock release ignored in sync mode", extra=kv(rank=self.rank, released=released))
            return
        if released:
            self.rows.leave_clock()
        else:
            self.trainer.resume(self.rows.join_clock(self.trainer.clock()))
        self._clock_released = released
        log.info("left the PS step clocks" if released else "rejoined the PS step clocks",
                 extra=kv(rank=self.rank, step=self.trainer.step_no, reason=reason))

    # -- checkpoints, eval, report ---------------------------------------------------------
    def _checkpoint_cuts(self, cut_ids: list[int]) -> None:
        """One checkpoint for every cut that opened since the last step (same state, one write).

        A checkpoint that fails (a PS died during it) leaves the cuts uncommitted and
        training goes on: the controller rolls back to an earlier committed cut if needed.
        """
        from ps.coordinator import CheckpointCoordinationError

        try:
            path = self.checkpoint(cut_id=cut_ids[-1])
        except CheckpointCoordinationError as exc:
            log.error("checkpoint failed; cuts left uncommitted", extra=kv(rank=self.rank, cuts=cut_ids, error=str(exc)[:300]))
            return
        for cut_id in cut_ids[:-1]:  # the last one was committed by checkpoint()
            self.ctl.checkpoint_done(cut_id, int(path.name.rsplit("-", 1)[1]), str(path))

    def checkpoint(self, cut_id: int = 0, metrics: dict[str, Any] | None = None) -> Path:
        step = self.trainer.step_no
        root = self.run_dir / "checkpoints"
        while (root / f"ckpt-{step}").exists():
            # rank 0's step names the checkpoint; a second one at the same step (rank 0 idle
            # while others trained, e.g. the final one right after a cut's) or after a restart
            # of this worker takes the next free step: committed checkpoints are never overwritten
            step += 1
        if step != self.trainer.step_no:
            log.info("checkpoint step taken; using the next free one", extra=kv(rank=self.rank, step=self.trainer.step_no, used=step))
        self.trainer.publish_dense()
        path = self.rows.checkpoint(root, step, checkpoint_info(self.job, step, metrics),
                                    full_every=self.job.ps.checkpoint_full_every)
        log.info("checkpoint written", extra=kv(rank=self.rank, step=step, dir=str(path), cut_id=cut_id))
        if self.ctl is not None and cut_id:
            self.ctl.checkpoint_done(cut_id, step, str(path))
        self._asked(self.callbacks.checkpointed(CheckpointEvent(step, Path(path))))
        return path

    def _periodic_eval(self, step: int) -> None:
        """The leader, every ``[train] eval_every_steps``: AUC on the first ``eval_max_rows`` eval rows,
        off the training path (:class:`workers.evaluation.PeriodicEval`: a copy of the model scored
        in a background thread while this worker trains on; in-process tables are scored inline).
        Each step hands over the evaluations that finished since the last one."""
        self._record_periodic(self._periodic.poll() if self._periodic is not None else [])
        every = self.job.train.eval_every_steps
        if not every or not self.job.data.eval or step % every or not self.is_leader:
            return
        if self._periodic is None:
            from workers.evaluation import PeriodicEval

            remote = hasattr(self.rows, "client")  # a fleet's PS client serves concurrent pulls
            self._periodic = PeriodicEval(MetaIODataset(self.job.data.eval), self.rows, self.job.meta,
                                          adapt=self.job.train.mode == TrainMode.META,
                                          max_rows=self.job.train.eval_max_rows,
                                          current_step=lambda: self.trainer.step_no, background=remote)
        if not self._periodic.start(step, self.model):
            log.info("periodic eval skipped: the previous one is still running",
                     extra=kv(rank=self.rank, step=step, skipped=self._periodic.skipped))
        self._record_periodic(self._periodic.poll())  # an inline one is done already

    def _finish_periodic(self) -> None:
        """Training is over: wait for the running periodic evaluation and record it."""
        if self._periodic is not None:
            self._record_periodic(self._periodic.wait(timeout_s=600.0))

    def _record_periodic(self, results: list[Any]) -> None:
        for r in results:
            flat = self.telemetry.on_eval(r.step, r.metrics)
            if self.telemetry.eval_points:  # how it ran: the report shows the evaluation left the step path
                self.telemetry.eval_points[-1].update(seconds=round(r.seconds, 3), rows=r.rows,
                                                      steps_during=r.steps_during, thread=r.thread,
                                                      recorded_at_step=self.trainer.step_no)
            self._asked(self.callbacks.evaluated(EvalEvent(r.step, flat)))
            log.info("periodic eval", extra=kv(rank=self.rank, step=r.step, s=round(r.seconds, 2), rows=r.rows,
                                               steps_during=r.steps_during, thread=r.thread,
                                               **{k.replace("/", "_"): round(v, 4) for k, v in flat.items()}))

    def evaluate(self) -> bool:
        """Score this worker's eval shards (controller) or its static slice of eval.

        Returns:
            False when training was reopened while this worker waited for eval shards (the DDS
            leases eval only once training is finished: a rollback after it finished holds eval
            back until the retraining is done; :func:`run_worker` trains again); else True.
        """
        if not self.job.data.eval:
            return True
        self.trainer.refresh_dense()
        eval_ds = MetaIODataset(self.job.data.eval)
        out_dir = self.run_dir / "eval"
        adapt = self.job.train.mode == TrainMode.META
        if self.ctl is not None:
            from controller.types import GetStatus

            next_check = 0.0
            while True:
                got = self.ctl.get_shard("eval")
                if got.status is GetStatus.DONE:
                    return True
                if got.status is GetStatus.WAIT:
                    if time.monotonic() >= next_check:
                        next_check = time.monotonic() + 1.0
                        if self._may_train_again() and self.work_reopened(self.ctl.status(brief=True), ("train",)):
                            return False
                    time.sleep(0.2)
                    continue
                lease = got.lease
                assert lease is not None
                scores = score_batches(self.model, self.rows, eval_ds.read_range(lease.file, lease.start, lease.stop),
                                       self.trainer.inner_loop, adapt=adapt)
                write_eval_file(out_dir / f"{lease.shard_id.replace('/', '_')}.npz", scores)
                self.ctl.report_shard(lease, "done", samples=0)
        else:
            for r in static_ranges(eval_ds, self.rank, self.world):
                scores = score_batches(self.model, self.rows, eval_ds.read_range(r.file, r.start, r.stop),
                                       self.trainer.inner_loop, adapt=adapt)
                write_eval_file(out_dir / f"static-{r.file}-{r.start}-{r.stop}.npz", scores)
        return True

    def _may_train_again(self) -> bool:
        """Not stopped on purpose: a worker that reached ``max_steps`` or is draining leaves the
        shards it did not train to the others (or to the run's end), whatever is still TODO."""
        return not self.stopped_reason and not self._draining and not self.trainer._at_limit()

    def work_reopened(self, status: dict[str, Any], datasets: tuple[str, ...] = ("train", "eval")) -> bool:
        """One of this worker's ``datasets`` (the ones it leases from) has shards to do again
        although the worker finished with it: a rollback (a PS recovery) returned shards done after
        its cut. Read from a (brief) controller status; the eval dataset counts only when this job
        has one."""
        mine = [n for n in datasets if n == "train" or self.job.data.eval]
        return any(d.get("dataset") in mine and int(d.get("shards_todo") or 0) > 0 and not d.get("finished")
                   for d in status.get("datasets") or [])

    @property
    def is_leader(self) -> bool:
        """This worker takes the checkpoint cuts and the final checkpoint (the controller's
        pick, told in heartbeat replies; rank 0 without a controller)."""
        if self.ctl is None:
            return self.rank == 0
        return self._hb is not None and self._hb.leader

    def finish_run(self, timeout_s: float = 3600.0,
                   poll_s: float = 0.5) -> tuple[dict[str, Any] | None, Path | None] | None:
        """After training and eval: the leader, once every dataset is done, merges the eval scores
        and writes the final checkpoint; every other worker waits until it has, and takes over
        if it becomes the leader meanwhile (the leader left). Returns (eval metrics, checkpoint)
        of this worker's final checkpoint, or (None, None); None when work came back while it
        waited (:meth:`work_reopened`: a rollback after training finished): train and evaluate again.

        Raises:
            TimeoutError: nothing ended the wait in ``timeout_s``; the message says what it waited for.
        """
        if self.ctl is None:
            return self._final_checkpoint() if self.rank == 0 else (None, None)
        deadline = time.monotonic() + timeout_s
        next_log = time.monotonic() + 30.0
        while True:
            st = self.ctl.status(brief=True)  # a poll: no coverage scan, nodes or events
            run = st.get("run") or {}
            if run.get("final_checkpoint"):
                return None, None
            if st.get("finished") and run.get("leader") == self.rank:
                return self._final_checkpoint()
            if not st.get("finished") and self._may_train_again() and self.work_reopened(st):
                return None
            waiting = (f"worker {run.get('leader')}'s final checkpoint" if st.get("finished") else
                       "every dataset done (" + ", ".join(f"{d['dataset']} {d['shards_done']}/{d['shards_total']} "
                                                          "shards" for d in st.get("datasets") or []) + ")")
            if time.monotonic() > deadline:
                raise TimeoutError(f"worker {self.rank}: waited {timeout_s:.0f}s for {waiting}")
            if time.monotonic() > next_log:
                next_log = time.monotonic() + 30.0
                log.info("training done; waiting for the run to end", extra=kv(rank=self.rank, waiting_for=waiting))
            time.sleep(poll_s)

    def _final_checkpoint(self) -> tuple[dict[str, Any] | None, Path]:
        """Merge the eval scores and write the run's final checkpoint.

        Raises:
            FinalCheckpointFailed: it could not be written (its partial files are removed);
                ``self.final_metrics`` keeps the eval metrics for the report.
        """
        from ps.coordinator import CheckpointWriteFailed

        metrics = merge_eval_files(self.run_dir / "eval") if self.job.data.eval else None
        self.final_metrics = metrics
        try:
            ckpt = self.checkpoint(metrics=metrics)
        except CheckpointWriteFailed as exc:
            raise FinalCheckpointFailed(f"{exc.path} not written: {exc.cause}", exc.path) from None
        self.final = True
        if self.ctl is not None:
            self._record_final_cut(ckpt)
        return metrics, ckpt

    def _record_final_cut(self, ckpt: Path) -> None:
        """Tell the controller the final checkpoint (``CheckpointDone`` with cut id 0): it becomes a
        committed cut of the finished run, so a PS restarted afterwards is restored to it, not to an
        older cut whose rollback would reopen finished training. A refusal (a PS recovery became
        pending meanwhile: its rollback reopens work, which :meth:`finish_run` then trains) is logged."""
        from controller.client import ControllerError
        from controller.types import FINAL_CUT

        try:
            self.ctl.checkpoint_done(FINAL_CUT, int(ckpt.name.rsplit("-", 1)[1]), str(ckpt))
        except ControllerError as exc:
            log.warning("final checkpoint not recorded as a cut", extra=kv(rank=self.rank, dir=str(ckpt),
                                                                           error=str(exc)[:300]))

    def _eta_fields(self, step: int) -> dict[str, Any]:
        """``pct`` and ``eta_s`` of a run whose length this process knows (train-local: ``total_steps``);
        a fleet worker's share of the job is the controller's to say (the launcher's progress line)."""
        total = int(getattr(self.trainer, "total_steps", 0) or 0)
        if self.ctl is not None or total <= 0 or not hasattr(self, "_eta"):
            return {}
        r = self._eta.update(step - self.start_step, total - self.start_step, time.monotonic())
        return {"pct": round(r.pct, 1), "eta_s": None if r.eta_s is None else round(r.eta_s)}

    def _report_dict(self, eval_metrics: dict[str, Any] | None, checkpoint: Path | None,
                     state: str) -> dict[str, Any]:
        start = getattr(self, "start_step", 0)
        return {
            "rank": self.rank,
            "state": state,
            "time": time.time(),
            "steps": self.trainer.step_no,
            "start_step": start,
            "first_step": getattr(self, "first_step", 0),
            "steps_run": getattr(self, "steps_run", 0),
            "samples": self.samples,
            "shards": self.shards_done,
            "wall_s": getattr(self, "wall_s", 0.0),
            "train_start": getattr(self, "train_start", 0.0),
            "train_end": getattr(self, "train_end", 0.0),
            "busy_s": self.busy_s,
            "samples_per_s": self.samples / max(getattr(self, "wall_s", 0.0), 1e-9),
            "history": self.history,
            "eval": eval_metrics or {},
            "checkpoint": str(checkpoint) if checkpoint else "",
            "final": self.final,  # this worker wrote the run's final checkpoint
            "checkpoint_error": self.checkpoint_error,  # why this worker's final checkpoint was not written
            "dense_sha256": dense_digest(self.model) if state == "finished" else "",
            "overlap": self.trainer.overlap.report(),
        }

    def report(self, eval_metrics: dict[str, Any] | None, checkpoint: Path | None) -> dict[str, Any]:
        """Write this incarnation's final report (``worker-R.inc-N.json``) and ``worker-R.json``."""
        rep = self._report_dict(eval_metrics, checkpoint, state="finished")
        last = self._last_rec
        if last is not None and self.telemetry.every > 0 and self.telemetry.last_tb_step != last["step"]:
            self.telemetry.scalars(int(last["step"]), last)  # the incarnation's last step, in TensorBoard too
        if self._dd is not None:
            rep["dd_steps"] = [r.to_dict() for r in self._dd.records]
        path = self.run_dir / "workers" / f"worker-{self.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(path, {**rep, "incarnation": self.telemetry.incarnation,
                                 "eval_history": list(self.telemetry.eval_points)})
        self.telemetry.snapshot(rep)
        return rep

    def close(self) -> None:
        self.faults.flush()
        self.telemetry.close()
        if self._hb is not None:
            self._hb.stop_event.set()
        if self.job.train.dense_sync == DenseSync.ALLREDUCE and self.world > 1:
            import torch.distributed as dist

            if dist.is_initialized():
                dist.destroy_process_group()


def dense_digest(model: torch.nn.Module) -> str:
    """SHA-256 of this worker's dense parameters (float32 bytes in ``named_parameters`` order).

    All-reduce workers must end with identical dense parameters: equal digests in their reports.
    """
    import hashlib

    h = hashlib.sha256()
    for name, p in model.named_parameters():
        h.update(name.encode())
        h.update(p.detach().to(torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def run_worker(job: Any, rank: int, ps_addresses: list[str], controller_addr: str = "",
               run_dir: Path | None = None, start_step: int = 0) -> dict[str, Any]:
    """The whole life of one worker process; returns its report.

    Args:
        start_step: number steps from at least this one (a continued run: its cut's step).
    """
    from ps.client import PsClient
    from workers.config import resolve_device

    resolve_device(job.train.device)  # a CUDA setting on a machine without one fails here, in one line

    # A PS recovery's pause is leased for one controller node timeout and renewed while the
    # controller lives (controller/ps_recovery.py): a dead controller's pause ends within one,
    # a controller back within one pauses again and restores. Wait out three before giving up.
    ps_wait_s = max(60.0, 3 * job.controller.heartbeat_timeout_s) if controller_addr else 60.0
    client = PsClient(
        ps_addresses, job.rpc, value_dtype=job.ps.value_dtype, worker_id=f"worker-{rank}",
        register=True, max_request_rows=job.ps.max_request_rows, retry_timeout_s=ps_wait_s,
    )
    ctl = None
    if controller_addr:
        from controller.client import ControllerClient

        ctl = ControllerClient(controller_addr, job.rpc, role="worker", index=rank)
    barrier = client.barrier if job.ps.sync == "sync" else None
    worker = Worker(job, rank, RemoteRowSource(client), ctl, run_dir, barrier=barrier)
    # a restarted worker resumes its step numbering from its clock on the PS (ps/staleness.py)
    clock = client.registered_clock
    if start_step * worker.trainer.clock_scale > clock:  # a continued run: the restored PS knows no clocks
        clock = client.join_clock(start_step * worker.trainer.clock_scale)
    worker.trainer.resume(clock)
    finished = left = False
    try:
        while True:  # more than once only when a rollback reopened the data after training finished
            worker.train()
            if not worker.evaluate():
                continue
            try:
                done = worker.finish_run()
            except FinalCheckpointFailed as exc:
                _final_checkpoint_failed(worker, client, ctl, exc)
                left = True
                raise
            if done is not None:
                break
        metrics, ckpt = done
        rep = worker.report(metrics, ckpt)
        finished = True
        return rep
    finally:
        if not left:
            worker.close()
            client.close(leave=True)
        if ctl is not None:
            if finished:  # the controller's run outcome: complete once every worker finished
                _report_finished(ctl, rank)
            ctl.close()


def _final_checkpoint_failed(worker: Worker, client: Any, ctl: Any, exc: FinalCheckpointFailed) -> None:
    """Training finished, the final checkpoint could not be written: one error line, this
    worker's report (training finished, ``checkpoint_error``), the PS fleet left (before the
    controller stops it: leaving a stopped fleet would wait out the client's retries), and the
    controller told (``NodeDown`` ``final_checkpoint_failed: ...``, exit code 4) so it fails the
    run once; the caller re-raises and the process exits 4, which its agent does not restart.

    Args:
        worker: this worker (closed here).
        client: its PS client (closed here, leaving the fleet).
        ctl: its controller client (None: no controller).
        exc: the failure.
    """
    from controller.client import ControllerError
    from controller.types import NODE_CHECKPOINT_FAILED

    why = " ".join(str(exc).split())
    log.error("final checkpoint failed; training finished, the run fails",
              extra=kv(rank=worker.rank, dir=str(exc.path), error=why))
    worker.checkpoint_error = why
    try:
        worker.report(worker.final_metrics, None)
    except OSError as err:  # the report shares the full disk: the controller still hears of it
        log.warning("could not write this worker's report", extra=kv(rank=worker.rank, error=str(err)[:200]))
    worker.close()
    client.close(leave=True)
    if ctl is None:
        return
    try:
        ctl.node_down("worker", worker.rank, f"{NODE_CHECKPOINT_FAILED}: {why}", exit_codes.RUN_FAILED)
    except ControllerError as err:  # its agent reports the exit; the run fails on the restart limit instead
        log.error("could not tell the controller the final checkpoint failed",
                  extra=kv(rank=worker.rank, error=str(err)[:200]))


def _report_finished(ctl: Any, rank: int) -> None:
    from controller.client import ControllerError
    from controller.types import NODE_FINISHED

    try:
        ctl.node_down("worker", rank, NODE_FINISHED, 0)
    except ControllerError as exc:  # the controller is gone (the launcher stopped it): nothing waits on this
        log.warning("could not report this worker finished", extra=kv(rank=rank, error=str(exc)[:200]))
