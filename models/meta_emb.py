"""MetaEmb (Pan et al. 2019): generated initial rows for ids the PS has never trained.

``[meta] meta_emb = true`` with ``meta_emb_tables = ["user"]``: during adaptation
(training meta steps, adapted evaluation, a bundle's ``adapt``), the row of an
*unseen* id of such a table is replaced by a generated row before the inner loop
starts, so a cold id starts from what its features suggest instead of noise.

**The unseen rule** (one rule, training, evaluation and serving): an id is unseen
when the row read for it equals the PS's deterministic initial row of that id
(:class:`ps.initializer.RowInitializer`, per (table, id, seed)), up to
``|row - init| <= ATOL + RTOL * |init|`` (float16 wire/storage rounding). A PS
row moves away from its init on the first push that touches it, so the rule is
decided by the data, with tensor ops over the batch's unique ids
(:func:`unseen_mask`), never per row in Python. A bundle's unseen id reads the
same init row (``delivery/adapt.py``), so the same ids count as unseen there.

**The generator** per table ``t``: a linear map, zero-initialised (so it starts by
generating zero rows), of the mean over the id's *support* rows of the row's other
features::

    x_row  = [pooled rows of every other table (flattened), signed_log1p(dense)
              (, each head's label: ``[meta] meta_emb_labels``)]                   detached
    x_id   = mean of x_row over the support rows holding the id       (slots: one-hot matmul)
    gen_id = W_t x_id + b_t                                           [dim_t]

Its parameters live in the :class:`~models.meta_learner.MetaLearner` (dense values
``meta_learner.meta_emb_w.<i>`` / ``meta_emb_b.<i>``, tables sorted), so they are
synchronised, checkpointed and shipped in the bundle's ``adapt_params.npz`` like the
learned inner rates, and meta-trained by the outer loop: the query loss after the
inner steps from the generated row is differentiated back to ``W_t, b_t``.

In a training meta step the substituted row keeps the PS row's gradient
(straight-through: value ``gen``, gradient also to the pulled row), so a training id
is trained on the PS as before and stops being unseen after its first push.
``meta_emb_cold_weight`` adds MetaEmb's simulated cold start: the task's loss is
also computed with every id of the table treated as unseen.

The base (unadapted) score never uses the generator: it needs the task's support
rows, so it is part of adaptation.
"""

from __future__ import annotations

from typing import Callable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from meta_io.batch import FeatureBatch
from models.embedding import LookupIndex, TableLayout, pool
from models.features import signed_log1p

RTOL = 1e-3
"""Relative tolerance of the unseen rule (float16 rounding of an init row is 2^-11 relative)."""
ATOL = 1e-7
"""Absolute tolerance of the unseen rule."""

InitRows = Callable[[np.ndarray], np.ndarray]
"""ids int64 [n] -> the PS's initial rows float32 [n, dim] (a RowInitializer)."""


def input_dim(layouts: Sequence[TableLayout], n_dense: int, table: str, n_labels: int = 0) -> int:
    """Width of the generator's input for ``table``: the other tables' pooled widths, the dense
    count, and the labels fed (``[meta] meta_emb_labels``)."""
    return sum(len(lay.columns) * lay.dim for lay in layouts if lay.table != table) + n_dense + n_labels


@torch.no_grad()
def unseen_mask(rows: Tensor, ids: Tensor, init: InitRows) -> Tensor:
    """bool ``[U]``: which of ``ids`` read their initial row (never trained).

    Args:
        rows: ``[U, D]`` rows as pulled (PS) or read (bundle).
        ids: int64 ``[U]`` their ids.
        init: the table's initial-row function.
    """
    if ids.shape[0] == 0:
        return torch.zeros(0, dtype=torch.bool)
    ref = torch.from_numpy(np.ascontiguousarray(init(ids.numpy()), dtype=np.float32))
    r = rows.detach().to(torch.float32)
    return ((r - ref).abs() <= ATOL + RTOL * ref.abs()).all(dim=-1)


def generate(
    weight: Tensor, bias: Tensor, layouts: Sequence[TableLayout], table: str,
    rows: Mapping[str, Tensor], support: FeatureBatch, sidx: LookupIndex, labels: Sequence[str] = (),
) -> Tensor:
    """Generated rows ``[K, dim]`` for every row slot of ``table`` from one task's support.

    A pure tensor function (runs under ``vmap``): a slot no support row holds gets ``bias``.

    Args:
        weight: ``[dim, input_dim]``.
        bias: ``[dim]``.
        layouts: the model's table layouts (``model.layouts``).
        table: the generated table.
        rows: table -> ``[K_t, D_t]`` the task's rows.
        support: the task's support rows ``[S, ..]``.
        sidx: their lookup index into ``rows``.
        labels: heads whose support labels join the input (``[meta] meta_emb_labels``), in order.
    """
    parts = [pool(rows[lay.table], sidx[lay.table]).flatten(-2) for lay in layouts if lay.table != table]
    parts.append(signed_log1p(support.dense))
    parts += [support.labels[h].to(support.dense.dtype)[..., None] for h in labels]
    x = torch.cat(parts, dim=-1).detach()  # [S, F]: features only, no gradient into other rows
    tix = sidx[table]
    k = rows[table].shape[0]
    real = (tix.weight != 0) & support.mask.bool()[..., None, None]  # [S, C, M]
    onehot = (tix.pos[..., None] == torch.arange(k)) & real[..., None]  # [S, C, M, K]
    a = onehot.to(x.dtype).sum(dim=(-3, -2))  # [S, K]: times each support row holds each slot
    mean_x = (a.transpose(-1, -2) @ x) / a.sum(dim=-2).clamp_min(1.0)[..., None]  # [K, F]
    return mean_x @ weight.transpose(-1, -2) + bias


def substitute(rows: Tensor, gen: Tensor, cold: Tensor, straight_through: bool) -> Tensor:
    """``rows`` with the ``cold`` slots replaced by ``gen`` (``[K, D]``, ``[K, D]``, bool ``[K]``).

    Args:
        straight_through: keep the gradient to the replaced rows too (training: the PS row
            is still trained); False: replaced rows get no gradient (simulated cold start).
    """
    new = gen + (rows - rows.detach()) if straight_through else gen
    return torch.where(cold[..., None], new, rows)
