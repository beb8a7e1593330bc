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
                pull rows -> compute -> row grads x share
                -> collective C (all-gather): every worker's (ids, row grads x share)
                -> each id's gradients summed over the workers; each active worker pushes
                   the ids it owns (id mod n_active), so every row gets ONE optimizer update
                -> collective B: dense grads x share
    share_i = samples_i / sum(samples): the average is weighted by samples, and the
    update equals one step on the global batch, rows included, for every row optimizer
    (SGD, Adagrad, rowwise Adagrad, Adam, FTRL): the PS applies the summed gradient once,
    as it would the global batch's. (Pushing each worker's scaled rows as its own update
    would be exact for SGD only: an Adagrad or Adam step normalises the gradient, so a row
    pushed at share 0.1 would move as far as at share 1.0.)

Collective A also carries each worker's active flag and unique-id count per table, so
collective C needs no size exchange of its own. C comes after every worker's compute,
so no push of step t can reach a peer's step-t pull; the pushes are done before B, so
every step-t update is on the PS before any worker leaves B and pulls step t+1.

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

import numpy as np
import torch

from meta_io.slicer import BatchSlicer, Take
from common.errors import MetapsError
from common.log import kv
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


def combine_row_grads(grads: dict[str, tuple[np.ndarray, np.ndarray]], tables: list[tuple[str, int]],
                      counts: torch.Tensor, pushers: list[int], rank: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Collective C: sum one step's row gradients over the DD workers; returns what this rank pushes.

    Every rank of the default ``torch.distributed`` group must call it at the same step,
    an idle one with ``grads = {}``. Each rank's ids and (already share-scaled) gradients
    travel as one int32 buffer (ids and float32 gradients bit-cast, never converted) in one
    ``all_gather``; a pushing rank then keeps the gathered ids it owns (``id mod
    len(pushers)`` = its index in ``pushers``) and sums their gradients per (table, id)
    (all tables of one dim at once: a stable sort by id then table, ``index_add_``). Every id any rank touched is owned by exactly one
    pusher, so the PS gets one gradient per row per step: the sum a single process would
    compute for the union of the ranks' batches.

    Args:
        grads: table -> (unique int64 ids [n], float32 grads [n, dim]) of this rank ({} when idle).
        tables: (name, dim) of every table, in the same order on every rank.
        counts: int64 [world, len(tables)]: each rank's id count per table (collective A).
        pushers: the ranks that push this step (the active ones), ascending, the same on every rank.
        rank: this rank.

    Returns:
        table -> (ids, summed grads) this rank pushes ({} when it is not a pusher); tables
        whose owned share is empty are left out.

    Raises:
        DdInvariantError: this rank's grads disagree with its count in ``counts`` (the
            collective's framing would be wrong on every rank).
    """
    import torch.distributed as dist

    cnt: list[list[int]] = counts.tolist()  # [world][tables]: plain ints (tensor indexing costs ~us each)
    world = len(cnt)
    dims = [d for _, d in tables]
    n_ids = [sum(row) for row in cnt]
    # int32 words per rank: its ids (2 words each), then its grads
    lengths = [2 * n + sum(c * d for c, d in zip(row, dims)) for n, row in zip(n_ids, cnt)]
    width = max(1, max(lengths))  # gloo: no empty buffers
    id_parts: list[torch.Tensor] = []
    grad_parts: list[torch.Tensor] = []
    for k, (name, dim) in enumerate(tables):
        n = cnt[rank][k]
        if name not in grads:
            if n:
                raise DdInvariantError(f"rank {rank}: table '{name}' announced {n} ids for the row-gradient "
                                       "combine but has no gradients")
            continue
        ids, g = grads[name]
        if ids.shape[0] != n or g.shape != (n, dim):
            raise DdInvariantError(f"rank {rank}: table '{name}' announced {n} ids x dim {dim} for the row-gradient "
                                   f"combine, got ids {tuple(ids.shape)} and grads {tuple(g.shape)}")
        id_parts.append(torch.from_numpy(np.ascontiguousarray(ids, dtype=np.int64)))
        grad_parts.append(torch.from_numpy(np.ascontiguousarray(g, dtype=np.float32)).reshape(-1))
    unknown = sorted(set(grads) - {name for name, _ in tables})
    if unknown:
        raise DdInvariantError(f"rank {rank}: row gradients for table(s) {unknown} that are not in the job's "
                               f"tables {[name for name, _ in tables]}")
    buf = torch.zeros(width, dtype=torch.int32)
    if id_parts:
        mine = torch.cat([torch.cat(id_parts).view(torch.int32), torch.cat(grad_parts).view(torch.int32)])
        buf[:mine.numel()] = mine
    gathered = [torch.empty(width, dtype=torch.int32) for _ in range(world)]
    dist.all_gather(gathered, buf)
    if rank not in pushers:
        return {}
    n_push, me = len(pushers), pushers.index(rank)
    out: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    by_dim: dict[int, list[int]] = {}
    for k, d in enumerate(dims):
        by_dim.setdefault(d, []).append(k)
    for dim, ks in by_dim.items():  # usually one group: every table has the model's default dim
        ids_p, tab_p, grad_p = [], [], []
        for r in range(world):
            if n_ids[r] == 0:
                continue
            all_ids = gathered[r][:2 * n_ids[r]].view(torch.int64)
            all_grads = gathered[r][2 * n_ids[r]:lengths[r]].view(torch.float32)
            if len(ks) == len(dims):  # the whole buffer is this group: no per-table slicing
                ids_p.append(all_ids)
                grad_p.append(all_grads.view(-1, dim))
                tab_p.append(torch.repeat_interleave(torch.arange(len(dims)), torch.tensor(cnt[r])))
                continue
            a = b = 0
            for k, (n, d) in enumerate(zip(cnt[r], dims)):
                if n and d == dim:
                    ids_p.append(all_ids[a:a + n])
                    grad_p.append(all_grads[b:b + n * d].view(n, d))
                    tab_p.append(torch.full((n,), k, dtype=torch.int64))
                a, b = a + n, b + n * d
        if not ids_p:
            continue
        g_ids, g_tab, g_grads = torch.cat(ids_p), torch.cat(tab_p), torch.cat(grad_p)
        if n_push > 1:  # the ids this rank owns
            own = torch.remainder(g_ids, n_push) == me
            g_ids, g_tab, g_grads = g_ids[own], g_tab[own], g_grads[own]
        if g_ids.numel() == 0:
            continue
        # one sum per (table, id): sort by table, then id (two stable sorts), cut where either changes
        order = torch.argsort(g_ids, stable=True)
        order = order[torch.argsort(g_tab[order], stable=True)]
        s_ids, s_tab = g_ids[order], g_tab[order]
        first = torch.ones(s_ids.numel(), dtype=torch.bool)
        first[1:] = (s_ids[1:] != s_ids[:-1]) | (s_tab[1:] != s_tab[:-1])
        segment = torch.cumsum(first, 0) - 1
        u_ids, u_tab = s_ids[first], s_tab[first]
        summed = torch.zeros((u_ids.numel(), dim), dtype=torch.float32).index_add_(0, segment, g_grads[order])
        sizes = torch.bincount(u_tab, minlength=len(dims)).tolist()
        for k, t_ids, t_grads in zip(range(len(dims)), torch.split(u_ids, sizes), torch.split(summed, sizes)):
            if sizes[k]:
                out[tables[k][0]] = (t_ids.numpy(), t_grads.numpy())
    return out


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
    combine_s: float = 0.0
    """Seconds in collective C (the row-gradient all-gather: mostly waiting for the slower peer)
    and summing the gathered gradients per id."""
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
        self._last_combine_s = 0.0
        self.tables: list[tuple[str, int]] = [(t.name, t.dim) for t in worker.job.table_configs()]
        """(name, dim) of every table: the framing of the row-gradient combine, the same on every rank."""

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
                ids = _ids_of(take.batch) if take.batch is not None else {}
                idle_done = take.units == 0 and slicer.exhausted
                n_tab = len(self.tables)
                head = torch.zeros(_HEAD + 2 * world + world * n_tab, dtype=torch.float64)
                head[0], head[1], head[2], head[3], head[4] = samples, float(take.batch is not None), size, take.units, \
                    float(idle_done)
                head[_HEAD + rank] = self.plans.latest
                # for the row-gradient combine (collective C): who is active, and its id count per table
                head[_HEAD + world + rank] = float(take.batch is not None)
                at = _HEAD + 2 * world + rank * n_tab
                head[at:at + n_tab] = torch.tensor([float(len(ids.get(t, ()))) for t, _ in self.tables],
                                                   dtype=torch.float64)
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
                self.plans.agree(head[_HEAD:_HEAD + world].tolist(), step)
                pushers = [r for r in range(world) if head[_HEAD + world + r] > 0]
                counts = head[_HEAD + 2 * world:].to(torch.int64).reshape(world, n_tab)
                if active == 0:
                    if n_done == world:
                        break
                    time.sleep(_IDLE_SLEEP_S)  # shards still leased elsewhere (e.g. a dead worker's)
                    self._commands()
                    continue
                stats = self._step(take, ids, samples, total, read_s, counts, pushers)
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
                                   combine_s=self._last_combine_s,
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

    def _step(self, take: Take, ids: dict[str, np.ndarray], samples: int, total: float, read_s: float,
              counts: torch.Tensor, pushers: list[int]) -> StepStats:
        """One weighted step: rows and dense grads scaled by this worker's sample share, the rows
        summed over the workers (collective C) and pushed once per id (see the module docstring).

        Args:
            ids: this worker's unique ids per table ({} when idle), as counted in collective A.
            counts: int64 [world, tables]: every worker's id counts (collective A).
            pushers: the active workers, who push the combined rows.
        """
        import torch.distributed as dist

        tr = self.trainer
        batch = take.batch
        t0 = time.perf_counter()
        pull_s = compute_s = push_s = 0.0
        self._last_compute_cpu_s = 0.0
        loss, metrics, tasks = 0.0, {}, 0
        share = samples / total if total > 0 else 0.0
        n_params = sum(p.numel() for _, p in tr._named_parameters())
        row_grads: dict[str, tuple[np.ndarray, np.ndarray]] = {}
        if batch is not None:
            rows = tr.rows.pull(ids, step=tr.step_no)
            pull_s = time.perf_counter() - t0
            cpu0 = time.process_time()
            result = tr.compute(batch, rows)
            compute_s = time.perf_counter() - t0 - pull_s
            self._last_compute_cpu_s = time.process_time() - cpu0
            row_grads = {t: (ids[t], (result.row_grads[t].detach() * share).numpy())
                         for t in ids if t in result.row_grads}
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
        t_comb = time.perf_counter()
        mine = combine_row_grads(row_grads, self.tables, counts, pushers, self.w.rank)
        t_push = time.perf_counter()
        self._last_combine_s = t_push - t_comb
        if batch is not None:  # an idle worker left the PS clocks: it pushes nothing (and owns nothing)
            tr.rows.push(mine, tr.step_no)
            push_s = time.perf_counter() - t_push
            busy += push_s
        t_grad = time.perf_counter()
        dist.all_reduce(flat)
        self._last_grad_wait_s = time.perf_counter() - t_grad
        t_apply = time.perf_counter()
        if total > 0:
            tr._apply_local(flat)
        self._last_apply_s = time.perf_counter() - t_apply
        tr.collective_step_done()
        return StepStats(tr.step_no, loss, samples, tasks, pull_s, compute_s, push_s, busy, metrics)
