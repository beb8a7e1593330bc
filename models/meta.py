"""Functional G-Meta / MAML step, vectorized over the tasks of a meta batch.

Per task ``i`` (support S_i, query Q_i), with shared dense params ``p`` and the
meta batch's gathered rows ``r``::

    (p_0, r_0) = (p, r)
    (p_k, r_k) = (p_{k-1}, r_{k-1}) - (u_p, u_r)                                # adapted subset only
                 u_p = inner_lr      * grad_p L(S_i; p_{k-1}, r_{k-1})           # dense parameters
                 u_r = inner_lr_rows * grad_r L(S_i; p_{k-1}, r_{k-1})           # rows ([meta] inner_lr_rows; 0: inner_lr)
                 [meta] inner_clip c > 0: each group's u scaled by min(1, c / ||u||)  (its L2 norm over the group)
                 # L(S_i) = mean over real support rows; [meta] inner_loss_reduction = sum_per_support:
                 # their sum / inner_support_size (the step grows with the task's support rows)
    task loss  = L(Q_i; p_K, r_K)                       # mean over the task's real query rows
               [+ w * L(S_i; p, r)]                     # [meta] support_loss_weight w > 0: the base on the support
                 # [meta] offset_steps > 0: L(Q_i) on logits + b_h(S_i; p_K, r_K), a per-head Newton
                 # offset fitted on the adapted support logits (models/meta_offset.py)
    outer loss = mean over real tasks of the task loss
    outputs    : d outer / d p  (dense grads),  d outer / d r  (row grads -> PS)

``first_order=True`` stops the gradient through the inner gradients (FOMAML:
row grads reach only rows the query touched); ``False`` differentiates through
them (support rows get outer gradients too; memory grows with ``inner_steps``).

Layout under ``torch.func.vmap`` (``vectorize=True``)::

    params p   [..]        in_dims None  (shared)
    task rows  [T, K, D]   in_dims 0     r[l2g]: each task's own rows (K << U), see _localize
    support    [T, S, ..]  in_dims 0
    query      [T, Q, ..]  in_dims 0
    -> task losses [T] -> masked mean -> torch.func.grad w.r.t. (p, r)

With ``[meta] meta_emb`` (:mod:`models.meta_emb`) the rows of each task's unseen ids
of the ``meta_emb_tables`` are replaced by the learner's generated rows before the
inner loop (training, adapted evaluation and a bundle's adaptation alike).

With ``[meta] learn_inner_lr`` (Meta-SGD, :mod:`models.meta_learner`) ``inner_lr``
is a learned positive rate per adapted tensor (or element) and the outer
gradient reaches the rates too: pass a :class:`MetaLearner` where a
:class:`MetaConfig` goes; its gradients come back in ``dense_grads`` under
``meta_learner.*`` names.

Divergence: with ``diagnostics`` a meta step compares each task's support loss after the inner steps
with the one before (``inner_diverged`` in its metrics: the share of tasks where it rose or went
non-finite) and feeds the learner's :class:`~models.meta_learner.DivergenceWatch`, which logs one
warning per window of diagnosed steps above its share.

Adaptation without an outer gradient (evaluation, a bundle, the delivery gate) goes through one public
function, :func:`adapt_tasks`: the adapted query probabilities (exactly :func:`adapt_and_predict`'s),
optionally the adapted query and support logits (what ``delivery/adapt_select.py`` shifts by each
recipe's offset), and per task the support loss before / after and whether the inner step diverged.

``vectorize=False`` runs the same task function in a Python loop over tasks: the
reference for tests and the baseline of ``bench.meta_step``.

The model is never mutated: fast weights are passed with
``torch.func.functional_call`` (``load_state_dict`` would cut the graph), and no
graph outlives a call. The lookup index (``searchsorted`` + checks) is built once
per batch outside the vmapped function.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Callable

import dataclasses

import torch
from torch import Tensor
from torch.func import functional_call, grad_and_value, vmap
from torch.utils._pytree import tree_map

from meta_io.batch import FeatureBatch, MetaBatch, PlainBatch
from common.errors import ConfigError
from models.base import CtrModel
from models.embedding import GroupedIndex, LookupIndex, MetaGroupedIndex, TableIndex
from models.features import GroupedLookup
from models.fast_grad import install as _install_fast_grad
from models.losses import loss
from models.meta_config import AdaptTarget, InnerLr, InnerReduction, MetaConfig  # noqa: F401  (re-exported; [meta] lives torch-free)
from models.meta_learner import PREFIX as LEARNER_PREFIX
from models.meta_learner import MetaLearner
from models.meta_offset import fit_offsets, shift

InnerLoop = MetaConfig | MetaLearner
"""What the step functions take: the ``[meta]`` settings, or a learner carrying them and its rates."""

_install_fast_grad()  # torch.func.grad without importing torch._dynamo (see models/fast_grad.py)

Params = dict[str, Tensor]
Rows = dict[str, Tensor]


@dataclass
class MetaStepResult:
    """Outcome of one meta step.

    Args:
        outer_loss: scalar, mean over real tasks of the query loss after adaptation, plus
            ``support_loss_weight`` x the base model's unadapted support loss (detached).
        dense_grads: ``model.named_parameters()`` name -> outer gradient.
        row_grads: table -> ``[U_t, dim_t]`` outer gradient of the gathered rows (push to the PS).
        metrics: ``support_loss_before``, ``support_loss_after``, ``query_loss`` (the query loss
            alone, whatever ``support_loss_weight``), ``tasks``, ``inner_diverged`` (the share of real
            tasks whose inner steps raised their support loss or left it non-finite; 0 without an inner
            step), and ``query_loss/<head>`` per head (they sum to ``query_loss``). ``support_loss_after``
            and ``inner_diverged`` only with ``diagnostics``.
    """

    outer_loss: Tensor
    dense_grads: dict[str, Tensor]
    row_grads: dict[str, Tensor]
    metrics: dict[str, float] = field(default_factory=dict)
    group_grads: list[Tensor] | None = None
    """A grouped plain step (:func:`plain_step_grouped`): per storage group, ``[N_g, D_g]`` gradients
    of its pulled rows (``row_grads`` is then empty)."""


# -- pytree plumbing: vmap maps over dicts of tensors, not over dataclasses ----
def _tree(fb: FeatureBatch, ids: bool = True) -> dict[str, Any]:
    """``fb`` as a pytree; ``ids=False`` leaves the id columns out (a grouped step pools from its
    precomputed positions: vmap then wraps a few tensors per task, not every column)."""
    return {
        "ids": fb.ids if ids else {},
        "dense": fb.dense,
        "vectors": fb.vectors,
        "labels": fb.labels,
        "mask": fb.mask,
        "scenario": fb.scenario,
        "oracle": fb.oracle,
    }


def _slice(tree: Any, i: int) -> Any:
    return tree_map(lambda t: t[i], tree)


def _dense_params(model: CtrModel) -> Params:
    return {n: p.detach() for n, p in model.named_parameters()}


def _detached_rows(rows: Rows) -> Rows:
    return {t: r.detach() for t, r in rows.items()}


def _forward(
    model: CtrModel, params: Params, rows: Rows, fb: FeatureBatch, index: LookupIndex, probabilities: bool = False
) -> dict[str, Tensor]:
    """The model with substituted dense params and rows (never mutates the module)."""
    return functional_call(model, params, (fb, rows), {"index": index, "probabilities": probabilities})


def _batch_loss(model: CtrModel, params: Params, rows: Rows, fb: FeatureBatch, index: LookupIndex) -> Tensor:
    return loss(_forward(model, params, rows, fb, index), fb, model.heads)[0]


def _learner(loop: InnerLoop, model: CtrModel) -> MetaLearner:
    return loop if isinstance(loop, MetaLearner) else MetaLearner(model, loop)


def _adapt(
    model: CtrModel, params: Params, rows: Rows, support: FeatureBatch, index: LookupIndex, cfg: MetaConfig,
    rates: dict[str, dict[str, Any]] | None = None, live_before: bool = False, measure_after: bool = True,
) -> tuple[Params, Rows, Tensor, Tensor]:
    """Inner loop on one task's support: ``(fast params, fast rows, loss before, loss after)``.

    A pure function of its inputs, so it runs the same under ``vmap`` and in a loop.
    ``rates`` (:meth:`MetaLearner.rates`) holds each adapted tensor's rate; None: ``cfg.inner_lr``.
    ``live_before``: return the loss before adaptation still differentiable w.r.t. ``params``
    and ``rows`` (the unadapted support loss of ``[meta] support_loss_weight``); else detached.
    ``measure_after``: compute the loss after adaptation (a metric: one more support forward);
    False returns the loss before in its place.
    """
    fast = {
        "dense": dict(params) if cfg.adapts_dense else {},
        "rows": dict(rows) if cfg.adapts_rows else {},
    }
    fixed = {"dense": float(cfg.inner_lr), "rows": cfg.rows_lr}  # [meta] inner_lr / inner_lr_rows
    lr: dict[str, dict[str, Any]] = {
        part: {k: (fixed[part] if rates is None else rates[part][k]) for k in fast[part]} for part in fast
    }
    clip = float(cfg.inner_clip)

    def support_loss(fast: dict[str, dict[str, Tensor]]) -> Tensor:
        return _batch_loss(model, {**params, **fast["dense"]}, {**rows, **fast["rows"]}, support, index)

    step = _inner_objective(support_loss, support, cfg)
    before = None
    for _ in range(cfg.inner_steps):
        g, value = step(fast)
        if before is None:
            before = value if live_before else value.detach()
        if cfg.first_order:
            g = tree_map(torch.Tensor.detach, g)
        fast = tree_map(_sgd, fast, g, lr) if clip <= 0 else _clipped_step(fast, g, lr, clip)
    if before is not None and not measure_after:
        return {**params, **fast["dense"]}, {**rows, **fast["rows"]}, before, before.detach()
    with torch.no_grad():  # a metric only: no graph
        after = support_loss(fast)
    if before is None:
        before = support_loss(fast) if live_before else after
    return {**params, **fast["dense"]}, {**rows, **fast["rows"]}, before, after


def _clipped_step(fast: dict[str, dict[str, Tensor]], g: dict[str, dict[str, Tensor]],
                  lr: dict[str, dict[str, Any]], clip: float) -> dict[str, dict[str, Tensor]]:
    """``[meta] inner_clip``: per group (``dense``, ``rows``), the update ``u = rate * g`` scaled to L2 norm
    ``clip`` when longer: ``x - u * min(1, clip / ||u||)``, the norm over every tensor of the group.

    The scale is ``rsqrt(max(||u||^2 / clip^2, 1))``: no square root of 0 (a zero update's second-order
    gradient stays finite) and a constant 1 (gradient 0) below the clip.
    """
    out: dict[str, dict[str, Tensor]] = {}
    for part, xs in fast.items():
        u = {k: g[part][k] * lr[part][k] for k in xs}
        if not u:
            out[part] = {}
            continue
        sq = torch.stack([(v * v).sum() for v in u.values()]).sum()
        scale = torch.rsqrt(torch.clamp(sq / (clip * clip), min=1.0))
        out[part] = {k: xs[k] - scale * u[k] for k in xs}
    return out


def _diverged(before: Tensor, after: Tensor) -> Tensor:
    """Bool: the inner loop raised the support loss (beyond float noise) or left it non-finite."""
    return ~torch.isfinite(after) | ((after - before) > 1e-6 * before.abs().clamp_min(1.0))


def _sgd(p: Tensor, g: Tensor, rate: Any) -> Tensor:
    """One inner SGD step of one tensor: a fixed rate is one fused ``add`` (``p + (-rate) g``), a learned one
    (a tensor) a multiply and a subtract."""
    if isinstance(rate, Tensor):
        return p - rate * g
    return torch.add(p, g, alpha=-float(rate))


def _offsets(
    model: CtrModel, params: Params, rows: Rows, support: FeatureBatch, index: LookupIndex, cfg: MetaConfig
) -> dict[str, Tensor]:
    """``[meta] offset_steps``: head -> the task's Newton logit offset on its support (empty when off).

    ``params`` / ``rows`` are the adapted (fast) weights; under ``first_order`` the support logits
    are detached, so the offset is a constant of the outer gradient (as the inner gradients are).
    """
    if cfg.offset_steps <= 0:
        return {}
    z = _forward(model, params, rows, support, index)
    if cfg.first_order:
        z = {h: v.detach() for h, v in z.items()}
    return fit_offsets(z, support, model.heads, cfg.offset_steps, cfg.offset_prior)


def _query_logits(
    model: CtrModel, params: Params, rows: Rows, support: FeatureBatch, sidx: LookupIndex, query: FeatureBatch,
    qidx: LookupIndex, cfg: MetaConfig,
) -> dict[str, Tensor]:
    """Head -> the adapted query logits plus the task's ``[meta] offset_steps`` offset (none when off)."""
    return shift(_forward(model, params, rows, query, qidx), _offsets(model, params, rows, support, sidx, cfg))


def _inner_objective(
    support_loss: Callable[[dict[str, dict[str, Tensor]]], Tensor], support: FeatureBatch, cfg: MetaConfig
) -> Callable[[dict[str, dict[str, Tensor]]], tuple[dict[str, dict[str, Tensor]], Tensor]]:
    """``fast -> (inner gradient, mean support loss)`` under ``[meta] inner_loss_reduction``.

    ``mean``: the gradient of the mean support loss (the published recipe, unchanged code path).
    ``sum_per_support``: the gradient of ``mean x n / S`` = the sum over the task's ``n`` real support
    rows divided by ``inner_support_size`` S (``n`` is a tensor: it varies per task under vmap).
    The returned loss value is the mean in both cases (metrics and ``support_loss_weight`` use it).

    Args:
        support_loss: fast weights -> the task's mean support loss.
        support: the task's support rows (``mask`` marks the real ones).
        cfg: the inner loop settings.
    """
    if cfg.inner_loss_reduction is InnerReduction.MEAN:
        return grad_and_value(support_loss)
    scale = support.mask.sum().to(torch.float32) / float(cfg.inner_support_size)

    def scaled(fast: dict[str, dict[str, Tensor]]) -> tuple[Tensor, Tensor]:
        mean = support_loss(fast)
        return mean * scale, mean

    grad_fn = grad_and_value(scaled, has_aux=True)

    def run(fast: dict[str, dict[str, Tensor]]) -> tuple[dict[str, dict[str, Tensor]], Tensor]:
        g, (_, mean) = grad_fn(fast)
        return g, mean

    return run


def _check_support_size(cfg: MetaConfig, support: FeatureBatch) -> None:
    """Training: a batch's support slots must not exceed ``inner_support_size`` under ``sum_per_support``."""
    if cfg.inner_loss_reduction is InnerReduction.SUM_PER_SUPPORT and support.mask.shape[1] > cfg.inner_support_size:
        raise ConfigError(
            f"[meta] inner_support_size = {cfg.inner_support_size} but a training batch has "
            f"{support.mask.shape[1]} support slots per task: set it to the Meta-IO layout's support size"
        )


def _task_weights(batch_task_mask: Tensor, query: FeatureBatch) -> Tensor:
    """1.0 for real tasks with at least one real query row, else 0.0: ``[T]``."""
    has_rows = query.mask.flatten(1).any(-1)
    return (batch_task_mask.bool() & has_rows).to(torch.float32)


def _over_tasks(fn: Callable[..., Any], cfg: MetaConfig, n_tasks: int, shared: tuple, per_task: tuple) -> Any:
    """``fn(*shared, *per_task[i])`` for every task, stacked: vmap or a Python loop."""
    if cfg.vectorize:
        in_dims = (None,) * len(shared) + (0,) * len(per_task)
        return vmap(fn, in_dims=in_dims, randomness="different")(*shared, *per_task)
    outs = [fn(*shared, *(_slice(x, i) for x in per_task)) for i in range(n_tasks)]
    return tree_map(lambda *xs: torch.stack(xs), *outs)


def _localize(
    sup_idx: LookupIndex, qry_idx: LookupIndex, n_rows: dict[str, int]
) -> tuple[dict[str, Tensor], LookupIndex, LookupIndex]:
    """Re-index every task onto its own rows: ``(l2g, support index, query index)``.

    Each task only touches a few of the meta batch's ``U_t`` rows, so the inner
    loop adapts a per-task ``[K_t, D]`` slice instead of a ``[U_t, D]`` copy
    (which would cost ``T * U_t * D`` per table, quadratic in T)::

        global pos [T, N] (support and query ids) --per-task unique--> local pos [T, N]
        l2g[t]  int64 [T, K_t]   local slot -> row of rows[t]  (K_t = most distinct ids of a task)
        task_rows = rows[t][l2g[t]]   [T, K_t, D]   gathered once, outside vmap

    Eager, vectorized over tasks (a per-task sort), once per batch.
    """
    l2g: dict[str, Tensor] = {}
    sup_local: LookupIndex = {}
    qry_local: LookupIndex = {}
    for t, (ps, ws) in sup_idx.items():
        pq, wq = qry_idx[t]
        n_tasks, u = ps.shape[0], n_rows[t]
        if u == 0:  # nothing to gather: pool() yields zeros for an empty table
            l2g[t] = torch.zeros(n_tasks, 0, dtype=torch.long)
            sup_local[t], qry_local[t] = sup_idx[t], qry_idx[t]
            continue
        pos = torch.cat([ps.reshape(n_tasks, -1), pq.reshape(n_tasks, -1)], dim=1)  # [T, N]
        valid = torch.cat([ws.reshape(n_tasks, -1) != 0, wq.reshape(n_tasks, -1) != 0], dim=1)
        pos = torch.where(valid, pos, u)  # padding sorts last, into its own slot (weight 0)
        sorted_pos, order = pos.sort(dim=1)
        new = torch.ones_like(sorted_pos, dtype=torch.bool)
        new[:, 1:] = sorted_pos[:, 1:] != sorted_pos[:, :-1]
        slot_sorted = new.long().cumsum(1) - 1
        local = torch.empty_like(slot_sorted).scatter_(1, order, slot_sorted)
        k = int(slot_sorted[:, -1].max()) + 1
        l2g[t] = torch.zeros(n_tasks, k, dtype=torch.long).scatter_(1, slot_sorted, sorted_pos).clamp_max(u - 1)
        n_sup = ps[0].numel()
        sup_local[t] = TableIndex(local[:, :n_sup].reshape(ps.shape), ws)
        qry_local[t] = TableIndex(local[:, n_sup:].reshape(pq.shape), wq)
    return l2g, sup_local, qry_local


def _task_rows(rows: Rows, l2g: dict[str, Tensor]) -> Rows:
    """``[T, K_t, D]`` per-task rows; differentiable back to the shared ``[U_t, D]``."""
    return {t: rows[t][l2g[t]] for t in l2g}


def _task_cold(learner: MetaLearner, rows: Rows, unique_ids: dict[str, Tensor], l2g: dict[str, Tensor]) -> Rows:
    """MetaEmb: table -> bool ``[T, K_t]``, which of each task's row slots hold an unseen id (empty: off)."""
    return {t: m[l2g[t]] for t, m in learner.unseen(rows, unique_ids).items()}


def grouped_meta_ok(cfg: InnerLoop) -> bool:
    """Whether a meta step with these settings can run on rows per storage group (:func:`meta_step`'s
    ``grouped``): not with MetaEmb (it generates rows per table) nor learned inner rates (a rate per table)."""
    c = cfg.cfg if isinstance(cfg, MetaLearner) else cfg
    return not c.meta_emb and c.learn_inner_lr == InnerLr.OFF


def meta_step(model: CtrModel, batch: MetaBatch, rows: Rows, cfg: InnerLoop, *,
              grouped: MetaGroupedIndex | None = None, diagnostics: bool = True) -> MetaStepResult:
    """One meta step: inner adaptation per task, outer gradients of the mean query loss.

    Args:
        model: any :class:`~models.base.CtrModel` (not mutated; its ``.grad``s untouched).
        batch: T tasks, support ``[T, S, ..]`` and query ``[T, Q, ..]``.
        rows: table -> ``[U_t, dim_t]`` rows of ``batch.unique_ids[t]``; with ``grouped``, group key ->
            the group's pulled rows ``[N_g, D_g]`` (``grouped.keys``).
        cfg: the inner loop: a :class:`MetaConfig`, or a :class:`MetaLearner` (learned rates).
        grouped: the batch's :class:`~models.embedding.MetaGroupedIndex` (built ahead, checked): each
            task then pools its own rows group by group (:func:`grouped_meta_ok` settings only), and
            ``row_grads`` is keyed like ``rows``.
        diagnostics: compute ``support_loss_after`` (one more support forward per task) and
            ``inner_diverged``, and count the diverged tasks in the learner's
            :class:`~models.meta_learner.DivergenceWatch` (which warns per window); False leaves both out of
            the metrics (a worker asks for them on its logged steps only).

    Returns:
        :class:`MetaStepResult`; ``row_grads`` is what the worker pushes to the PS,
        ``dense_grads`` what it applies or syncs (:func:`assign_grads` helps); with a
        learner that learns its rates, also ``meta_learner.<name>`` -> the rates' gradients.

    Example::

        res = meta_step(model, meta_batch, rows, MetaConfig(inner_steps=1, inner_lr=0.1))
        ps.push(res.row_grads); assign_grads(model, res.dense_grads); opt.step()
    """
    learner = _learner(cfg, model)
    cfg = learner.cfg
    _check_support_size(cfg, batch.support)
    sup_idx: Any
    qry_idx: Any
    if grouped is not None:
        if not grouped_meta_ok(learner):
            raise ConfigError("a grouped meta step needs [meta] meta_emb = false and learn_inner_lr = 'off'")
        l2g, sup_idx, qry_idx = grouped.l2g, grouped.support, grouped.query
    else:
        sup_idx = model.lookup_index(batch.support, batch.unique_ids, rows)
        qry_idx = model.lookup_index(batch.query, batch.unique_ids, rows)
        l2g, sup_idx, qry_idx = _localize(sup_idx, qry_idx, {t: r.shape[0] for t, r in rows.items()})
    weights = _task_weights(batch.task_mask, batch.query)
    n_tasks = int(batch.task_mask.shape[0])

    cold = _task_cold(learner, rows, batch.unique_ids, l2g)
    alpha = float(cfg.meta_emb_cold_weight) if learner.meta_emb else 0.0
    w_sup = float(cfg.support_loss_weight)
    # the unadapted support loss is _adapt's first inner value when adaptation starts from the pulled rows
    reuse_before = w_sup > 0 and not learner.meta_emb

    def task(params: Params, mparams: Params, rows: Rows, cold: Rows, sup: dict, sidx: LookupIndex, qry: dict,
             qidx: LookupIndex):
        rates = learner.rates(mparams) if learner.learned else None
        sfb, qfb = FeatureBatch(**sup), FeatureBatch(**qry)
        start = learner.cold_rows(mparams, rows, cold, sfb, sidx, straight_through=True) if learner.meta_emb else rows
        fp, fr, before, after = _adapt(model, params, start, sfb, sidx, cfg, rates, live_before=reuse_before,
                                       measure_after=diagnostics)
        q, q_heads = loss(_query_logits(model, fp, fr, sfb, sidx, qfb, qidx, cfg), qfb, model.heads)
        if alpha > 0:  # MetaEmb's simulated cold start: every id of the meta_emb tables starts generated
            every = {t: torch.ones_like(c) for t, c in cold.items()}
            start = learner.cold_rows(mparams, rows, every, sfb, sidx, straight_through=False)
            fp, fr, _, _ = _adapt(model, params, start, sfb, sidx, cfg, rates)
            z = _query_logits(model, fp, fr, sfb, sidx, qfb, qidx, cfg)
            q = (1.0 - alpha) * q + alpha * loss(z, qfb, model.heads)[0]
        objective = q
        if w_sup > 0:  # the base (unadapted, pulled rows) also learns from the support rows
            s = before if reuse_before else _batch_loss(model, params, rows, sfb, sidx)
            objective = q + w_sup * s
            before = before.detach()
        # per-head figures are the query loss's heads (before MetaEmb's cold-start blend, if any)
        return objective, q.detach(), torch.stack(list(q_heads.values())).detach(), before, after

    def outer(params: Params, rows: Rows, mparams: Params):
        with_ids = grouped is None
        per_task = (_task_rows(rows, l2g), cold, _tree(batch.support, with_ids), sup_idx, _tree(batch.query, with_ids),
                    qry_idx)
        q, q_only, q_heads, before, after = _over_tasks(task, cfg, n_tasks, (params, mparams), per_task)
        n = weights.sum().clamp_min(1.0)
        total = (q * weights).sum() / n
        heads = (q_heads * weights[:, None]).sum(0) / n  # [H]: each head's share of the query loss
        diverged = _diverged(before.detach(), after) if step_checked else torch.zeros_like(weights, dtype=torch.bool)
        stats = torch.cat([torch.stack([(q_only * weights).sum() / n, (before * weights).sum() / n,
                                        (after * weights).sum() / n, weights.sum(), (diverged * weights).sum()]),
                           heads])
        return total, stats.detach()

    step_checked = diagnostics and cfg.inner_steps > 0  # a support loss after the step to compare with
    total, stats, dense_grads, row_grads = _grads(outer, model, rows, learner)
    q, before, after, tasks, n_diverged, *per_head = stats.tolist()
    metrics = {"query_loss": q, "support_loss_before": before, "support_loss_after": after, "tasks": tasks,
               "inner_diverged": n_diverged / tasks if tasks > 0 else 0.0}
    if step_checked:
        learner.divergence.observe(n_diverged, tasks)
    if not diagnostics:
        del metrics["support_loss_after"], metrics["inner_diverged"]
    metrics.update({f"query_loss/{h.name}": v for h, v in zip(model.heads, per_head)})
    return MetaStepResult(outer_loss=total, dense_grads=dense_grads, row_grads=row_grads, metrics=metrics)


def plain_step(
    model: CtrModel, batch: PlainBatch, rows: Rows, metrics: dict[str, float] | None = None
) -> tuple[Tensor, dict[str, Tensor], dict[str, Tensor]]:
    """Ordinary supervised step over the same forward: ``(loss, dense_grads, row_grads)``.

    Args:
        model: the model (not mutated).
        batch: B rows.
        rows: table -> ``[U_t, dim_t]`` rows of ``batch.unique_ids[t]``.
        metrics: when given, receives ``loss/<head>``, each head's loss (they sum to the loss).

    Example::

        loss, dense_grads, row_grads = plain_step(model, plain_batch, rows)
    """
    index = model.lookup_index(batch.features, batch.unique_ids, rows)

    def objective(params: Params, rows: Rows, _unused: Params):
        total, per_head = loss(_forward(model, params, rows, batch.features, index), batch.features, model.heads)
        return total, torch.stack(list(per_head.values())).detach()

    total, heads, dense_grads, row_grads = _grads(objective, model, rows)
    if metrics is not None:
        metrics.update({f"loss/{h.name}": v for h, v in zip(model.heads, heads.tolist())})
    return total, dense_grads, row_grads


def plain_step_grouped(
    model: CtrModel, features: FeatureBatch, rows: list[Tensor], index: GroupedIndex, lookup: GroupedLookup,
    metrics: dict[str, float] | None = None,
) -> tuple[Tensor, dict[str, Tensor], list[Tensor]]:
    """:func:`plain_step` with rows pulled per storage group: one ``embedding_bag`` and one row
    gradient per group, plain autograd (no functional transforms: nothing here is vmapped).

    Args:
        model: the model (not mutated; its ``.grad``s untouched).
        features: the batch's rows (leading shape ``L``).
        rows: per group, its pulled ``[N_g, D_g]`` rows (``index.ids[g]`` order).
        index: the batch's grouped index (``lookup.index``, built and checked ahead).
        lookup: the model's :class:`~models.features.GroupedLookup`.
        metrics: when given, receives ``loss/<head>``.

    Returns:
        ``(loss, dense_grads, group_grads)``: ``group_grads[g]`` is ``[N_g, D_g]``, what the worker pushes.
    """
    leaves = [r.detach().requires_grad_() for r in rows]
    named = list(model.named_parameters())
    out = model.outputs(model.encoder.encode_grouped(features, leaves, index, lookup), False)
    total, per_head = loss(out, features, model.heads)
    wrt = [p for _, p in named] + leaves
    got = torch.autograd.grad(total, wrt, allow_unused=True)
    grads = [torch.zeros_like(w) if g is None else g for g, w in zip(got, wrt)]  # unused: 0, as _grads gives
    n = len(named)
    if metrics is not None:
        heads = torch.stack([v.detach() for v in per_head.values()]).tolist()
        metrics.update({f"loss/{h.name}": v for h, v in zip(model.heads, heads)})
    return total.detach(), {name: g for (name, _), g in zip(named, grads[:n])}, list(grads[n:])


def _grads(
    objective: Callable[[Params, Rows, Params], tuple[Tensor, Tensor]],
    model: CtrModel,
    rows: Rows,
    learner: MetaLearner | None = None,
):
    """The one gradient-extraction path of plain and meta steps.

    Returns ``(value, aux, dense_grads, row_grads)`` of ``objective(params, rows, learner params)``;
    the learner's gradients join ``dense_grads`` under ``meta_learner.<name>``.
    """
    mparams = learner.meta_params() if learner is not None else {}
    (g_params, g_rows, g_meta), (value, aux) = grad_and_value(objective, argnums=(0, 1, 2), has_aux=True)(
        _dense_params(model), _detached_rows(rows), mparams
    )
    g_params.update({LEARNER_PREFIX + n: g for n, g in g_meta.items()})
    return value.detach(), aux, g_params, g_rows


@dataclass
class AdaptedTasks:
    """What :func:`adapt_tasks` returns for ``T`` tasks (detached; ``{}`` for what was not asked).

    Args:
        probs: head -> ``[T, Q]`` adapted query probabilities, exactly :func:`adapt_and_predict`'s (with
            ``[meta] offset_steps > 0``: ``sigmoid(adapted logit + the task's offset)``).
        query_logits: head -> ``[T, Q]`` adapted query logits, no offset (an offset recipe's input).
        support_logits: head -> ``[T, S]`` adapted support logits (an offset recipe fits on them).
        support_loss_before: ``[T]`` the mean support loss before the inner steps (the base's).
        support_loss_after: ``[T]`` after them (``before`` itself without an inner step or ``measure``).
        diverged: bool ``[T]``: the inner steps raised the support loss or left it non-finite (a task
            without an inner step or without real support rows: False).
        real: bool ``[T]``: tasks with at least one real support row.
    """

    probs: dict[str, Tensor]
    query_logits: dict[str, Tensor]
    support_logits: dict[str, Tensor]
    support_loss_before: Tensor
    support_loss_after: Tensor
    diverged: Tensor
    real: Tensor

    @property
    def diverged_share(self) -> float:
        """Diverged tasks over real tasks (0.0 without real tasks)."""
        n = int(self.real.sum())
        return float((self.diverged & self.real).sum()) / n if n else 0.0


class _ProbsAndLogits(torch.nn.Module):
    """``(probabilities, logits)`` of a :class:`~models.base.CtrModel` from one encoding of the features
    (what ``forward(probabilities=True)`` and ``forward()`` return). A module, so ``functional_call``
    substitutes the adapted parameters (named ``m.<name>``)."""

    def __init__(self, model: CtrModel) -> None:
        super().__init__()
        self.m = model

    def forward(self, features: FeatureBatch, rows: Rows, index: Any) -> tuple[dict[str, Tensor], dict[str, Tensor]]:
        enc = self.m.encoder(features, rows, index)
        return self.m.outputs(enc, True), self.m.outputs(enc, False)


def _one_encoding(model: CtrModel) -> bool:
    """Whether probabilities and logits may share one encoding: ``CtrModel.forward`` not overridden."""
    return isinstance(model, CtrModel) and type(model).forward is CtrModel.forward


def adapt_tasks(
    model: CtrModel,
    support: FeatureBatch,
    query: FeatureBatch,
    rows: Rows,
    unique_ids: dict[str, Tensor],
    cfg: InnerLoop,
    *,
    probs: bool = True,
    logits: bool = False,
    index: tuple[LookupIndex, LookupIndex] | None = None,
    measure: bool = True,
) -> AdaptedTasks:
    """Adapt on each task's support set and return its query predictions, logits and divergence check.

    The one public adaptation path: :func:`adapt_and_predict` is its ``probs``; a gate scoring several
    recipes that share an inner loop (``delivery/adapt_select.py``) asks for the logits too and shifts them
    by each recipe's offset itself.

    Args:
        model: the model (not mutated).
        support: ``[T, S, ..]``.
        query: ``[T, Q, ..]``.
        rows: table -> ``[U_t, dim_t]`` rows of ``unique_ids[t]`` (ids of support and query).
        unique_ids: table -> sorted ids.
        cfg: the inner loop, a :class:`MetaConfig` or a :class:`MetaLearner` (learned rates); run first
            order (no outer gradient here).
        probs: return the adapted query probabilities (``AdaptedTasks.probs``).
        logits: return the adapted query and support logits (no offset).
        index: ``(support, query)`` indices from ``model.lookup_index`` when the caller has them (else built).
        measure: compute the support loss after adaptation and ``diverged`` (one support forward per
            task, shared with the offset's and ``logits``' support logits when those are asked anyway).

    Example::

        out = adapt_tasks(model, mb.support, mb.query, rows, mb.unique_ids, cfg, logits=True)
        out.probs["click"], out.diverged_share
    """
    if index is None:
        index = (model.lookup_index(support, unique_ids, rows), model.lookup_index(query, unique_ids, rows))
    l2g, sup_idx, qry_idx = _localize(index[0], index[1], {t: r.shape[0] for t, r in rows.items()})
    learner = _learner(cfg, model)
    first = dataclasses.replace(learner.cfg, first_order=True)
    rates = learner.rates(learner.meta_params()) if learner.learned else None
    cold = _task_cold(learner, rows, unique_ids, l2g)
    mparams = learner.meta_params()
    offset = first.offset_steps > 0
    need_zs = logits or measure or (probs and offset)
    need_zq = logits or (probs and offset)
    plain_p = probs and not offset
    both = _ProbsAndLogits(model) if plain_p and need_zq and _one_encoding(model) else None

    def task(params: Params, rows: Rows, cold: Rows, sup: dict, sidx: LookupIndex, qry: dict, qidx: LookupIndex):
        sfb, qfb = FeatureBatch(**sup), FeatureBatch(**qry)
        if learner.meta_emb:
            rows = learner.cold_rows(mparams, rows, cold, sfb, sidx, straight_through=False)
        fp, fr, before, _ = _adapt(model, params, rows, sfb, sidx, first, rates, measure_after=False)
        out: dict[str, Any] = {"before": before}
        if both is not None:  # the query rows encoded once for the probabilities and the logits
            out["p"], out["zq"] = functional_call(both, {f"m.{k}": v for k, v in fp.items()}, (qfb, fr, qidx))
        else:
            if plain_p:
                out["p"] = _forward(model, fp, fr, qfb, qidx, probabilities=True)
            if need_zq:
                out["zq"] = _forward(model, fp, fr, qfb, qidx)
        if need_zs:
            out["zs"] = _forward(model, fp, fr, sfb, sidx)
        if probs and offset:  # [meta] offset_steps: sigmoid(the loss's logit + the task's offset)
            b = fit_offsets(out["zs"], sfb, model.heads, first.offset_steps, first.offset_prior)
            out["p"] = {h: torch.sigmoid(z) for h, z in shift(out["zq"], b).items()}
        out["after"] = loss(out["zs"], sfb, model.heads)[0] if measure else before
        return tree_map(torch.Tensor.detach, out)

    out = _over_tasks(
        task, first, int(support.mask.shape[0]), (_dense_params(model),),
        (_task_rows(_detached_rows(rows), l2g), cold, _tree(support), sup_idx, _tree(query), qry_idx),
    )
    real = support.mask.flatten(1).any(-1)
    stepped = measure and first.inner_steps > 0
    diverged = (_diverged(out["before"], out["after"]) & real) if stepped else torch.zeros_like(real)
    return AdaptedTasks(
        probs=out.get("p", {}) if probs else {},
        query_logits=out.get("zq", {}) if logits else {},
        support_logits=out.get("zs", {}) if logits else {},
        support_loss_before=out["before"], support_loss_after=out["after"], diverged=diverged, real=real,
    )


def adapt_and_predict(
    model: CtrModel,
    support: FeatureBatch,
    query: FeatureBatch,
    rows: Rows,
    unique_ids: dict[str, Tensor],
    cfg: InnerLoop,
) -> dict[str, Tensor]:
    """Adapt on each task's support set, predict its query set (held-out evaluation).

    :func:`adapt_tasks`'s ``probs`` without the divergence check (no extra support forward).

    Args:
        model: the model (not mutated).
        support: ``[T, S, ..]``.
        query: ``[T, Q, ..]``.
        rows: table -> ``[U_t, dim_t]`` rows of ``unique_ids[t]`` (ids of support and query).
        unique_ids: table -> sorted ids.
        cfg: the inner loop, a :class:`MetaConfig` or a :class:`MetaLearner` (learned rates);
            ``first_order`` is irrelevant here: no outer gradient.

    Returns:
        head -> probabilities ``[T, Q]`` (detached); with ``[meta] offset_steps > 0``,
        ``sigmoid(adapted logit + the task's Newton offset)`` per head (:mod:`models.meta_offset`).

    Example::

        probs = adapt_and_predict(model, mb.support, mb.query, rows, mb.unique_ids, cfg)
    """
    return adapt_tasks(model, support, query, rows, unique_ids, cfg, measure=False).probs


def assign_grads(model: CtrModel, dense_grads: dict[str, Tensor]) -> None:
    """Set ``p.grad`` of every parameter from ``dense_grads`` (for a torch optimizer).

    Raises:
        KeyError: a parameter has no gradient in ``dense_grads``.
    """
    for name, p in model.named_parameters():
        if name not in dense_grads:
            raise KeyError(f"no gradient for parameter '{name}'")
        p.grad = dense_grads[name].detach().clone()
