"""The training step engine shared by ``metaps worker`` and ``metaps train-local``.

One step, for a plain or a meta batch::

    unique ids per table --pull--> rows [U_t, dim]          (RowSource)
    model(rows) -> loss -> grads of dense params and rows   (models.meta)
    row grads --push--> PS (aggregated per id by the client)
    dense grads --push--> PS dense store, params --pull-->  (dense_sync = ps)
             or --all-reduce--> local optimizer step         (dense_sync = allreduce)

Against a remote PS holding the dense parameters the push, the dense exchange and the
next batch's pull go as one message per shard (:meth:`Trainer._run_exchanged`); with
``overlap`` that message (push t-1, dense t-1, pull t+1) travels while step t computes,
so rows and dense parameters are exactly one step stale. Elsewhere (all-reduce, sync
barriers, the per-table path) ``overlap`` runs the pull of batch t+1 and the push of
step t on a background lane, in that order; rows are then exactly one step stale.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from meta_io.batch import FeatureBatch, MetaBatch, PlainBatch
from common.log import kv
from models.embedding import GroupedIndex, MetaGroupedIndex
from workers.config import DenseSync, LrSchedule, TrainConfig, TrainMode
from workers.row_source import RowSource

if TYPE_CHECKING:
    from models.base import CtrModel
    from models.features import GroupedLookup
    from models.meta import MetaStepResult

log = logging.getLogger(__name__)


@dataclass
class StepStats:
    """One step's figures; ``metrics`` holds ``loss/<head>`` (each head's share of ``loss``) and,
    in meta mode, ``query_loss``, ``query_loss/<head>``, ``support_loss_before/after``, ``tasks``."""

    step: int
    loss: float
    samples: int
    tasks: int
    pull_s: float
    compute_s: float
    push_s: float
    total_s: float
    metrics: dict[str, float] = field(default_factory=dict)
    overlapped: bool = False
    """An overlapped step (``[train] overlap``): the next batch's rows were pulled before this step's
    push (one step stale), on the background lane where the rows are remote."""
    idle: bool = False
    """All-reduce: no worker had a batch this round and one waits for a lease (nothing applied, the
    step number unchanged; :meth:`Trainer.allreduce_step`)."""


def _ids_of(batch: MetaBatch | PlainBatch) -> dict[str, np.ndarray]:
    return {t: u.numpy() for t, u in batch.unique_ids.items()}


@dataclass
class Prepared:
    """A batch with what its step needs precomputed (:meth:`Trainer.prepare`, on the prefetch thread).

    Args:
        batch: the batch as read.
        index: the grouped lookup index of its plain rows (None: not a grouped plain step).
        features: the rows the plain step trains on (a meta batch's support and query, flattened).
        meta: a meta step's grouped per-task pooling (None: not a grouped meta step). With neither
            ``index`` nor ``meta`` the step takes the per-table path.
    """

    batch: MetaBatch | PlainBatch
    index: GroupedIndex | None = None
    features: FeatureBatch | None = None
    meta: MetaGroupedIndex | None = None

    @property
    def grouped(self) -> GroupedIndex | MetaGroupedIndex | None:
        """What the step pulls and pushes per storage group (None: table by table)."""
        return self.index if self.index is not None else self.meta


Item = MetaBatch | PlainBatch | Prepared
"""What :meth:`Trainer.run` takes: batches as read, or prepared ahead."""


def _add_head_losses(res: "MetaStepResult") -> None:
    """A meta step's ``loss/<head>``: the outer loss is the query loss, so its per-head split
    (``query_loss/<head>``) is the step's loss per head."""
    res.metrics.update({"loss/" + k.split("/", 1)[1]: v for k, v in list(res.metrics.items())
                        if k.startswith("query_loss/")})


def _samples_of(batch: MetaBatch | PlainBatch) -> tuple[int, int]:
    if isinstance(batch, MetaBatch):
        return batch.support.num_rows() + batch.query.num_rows(), batch.num_tasks
    return batch.features.num_rows(), 0


class Trainer:
    """Runs steps of one model against a RowSource.

    Args:
        model: a models.base.CtrModel (dense parameters only; rows come from ``rows``).
        rows: where embedding rows and (in PS mode) dense parameters live.
        cfg: the ``[train]`` section.
        meta_cfg: the ``[meta]`` section (used when ``cfg.mode == "meta"``).
        dense_optimizer: the ``[ps].dense_optimizer`` config (all-reduce mode steps locally with it).
        rank / world: this worker's rank and the worker count (all-reduce mode).
        ps_cfg: the ``[ps]`` section: ``[meta] meta_emb``'s unseen rule compares pulled rows
            with its initial rows (:mod:`models.meta_emb`); needed only then.
        groups: table names per PS storage group (``ps.grouping.group_tables`` of the job's tables):
            steps then pull, pool and push group by group (one call each) when ``rows`` offers
            ``pull_groups`` (meta steps when their inner loop allows it: ``models.meta.grouped_meta_ok``);
            None: table by table.
    """

    def __init__(
        self,
        model: CtrModel,
        rows: RowSource,
        cfg: TrainConfig,
        meta_cfg: Any,
        dense_optimizer: Any = None,
        rank: int = 0,
        world: int = 1,
        barrier: Any = None,
        ps_cfg: Any = None,
        groups: Sequence[Sequence[str]] | None = None,
    ) -> None:
        self.model = model
        self.rows = rows
        self.cfg = cfg
        self.meta_cfg = meta_cfg
        self.rank = rank
        self.world = world
        self.barrier = barrier
        """Synchronous PS mode: a PS barrier, called twice per step t with ids 2t (every worker
        pulled step t, before any push) and 2t+1 (every step-t push applied, before dense params
        are loaded and step t+1 pulls); all-reduce steps use their collective as the first."""
        self.step_no = 0
        self._lane = ThreadPoolExecutor(max_workers=1, thread_name_prefix="row-lane")
        self._inflight: Future | None = None
        """Overlap mode: the last step's row push, possibly still in flight."""
        self._held: tuple[Any, list[torch.Tensor], Any, int] | None = None
        """One message per shard per step, overlapped: the last step's push (grouped ids, row grads,
        dense grads, step), sent with the next pull."""
        self._x_inflight: tuple[Future, list[str]] | None = None
        """One message per shard per step, overlapped: the exchange in flight (its reply holds the
        next batch's rows and the dense values) and the dense names it answers."""
        self._x_ready: list[torch.Tensor] | None = None
        self._params: dict[str, torch.nn.Parameter] | None = None
        """name -> dense parameter (models and the meta learner keep theirs), for :meth:`_load_flat`."""
        """Rows of the next batch taken from an exchange that :meth:`flush` landed."""
        self.learner: Any = None
        """Meta mode: the models.meta_learner.MetaLearner (learned inner rates, if any); its
        parameters are dense parameters like the model's (``meta_learner.*``): synced, checkpointed."""
        if cfg.mode == TrainMode.META and meta_cfg is not None:
            from models.meta_learner import MetaLearner

            self.learner = MetaLearner(model, meta_cfg)
            if self.learner.meta_emb:
                self.learner.set_init_rows(initial_rows(ps_cfg, model.dims))
        self._names = [n for n, _ in self._named_parameters()]
        self._local_dense: Any = None
        """All-reduce mode: a local DenseStore, the very optimizer code the PS runs in PS mode."""
        if cfg.dense_sync == DenseSync.PS:
            # Every worker builds the model from the same seed, so registering is idempotent.
            self.rows.register_dense(self._dense_numpy())
            self._load_dense(self.rows.pull_dense(self._names))
        else:
            from ps.dense_store import DenseStore

            # The PS keeps the group's dense copy (rank 0 publishes it every [train]
            # dense_publish_steps and before every checkpoint; a checkpoint restores it): a group
            # that re-forms after a rank failure, or a warm start, goes on from it, not from the
            # freshly built model. Registering is idempotent (same seed on every worker), so a
            # first start reads back its own initial values.
            self.rows.register_dense(self._dense_numpy())
            self._load_dense(self._group_agree(self.rows.pull_dense(self._names)))
            self._local_dense = DenseStore(dense_optimizer)
            for name, value in self._dense_numpy().items():
                self._local_dense.register(name, value)
        self.total_steps = cfg.max_steps
        """Planned steps of this run (``warmup_cosine`` decays to 0 there); train-local sets it."""
        from workers.overlap import OverlapProbe

        self.overlap = OverlapProbe(cfg.overlap, in_process=bool(getattr(rows, "in_process", False)))
        """Whether each step overlaps its row traffic (``[train] overlap``; "auto" measures)."""
        self.lookup: GroupedLookup | None = None
        """The model's :class:`models.features.GroupedLookup` when steps go group by group."""
        if groups is not None and getattr(rows, "supports_groups", False):
            from models.features import GroupedLookup
            from models.meta import grouped_meta_ok

            if cfg.mode != TrainMode.META or grouped_meta_ok(self.inner_loop):
                self.lookup = GroupedLookup(model.encoder, groups)
        self._scheduled: Any = self._scheduled_store(dense_optimizer)

    def _scheduled_store(self, dense_optimizer: Any) -> Any:
        """The DenseStore whose lr ``[train] lr_schedule`` drives (None: constant).

        Raises:
            ConfigError: a schedule is set but the dense optimizer runs on a remote PS.
        """
        if LrSchedule(self.cfg.lr_schedule) == LrSchedule.CONSTANT:
            return None
        if self._local_dense is not None:
            return self._local_dense
        store = getattr(self.rows, "store", None) if getattr(self.rows, "in_process", False) else None
        if store is None:
            from common.errors import ConfigError

            raise ConfigError(
                f"[train] lr_schedule = '{LrSchedule(self.cfg.lr_schedule).value}' needs the dense optimizer in the "
                f"worker (train-local, or [train] dense_sync = 'allreduce'); with dense_sync = 'ps' the PS steps it "
                f"at the fixed [ps.dense_optimizer] lr"
            )
        return store.dense

    def _set_dense_lr(self) -> None:
        """Set this step's dense lr (``[train] lr_schedule``) on the optimizer this process runs."""
        if self._scheduled is None:
            return
        from workers.hygiene import lr_factor

        sched = LrSchedule(self.cfg.lr_schedule)
        if sched == LrSchedule.WARMUP_COSINE and self.total_steps <= 0:
            from common.errors import ConfigError

            raise ConfigError("[train] lr_schedule = 'warmup_cosine' needs the run length: set [train] max_steps")
        if not hasattr(self, "_base_dense_cfg"):
            self._base_dense_cfg = self._scheduled.cfg
        base = self._base_dense_cfg
        factor = lr_factor(sched, self.step_no, self.cfg.warmup_steps, self.total_steps)
        self._scheduled.cfg = dataclasses.replace(base, lr=base.lr * factor)

    # -- step clock -------------------------------------------------------------
    @property
    def clock_scale(self) -> int:
        """PS clock units per step: 2 in sync PS mode (barrier ids count half-steps), else 1."""
        return 2 if self.barrier is not None else 1

    def clock(self) -> int:
        """This worker's clock on the PS for its next step (what it registers with)."""
        return self.step_no * self.clock_scale

    def resume(self, clock: int | None) -> None:
        """Number the next steps from the PS's answer to a registration (never backwards).

        A restarted worker gets its old clock back, a joiner the slowest clock present
        (``ps/staleness.py``); continuing from 0 would hold every other worker back
        until this one caught up.

        Args:
            clock: the clock the PS answered (``PsClient.join_clock``); None: no PS clocks.
        """
        if clock is None:
            return
        step = int(clock) // self.clock_scale
        if step > self.step_no:
            log.info("step numbering resumes from the PS clock", extra=kv(rank=self.rank, step=self.step_no, resumed=step))
            self.step_no = step

    # -- dense parameters -------------------------------------------------------
    @property
    def inner_loop(self) -> Any:
        """What adapted evaluation takes: the learner (with learned rates) or the ``[meta]`` config."""
        return self.learner if self.learner is not None else self.meta_cfg

    def _named_parameters(self) -> list[tuple[str, torch.nn.Parameter]]:
        """The model's parameters, then the meta learner's (``meta_learner.*``): every dense value."""
        named = list(self.model.named_parameters())
        if self.learner is not None:
            named += self.learner.store_named_parameters()
        return named

    def _dense_numpy(self) -> dict[str, np.ndarray]:
        return {n: p.detach().numpy().copy() for n, p in self._named_parameters()}

    @torch.no_grad()
    def _load_dense(self, values: dict[str, np.ndarray]) -> None:
        for name, p in self._named_parameters():
            p.copy_(torch.from_numpy(np.asarray(values[name]).reshape(p.shape)))

    def collective_step_done(self) -> None:
        """All-reduce mode: count a collective step; rank 0 publishes the group's dense copy on
        the PS every ``[train] dense_publish_steps`` (what a re-formed group goes on from)."""
        self.step_no += 1
        every = self.cfg.dense_publish_steps
        if self.rank == 0 and every and self.step_no % every == 0:
            self.rows.set_dense(self._dense_numpy())

    def _group_agree(self, values: dict[str, np.ndarray]) -> dict[str, np.ndarray]:
        """All-reduce mode: rank 0's ``values`` on every rank of the process group (a broadcast),
        so the group starts bitwise identical whatever each rank read; as is without a group."""
        import torch.distributed as dist

        if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
            return values
        flat = torch.cat([torch.from_numpy(np.ascontiguousarray(values[n], dtype=np.float32)).reshape(-1)
                          for n in self._names])
        dist.broadcast(flat, src=0)
        out, offset = {}, 0
        for n in self._names:
            size = int(np.prod(values[n].shape))
            out[n] = flat[offset:offset + size].numpy().reshape(values[n].shape)
            offset += size
        return out

    def _sync_dense(self, grads: dict[str, torch.Tensor]) -> None:
        if self.cfg.dense_sync == DenseSync.PS:
            # push the gradients, get the new values back: one round trip (every parameter is pushed)
            pushed = {n: g.detach().numpy() for n, g in grads.items()}
            values = self.rows.push_pull_dense(pushed, self.step_no)
            if len(values) != len(self._names):  # some parameter had no gradient: read it too
                values.update(self.rows.pull_dense([n for n in self._names if n not in values]))
            self._load_dense(values)
            return
        self._apply_local(torch.cat([grads[n].reshape(-1) for n in self._names]))

    def _apply_local(self, flat: torch.Tensor) -> None:
        assert self._local_dense is not None
        grads, offset = {}, 0
        for name, p in self._named_parameters():
            n = p.numel()
            grads[name] = flat[offset : offset + n].view(p.shape).numpy()
            offset += n
        self._local_dense.push(grads)
        self._load_dense(self._local_dense.pull(self._names))

    def refresh_dense(self) -> None:
        """PS mode: load the PS's current dense parameters (e.g. before evaluation)."""
        if self.cfg.dense_sync == DenseSync.PS:
            self._load_dense(self.rows.pull_dense(self._names))

    def flush(self) -> None:
        """Wait until the last step's row push (and, with one message per step, its dense
        gradients) is applied on the PS (overlap leaves it in flight or held)."""
        pushed, self._inflight = self._inflight, None
        if pushed is not None:
            pushed.result()
        if self._x_inflight is not None:
            self._x_ready = self._land_exchange()
        held, self._held = self._held, None
        if held is not None:
            index, grads, dense, step = held
            self._load_flat(dense[0], self.rows.exchange((index, grads), dense, None, step).dense)

    def publish_dense(self) -> None:
        """Before a checkpoint: land the in-flight row push; in all-reduce mode also store the
        (identical) local dense parameters on the PS."""
        self.flush()
        if self.cfg.dense_sync == DenseSync.ALLREDUCE:
            self.rows.set_dense(self._dense_numpy())

    # -- one step -----------------------------------------------------------------
    def prepare(self, batch: MetaBatch | PlainBatch) -> Prepared:
        """What the step of ``batch`` needs, built ahead (thread-safe: run it on the prefetch thread).

        With a grouped lookup, plain steps get their checked :class:`~models.embedding.GroupedIndex`
        (a meta batch trained plainly is flattened here too) and meta steps their
        :class:`~models.embedding.MetaGroupedIndex`; without, batches pass through.

        Raises:
            DataError: the batch's ids or shapes are wrong (named as the step would name them).
        """
        if self.lookup is None:
            return Prepared(batch)
        if self.cfg.mode == TrainMode.META:
            if not isinstance(batch, MetaBatch):
                raise TypeError("train.mode = 'meta' needs a Meta-IO dataset built with --layout meta")
            return Prepared(batch, meta=self.lookup.meta_index(batch.support, batch.query, batch.unique_ids))
        feats = _flatten_meta(batch).features if isinstance(batch, MetaBatch) else batch.features
        return Prepared(batch, self.lookup.index(feats, batch.unique_ids), feats)

    def _pull(self, item: Prepared, step: int) -> Any:
        if item.grouped is not None:
            return self.rows.pull_groups(item.grouped, step=step)
        return self.rows.pull(_ids_of(item.batch), step=step)

    def _pull_async(self, item: Prepared, step: int) -> "Future[Any]":
        if item.grouped is not None:
            return self.rows.pull_groups_async(item.grouped, step=step)
        return self.rows.pull_async(_ids_of(item.batch), step=step)

    def _diagnostics(self) -> bool:
        """Whether this step computes its diagnostics (``support_loss_after``): on the steps the
        worker logs (``[train] log_every``, and the first)."""
        every = max(1, int(self.cfg.log_every))
        return self.step_no == 0 or (self.step_no + 1) % every == 0

    def compute(self, batch: Item, rows_np: Any) -> Any:
        """Loss and gradients of one batch, given its pulled rows (per table, or per group for a
        prepared batch with a grouped index)."""
        from models.meta import MetaStepResult, meta_step, plain_step, plain_step_grouped

        if isinstance(batch, Prepared):
            if batch.meta is not None:
                self._set_dense_lr()
                meta = batch.meta
                assert isinstance(batch.batch, MetaBatch)  # prepare() built meta only for meta batches
                res = meta_step(self.model, batch.batch, dict(zip(meta.keys, rows_np)), self.inner_loop, grouped=meta,
                                diagnostics=self._diagnostics())
                _add_head_losses(res)
                res.group_grads = [res.row_grads[k] for k in meta.keys]
                res.row_grads = {}
                return res
            if batch.index is not None:
                self._set_dense_lr()
                assert batch.features is not None and self.lookup is not None  # prepare() built the index
                head_losses: dict[str, float] = {}
                loss, dense_grads, group_grads = plain_step_grouped(
                    self.model, batch.features, rows_np, batch.index, self.lookup, head_losses)
                return MetaStepResult(outer_loss=loss, dense_grads=dense_grads, row_grads={}, metrics=head_losses,
                                      group_grads=group_grads)
            batch = batch.batch
        rows = {t: torch.from_numpy(np.ascontiguousarray(r)) for t, r in rows_np.items()}
        self._set_dense_lr()
        if self.cfg.mode == TrainMode.META:
            if not isinstance(batch, MetaBatch):
                raise TypeError("train.mode = 'meta' needs a Meta-IO dataset built with --layout meta")
            res = meta_step(self.model, batch, rows, self.inner_loop, diagnostics=self._diagnostics())
            _add_head_losses(res)
            return res
        if isinstance(batch, MetaBatch):
            # Plain training on a meta layout: support and query rows are all training rows.
            batch = _flatten_meta(batch)
        head_losses = {}
        loss, dense_grads, row_grads = plain_step(self.model, batch, rows, head_losses)
        return MetaStepResult(outer_loss=loss, dense_grads=dense_grads, row_grads=row_grads, metrics=head_losses)

    def step(self, batch: Item, rows_np: Any, pull_s: float) -> StepStats:
        """One step; returns once its row push and dense sync are done."""
        return self._step(batch if isinstance(batch, Prepared) else Prepared(batch), rows_np, pull_s)

    def _row_push(self, item: Prepared, result: Any) -> tuple[Callable[[int], None], Callable[[int], "Future[None]"]]:
        """A step's row push, blocking and async (each takes the step): per group or per table."""
        grouped = item.grouped
        if grouped is not None:
            g_grads = [g.detach() for g in result.group_grads]
            return (lambda step: self.rows.push_groups(grouped, g_grads, step),
                    lambda step: self.rows.push_groups_async(grouped, g_grads, step))
        ids = _ids_of(item.batch)
        grads = {t: (ids[t], result.row_grads[t].detach().numpy()) for t in ids if t in result.row_grads}
        return (lambda step: self.rows.push(grads, step)), (lambda step: self.rows.push_async(grads, step))

    def _step(self, item: Prepared, rows_np: Any, pull_s: float, lane: ThreadPoolExecutor | None = None) -> StepStats:
        """One step. With ``lane`` the row push is queued there and may still be in flight on
        return (``self._inflight``); without, it runs alongside the dense sync and is done."""
        t0 = time.perf_counter()
        batch = item.batch
        result = self.compute(item, rows_np)
        t1 = time.perf_counter()
        if self.barrier is not None:
            # Sync mode, first of two barriers per step (PS barrier ids count half-steps: 2t, 2t+1):
            # every worker has pulled step t's rows, so no step-t push can leak into a peer's pull.
            self.barrier(2 * self.step_no)
        push, push_async = self._row_push(item, result)
        if lane is not None:
            pushed = lane.submit(push, self.step_no)
            self._inflight = pushed
        else:
            # The row push and the dense sync go out together (different PS state, both done before
            # the step ends): one round trip less per step than pushing rows first, no extra staleness.
            pushed = push_async(self.step_no)
        if self.barrier is not None and self.cfg.dense_sync == DenseSync.PS:
            # Second barrier: every worker's step-t rows and dense grads are applied; only then
            # load the dense params (pulled before it, they could lack a peer's step-t update).
            self.rows.push_dense({n: g.detach().numpy() for n, g in result.dense_grads.items()}, self.step_no)
            pushed.result()
            self.barrier(2 * self.step_no + 1)
            self._load_dense(self.rows.pull_dense(self._names))
        else:
            self._sync_dense(result.dense_grads)
            if lane is None or self.barrier is not None:
                pushed.result()
            if self.barrier is not None:
                self.barrier(2 * self.step_no + 1)
        t2 = time.perf_counter()
        samples, tasks = _samples_of(batch)
        self.step_no += 1
        return StepStats(
            step=self.step_no,
            loss=float(result.outer_loss.detach()),
            samples=samples,
            tasks=tasks,
            pull_s=pull_s,
            compute_s=t1 - t0,
            push_s=t2 - t1,
            total_s=pull_s + (t2 - t0),
            metrics=dict(result.metrics),
        )

    # -- one message per shard per step -------------------------------------------------------
    def _exchanges(self) -> bool:
        """Whether steps go as one message per shard (``PsClient.step_groups``): a remote PS holds
        the dense parameters, no sync barrier splits the step, and steps go group by group."""
        return (bool(getattr(self.rows, "supports_exchange", False)) and self.cfg.dense_sync == DenseSync.PS
                and self.barrier is None and self.lookup is not None)

    def _dense_flat(self, grads: dict[str, torch.Tensor]) -> tuple[list[str], np.ndarray, list[int]]:
        """A step's dense gradients as one flat float32 array (model order): (names, flat, sizes)."""
        names = [n for n in self._names if n in grads]
        if not names:
            return names, np.empty(0, dtype=np.float32), []
        flat = torch.cat([grads[n].detach().reshape(-1) for n in names]).to(torch.float32).numpy()
        return names, flat, [int(grads[n].numel()) for n in names]

    @torch.no_grad()
    def _load_flat(self, names: list[str], flat: np.ndarray | None) -> None:
        """Load the PS's new values of ``names`` (flat, in that order); parameters that had no
        gradient (so were not exchanged) are read too."""
        if flat is None:
            return
        if self._params is None:  # the same Parameter objects all run: look them up once
            self._params = dict(self._named_parameters())
        params = self._params
        values = torch.from_numpy(flat)
        at = 0
        for n in names:
            p = params[n]
            k = p.numel()
            p.copy_(values[at:at + k].view(p.shape))
            at += k
        if len(names) != len(self._names):
            got = set(names)
            self._load_dense(self.rows.pull_dense([n for n in self._names if n not in got]))

    def _land_exchange(self) -> list[torch.Tensor] | None:
        """Wait for the exchange in flight; load its dense values; its rows (the next batch's)."""
        inflight, self._x_inflight = self._x_inflight, None
        assert inflight is not None
        fut, names = inflight
        reply = fut.result()
        self._load_flat(names, reply.dense)
        rows: list[torch.Tensor] | None = reply.rows
        return rows

    def _run_exchanged(self, it: Iterator[Prepared]) -> Iterator[StepStats]:
        """:meth:`run` with one message per shard per step (``ps/step_frame.py``).

        Serial step t: compute, then one message carrying push t, dense t and the pull of batch
        t+1; its reply holds the new dense values and rows that include step t (staleness 0,
        the same values as separate calls). Overlapped step t: at its start one message carrying
        push t-1, dense t-1 and the pull of batch t+1 goes out, and step t computes while it
        travels; its reply is taken at the start of step t+1. Rows and dense parameters are then
        both exactly one step stale (batch t+1 sees every update up to step t-1).
        """
        probe = self.overlap
        cur = next(it, None)
        rows: list[torch.Tensor] | None = None
        last = time.perf_counter()
        while cur is not None and not self._at_limit():
            step = self.step_no
            t0 = time.perf_counter()
            overlapped = probe.overlap(step)
            index = cur.grouped
            assert index is not None  # a grouped lookup prepares every batch with its index
            if self._x_inflight is not None:
                rows = self._land_exchange()
            elif self._x_ready is not None:
                rows, self._x_ready = self._x_ready, None
            if rows is None or (not overlapped and self._held is not None):
                # the first step, or a serial step after an overlapped one: land the held push, pull
                held, self._held = self._held, None
                push, dense, pstep = ((held[0], held[1]), held[2], held[3]) if held else (None, None, step - 1)
                reply = self.rows.exchange(push, dense, index, pstep)
                self._load_flat(dense[0] if dense else [], reply.dense)
                rows = reply.rows
            wait_s = time.perf_counter() - t0
            nxt = next(it, None)
            nxt_index = nxt.grouped if nxt is not None else None
            t1 = time.perf_counter()
            if overlapped:
                held, self._held = self._held, None
                push, dense, pstep = ((held[0], held[1]), held[2], held[3]) if held else (None, None, step - 1)
                names = dense[0] if dense else []
                if push is not None or nxt_index is not None:
                    self._x_inflight = (self.rows.exchange_async(push, dense, nxt_index, pstep), names)
                result = self.compute(cur, rows)
                t2 = time.perf_counter()
                self._held = (index, [g.detach() for g in result.group_grads], self._dense_flat(result.dense_grads), step)
                rows = None
            else:
                result = self.compute(cur, rows)
                t2 = time.perf_counter()
                dense = self._dense_flat(result.dense_grads)
                reply = self.rows.exchange((index, [g.detach() for g in result.group_grads]), dense, nxt_index, step)
                self._load_flat(dense[0], reply.dense)
                rows = reply.rows
            t3 = time.perf_counter()
            samples, tasks = _samples_of(cur.batch)
            self.step_no += 1
            stats = StepStats(step=self.step_no, loss=float(result.outer_loss.detach()), samples=samples, tasks=tasks,
                              pull_s=wait_s, compute_s=t2 - t1, push_s=t3 - t2, total_s=wait_s + (t3 - t1),
                              metrics=dict(result.metrics), overlapped=overlapped)
            yield stats
            now = time.perf_counter()
            probe.record(step, now - last)
            last = now
            cur = nxt

    def run(self, batches: Iterable[Item]) -> Iterator[StepStats]:
        """Train on ``batches`` (as read, or :meth:`prepare`d ahead on the prefetch thread); yields
        per-step stats. Honors ``overlap`` (true, false, or "auto": :mod:`workers.overlap`) and
        ``max_steps``. Against a remote PS holding the dense parameters, a step is one message
        per shard (:meth:`_run_exchanged`)."""
        it = (b if isinstance(b, Prepared) else self.prepare(b) for b in batches)
        if self._exchanges():
            try:
                yield from self._run_exchanged(it)
            finally:
                self.flush()  # every push applied (or its error raised) before run() ends
                self._x_ready = None
            return
        probe = self.overlap
        # Overlapped steps run row traffic on one background lane, in this order:
        #     push t-1 | pull t+1 | push t | pull t+2 | ...     (FIFO, one thread)
        # while the main thread computes step t. Batch t+1's rows thus carry every update up to
        # step t-1 and never step t's (exactly one step stale, deterministic), and neither the
        # pull nor the PS-side push stalls the step. In-process (LocalRowSource) there is no
        # network to hide: the pull is done at once, before step t, which gives the same rows.
        # A serial step lands any push in flight first, then pulls, steps and pushes in turn.
        lane = None if getattr(self.rows, "in_process", False) else self._lane

        def pull_bg(b: Prepared) -> Future:
            if lane is None:
                return self._pull_async(b, self.step_no)
            return lane.submit(self._pull, b, self.step_no)

        nxt = next(it, None)
        pending: Future | None = None
        if nxt is not None and probe.overlap(self.step_no):
            pending = pull_bg(nxt)
        last = time.perf_counter()
        try:
            while nxt is not None and not self._at_limit():
                item = nxt
                step = self.step_no
                t0 = time.perf_counter()
                if pending is not None:
                    rows = pending.result()
                else:
                    self.flush()  # a serial step after an overlapped one: its push lands first
                    rows = self._pull(item, step)
                wait_s = time.perf_counter() - t0
                nxt = next(it, None)
                if probe.overlap(step):
                    pending = pull_bg(nxt) if nxt is not None else None  # before this step's push
                    stats = self._step(item, rows, wait_s, lane)
                    stats.overlapped = True
                else:
                    pending = None
                    stats = self._step(item, rows, wait_s)
                yield stats
                now = time.perf_counter()
                probe.record(step, now - last)  # the whole cycle: the caller's work after the step too
                last = now
        finally:
            self.flush()  # every push applied (or its error raised) before run() ends

    def allreduce_step(self, batch: MetaBatch | PlainBatch | None, waiting: bool = False) -> StepStats | None:
        """One collective step (all-reduce mode, world > 1); ``batch`` None = idle.

        Gradients are averaged weighted by each worker's sample count, so
        workers with fewer (or no) samples this step count for less. Returns
        None once no worker had a batch and none is ``waiting`` (every worker leaves
        together). An idle worker that waits for a lease (the DDS said WAIT: another
        worker's shard may come back) passes ``waiting``: when no worker had a batch but
        one waits, nothing is applied, the step number stays, and the returned stats
        are ``idle`` (ask for work again).
        """
        import torch.distributed as dist

        t0 = time.perf_counter()
        n_params = sum(p.numel() for _, p in self._named_parameters())
        samples, tasks = _samples_of(batch) if batch is not None else (0, 0)
        pull_s = compute_s = 0.0
        loss = 0.0
        metrics: dict[str, float] = {}
        if batch is not None:
            rows = self.rows.pull(_ids_of(batch), step=self.step_no)
            pull_s = time.perf_counter() - t0
            result = self.compute(batch, rows)
            compute_s = time.perf_counter() - t0 - pull_s
            ids = _ids_of(batch)
            row_grads = {t: (ids[t], result.row_grads[t].detach().numpy()) for t in ids if t in result.row_grads}
            flat = torch.cat([result.dense_grads[n].reshape(-1) for n in self._names]) * samples
            loss, metrics = float(result.outer_loss.detach()), dict(result.metrics)
        else:
            flat = torch.zeros(n_params)
        packed = torch.cat([flat, torch.tensor([float(samples), 1.0 if batch is not None else 0.0,
                                                1.0 if waiting and batch is None else 0.0])])
        # The all-reduce is also a barrier: every worker has pulled step t's rows, so the row
        # pushes below cannot leak into a peer's step-t pull.
        dist.all_reduce(packed)
        total, active, waiters = float(packed[-3]), float(packed[-2]), float(packed[-1])
        if active == 0:
            if waiters == 0:
                return None
            return StepStats(self.step_no, 0.0, 0, 0, 0.0, 0.0, 0.0, time.perf_counter() - t0, {}, idle=True)
        if batch is not None:
            self.rows.push(row_grads, self.step_no)
        if self.barrier is not None:
            # Sync mode: every worker's step-t row push is applied before anyone pulls step t+1
            # (barrier ids count half-steps as in _step; idle workers join it too).
            self.barrier(2 * self.step_no + 1)
        if total > 0:
            self._apply_local(packed[:-3] / total)
        self.collective_step_done()
        t1 = time.perf_counter()
        return StepStats(self.step_no, loss, samples, tasks, pull_s, compute_s, t1 - t0 - pull_s - compute_s,
                         t1 - t0, metrics)

    def _at_limit(self) -> bool:
        return bool(self.cfg.max_steps) and self.step_no >= self.cfg.max_steps


def initial_rows(ps_cfg: Any, dims: dict[str, int]) -> dict[str, Any]:
    """table -> the PS's initial-row function (``[meta] meta_emb``'s unseen rule).

    Args:
        ps_cfg: the job's ``[ps]`` section (None: the ``[ps]`` defaults, logged as a warning).
        dims: the model's table dims.
    """
    from ps.config import PsConfig
    from ps.initializer import RowInitializer

    if ps_cfg is None:
        log.warning("meta_emb: no [ps] config given; the unseen rule uses the default initial rows")
        ps_cfg = PsConfig()
    return {c.name: RowInitializer(c.name, c.dim, c.init, c.init_scale, int(ps_cfg.seed))
            for c in ps_cfg.table_configs(list(dims))}


def _flatten_meta(batch: MetaBatch) -> PlainBatch:
    """A meta batch as one plain batch of all its support and query slots."""
    from meta_io.batch import FeatureBatch

    def flat(fb: FeatureBatch) -> FeatureBatch:
        return fb.map(lambda t: t.reshape(-1, *t.shape[2:]))

    s, q = flat(batch.support), flat(batch.query)
    cat = lambda a, b: torch.cat([a, b], dim=0)  # noqa: E731
    merged = FeatureBatch(
        ids={k: cat(s.ids[k], q.ids[k]) for k in s.ids},
        dense=cat(s.dense, q.dense),
        vectors={k: cat(s.vectors[k], q.vectors[k]) for k in s.vectors},
        labels={k: cat(s.labels[k], q.labels[k]) for k in s.labels},
        mask=cat(s.mask, q.mask),
        scenario=cat(s.scenario, q.scenario),
        oracle={k: cat(s.oracle[k], q.oracle[k]) for k in s.oracle},
    )
    return PlainBatch(features=merged, unique_ids=batch.unique_ids)
