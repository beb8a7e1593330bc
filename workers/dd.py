"""AntDT-DD in all-reduce workers: per-worker batch sizes that switch at a shared step.

With ``[train] dense_sync = "allreduce"`` and ``[controller] policy = "dd"`` each
worker trains ``size_i`` units per step (task slots in the meta layout, row
slots in the plain layout), served by :class:`meta_io.slicer.BatchSlicer`
across record-batch and shard boundaries, and the sizes of all workers sum to
``[controller.dd] global_batch`` at every step.

How a new split reaches every worker at the same step::

    controller: DdPolicy -> SetBatchSizes -> one set_batch_size command per worker,
                all stamped with the same plan id (Command.cut_id, increasing)
    worker i:   heartbeat thread collects its command: plans[plan] = its size
    step t:     collective A (float64, tiny): [samples, active, size, units, exhausted,
                                               latest plan id known by worker 0..w-1]
                -> every worker sees every worker's latest plan and adopts, for step t+1,
                   plan = min over workers (every worker holds that plan's size)
                -> sum of sizes checked == global batch (DdInvariantError otherwise)
                pull rows -> compute -> push rows x share -> collective B: dense grads x share
    share_i = samples_i / sum(samples): the average is weighted by samples, and the
    update equals one step on the global batch (rows too: the PS sums the scaled pushes).

Until every worker holds plan 1, everyone trains the equal split (plan 0). A
plan that does not cover every live worker is never sent (controller/server.py),
so the min-agreement never lands on a plan a worker lacks; if it did, the sum
check would stop the run with a clear error rather than train a wrong batch.

The step time a worker reports to the monitor is its own work (pull, compute,
push, injected slowdown), not the time it waits in the collectives for slower
peers: otherwise every worker would look as slow as the slowest, and the DD
policy would see equal speeds.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from typing import Any

import torch

from meta_io.slicer import BatchSlicer, Take
from metaps.core.errors import MetapsError
from metaps.core.log import kv
from workers.data_feed import BatchRange
from workers.trainer import StepStats, _ids_of, _samples_of

log = logging.getLogger(__name__)

_IDLE_SLEEP_S = 0.05
_HEAD = 5  # samples, active, size, units, exhausted


class DdInvariantError(MetapsError):
    """The per-worker batch sizes of one step do not sum to the global batch."""


def equal_split(world: int, global_batch: int) -> dict[int, int]:
    """Plan 0: ``global_batch`` split as evenly as integers allow (lower ranks get the remainder)."""
    from controller.policy.dd import proportional_batch_sizes

    return proportional_batch_sizes({i: 1.0 for i in range(world)}, global_batch)


class BatchPlans:
    """The batch-size plans one worker has received, and the one in force.

    Args:
        rank / world: this worker and the worker count.
        global_batch: the sum every plan keeps.
    """

    def __init__(self, rank: int, world: int, global_batch: int) -> None:
        self.rank, self.world, self.global_batch = rank, world, global_batch
        self.sizes: dict[int, int] = {0: equal_split(world, global_batch)[rank]}
        self.latest = 0
        self.current = 0

    def receive(self, plan: int, size: int) -> None:
        """A ``set_batch_size`` command: this worker's size under plan ``plan``."""
        if plan <= 0 or size < 1:
            log.warning("ignoring malformed set_batch_size", extra=kv(rank=self.rank, plan=plan, size=size))
            return
        self.sizes[plan] = size
        self.latest = max(self.latest, plan)
        log.info("batch size received", extra=kv(rank=self.rank, plan=plan, size=size))

    @property
    def size(self) -> int:
        return self.sizes[self.current]

    def agree(self, latest_by_rank: list[float], step: int) -> None:
        """Adopt the newest plan every worker holds (the min of their latest)."""
        plan = int(min(latest_by_rank))
        if plan > self.current:
            if plan not in self.sizes:
                raise DdInvariantError(f"worker {self.rank}: the workers agreed on batch plan {plan} at step {step}, "
                                       f"but this worker never received it (holds {sorted(self.sizes)})")
            log.info("batch size switched", extra=kv(rank=self.rank, step=step, plan=plan,
                                                     size=self.sizes[plan], was=self.sizes[self.current]))
            self.current = plan
            for old in [p for p in self.sizes if p < plan]:
                del self.sizes[old]


@dataclass
class DdStepRecord:
    step: int
    plan: int
    size: int
    units: int
    samples: int
    size_sum: int
    units_sum: int
    spans: list[list[int]]
    t: float
    """Wall-clock time at the end of the step (for throughput over a window of steps)."""
    read_s: float = 0.0
    """Seconds in ``BatchSlicer.take`` (lease RPCs, record-batch reads, slicing)."""
    pull_s: float = 0.0
    compute_s: float = 0.0
    push_s: float = 0.0
    compute_cpu_s: float = 0.0
    """CPU seconds of this process during ``compute_s`` (all its threads): below ``compute_s``
    when the worker waited for a core (a shared, oversubscribed box)."""
    sleep_s: float = 0.0
    """The fault injector's requested sleep (0 unless this worker is slowed): (factor - 1) x ``compute_s``."""
    head_wait_s: float = 0.0
    """Seconds in collective A (the sizes/plan exchange): mostly waiting for the slower peer."""
    grad_wait_s: float = 0.0
    """Seconds in collective B (the dense gradients)."""
    apply_s: float = 0.0
    """The local optimizer step on the all-reduced dense gradients."""
    shard_report_s: float = 0.0
    """``ReportShard`` RPCs for the leases this step finished."""
    report_s: float = 0.0
    """The per-step metrics report to the controller's monitor and the command check."""
    wall_s: float = 0.0
    """This iteration's wall time from ``take`` to the end of its reports (the parts above
    plus the weighting and bookkeeping between them)."""

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


class DdLoop:
    """The all-reduce training loop with controller-set batch sizes (see the module docstring).

    Args:
        worker: the :class:`workers.worker.Worker` (its trainer, dataset, controller, faults).
        global_batch: ``[controller.dd] global_batch``.
    """

    def __init__(self, worker: Any, global_batch: int) -> None:
        self.w = worker
        self.trainer = worker.trainer
        self.plans = BatchPlans(worker.rank, worker.world, global_batch)
        self.records: list[DdStepRecord] = []
        self._leases_done = False
        self._idle = False
        self._last_sleep_s = 0.0
        self._warmed = False  # this incarnation's first step with a batch is done (its warm-up)
        self._last_grad_wait_s = 0.0
        self._last_apply_s = 0.0
        self._last_compute_cpu_s = 0.0

    def _next_range(self) -> tuple[BatchRange, Any] | None:
        from controller.types import GetStatus

        if self._leases_done:
            raise StopIteration
        got = self.w.ctl.get_shard("train")
        if got.status is GetStatus.DONE:
            self._leases_done = True
            raise StopIteration
        if got.status is GetStatus.WAIT:
            return None
        lease = got.lease
        return BatchRange(lease.file, lease.start, lease.stop), lease

    def run(self) -> None:
        import torch.distributed as dist

        slicer = BatchSlicer(self.w.dataset, self._next_range)
        world, rank = self.w.world, self.w.rank
        shard_t0 = time.perf_counter()
        shard_samples = 0
        try:
            while True:
                size = self.plans.size
                t0 = time.perf_counter()
                t_iter = t0
                take = slicer.take(size)
                read_s = time.perf_counter() - t0
                self._clock(take.units > 0)
                samples = _samples_of(take.batch)[0] if take.batch is not None else 0
                idle_done = take.units == 0 and slicer.exhausted
                head = torch.zeros(_HEAD + world, dtype=torch.float64)
                head[0], head[1], head[2], head[3], head[4] = samples, float(take.batch is not None), size, take.units, \
                    float(idle_done)
                head[_HEAD + rank] = self.plans.latest
                t_head = time.perf_counter()
                dist.all_reduce(head)
                head_wait_s = time.perf_counter() - t_head
                total, active, size_sum, units_sum, n_done = (float(head[0]), float(head[1]), int(head[2]),
                                                               int(head[3]), int(head[4]))
                step = self.trainer.step_no + 1
                if size_sum != self.plans.global_batch:
                    raise DdInvariantError(
                        f"step {step}: worker batch sizes sum to {size_sum}, expected the global batch "
                        f"{self.plans.global_batch} (this worker: {size} under plan {self.plans.current})")
                plan_now = self.plans.current
                self.plans.agree(head[_HEAD:].tolist(), step)
                if active == 0:
                    if n_done == world:
                        break
                    time.sleep(_IDLE_SLEEP_S)  # shards still leased elsewhere (e.g. a dead worker's)
                    self._commands()
                    continue
                stats = self._step(take, samples, total, read_s)
                t_post = time.perf_counter()
                shard_samples += samples
                for lease in take.finished:
                    self.w.ctl.report_shard(lease, "done", samples=shard_samples,
                                            elapsed_s=time.perf_counter() - shard_t0)
                    self.w.shards_done += 1
                    shard_t0, shard_samples = time.perf_counter(), 0
                t_report = time.perf_counter()
                if take.batch is not None:
                    self.w.samples += samples
                    self.w.busy_s += stats.total_s
                    self.w._report(stats, 0.0)
                self._commands()
                t_end = time.perf_counter()
                rec = DdStepRecord(stats.step, plan_now, size, take.units, samples, size_sum, units_sum,
                                   [s.to_list() for s in take.spans], time.time(), read_s=read_s,
                                   pull_s=stats.pull_s, compute_s=stats.compute_s, push_s=stats.push_s,
                                   sleep_s=self._last_sleep_s, head_wait_s=head_wait_s,
                                   grad_wait_s=self._last_grad_wait_s, apply_s=self._last_apply_s,
                                   compute_cpu_s=self._last_compute_cpu_s,
                                   shard_report_s=t_report - t_post, report_s=t_end - t_report,
                                   wall_s=t_end - t_iter)
                self.records.append(rec)
                if stats.step % self.w.job.train.log_every == 0 or stats.step == 1:
                    log.info("dd step", extra=kv(rank=rank, step=stats.step, plan=plan_now, size=size,
                                                 units=take.units, size_sum=size_sum, units_sum=units_sum))
                if self.w._draining or self.trainer._at_limit():
                    break
        finally:
            slicer.close()
            self._clock(False)

    def _clock(self, training: bool) -> None:
        """Leave the PS staleness clock while this worker has no units (others train on without
        it: the DDS holds the next epoch until this one is done), join it again when it has."""
        if training and self._idle:
            self.w.rows.join_clock(self.trainer.step_no)
        elif not training and not self._idle:
            self.w.rows.leave_clock()
        self._idle = not training

    def _commands(self) -> None:
        self.w._handle_commands()

    def _step(self, take: Take, samples: int, total: float, read_s: float) -> StepStats:
        """One weighted step: rows and dense grads scaled by this worker's sample share."""
        import torch.distributed as dist

        tr = self.trainer
        batch = take.batch
        t0 = time.perf_counter()
        pull_s = compute_s = push_s = 0.0
        self._last_compute_cpu_s = 0.0
        loss, metrics, tasks = 0.0, {}, 0
        share = samples / total if total > 0 else 0.0
        n_params = sum(p.numel() for _, p in tr._named_parameters())
        if batch is not None:
            ids = _ids_of(batch)
            rows = tr.rows.pull(ids, step=tr.step_no)
            pull_s = time.perf_counter() - t0
            cpu0 = time.process_time()
            result = tr.compute(batch, rows)
            compute_s = time.perf_counter() - t0 - pull_s
            self._last_compute_cpu_s = time.process_time() - cpu0
            t1 = time.perf_counter()
            tr.rows.push({t: (ids[t], result.row_grads[t].detach().numpy() * share)
                          for t in ids if t in result.row_grads}, tr.step_no)
            push_s = time.perf_counter() - t1
            flat = torch.cat([result.dense_grads[n].reshape(-1) for n in tr._names]) * share
            loss, metrics = float(result.outer_loss.detach()), dict(result.metrics)
            tasks = _samples_of(batch)[1]
        else:
            flat = torch.zeros(n_params)
        busy = read_s + (time.perf_counter() - t0)
        self._last_sleep_s = 0.0
        if batch is not None:
            # A worker slowed `factor` x computes `factor` x as long on the same batch: the sleep is
            # (factor - 1) x its own forward/backward for this batch. Not x its whole busy time: the
            # pull/push time is mostly the PS serving every worker (a shared, serialised cost that
            # grows with the *other* workers' shares), so scaling it made a smaller batch barely
            # cheaper for the slowed worker (docs/BENCHMARKS.md, E5i).
            # Not on the incarnation's first step with a batch: that is torch's warm-up (seconds
            # of lazy set-up), not the worker's speed; the async worker skips it too (workers/worker.py).
            delay = self.w.faults.step_delay(compute_s) if self._warmed else 0.0
            self._warmed = True
            if delay > 0:  # an injected slowdown is this worker's own work: before the collective
                time.sleep(delay)
                self._last_sleep_s = delay
                busy += delay
            if self.w.faults.kill_due(born=self.w._born):
                log.error("fault injection: killing this worker now", extra=kv(rank=self.w.rank, step=tr.step_no))
                import os

                os._exit(137)
        t_grad = time.perf_counter()
        dist.all_reduce(flat)
        self._last_grad_wait_s = time.perf_counter() - t_grad
        t_apply = time.perf_counter()
        if total > 0:
            tr._apply_local(flat)
        self._last_apply_s = time.perf_counter() - t_apply
        tr.step_no += 1
        return StepStats(tr.step_no, loss, samples, tasks, pull_s, compute_s, push_s, busy, metrics)
