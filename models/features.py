"""Turns a :class:`~meta_io.batch.FeatureBatch` plus gathered rows into model inputs.

Every feature becomes part of one flat input vector (and, for FM, a field)::

    id columns (sparse, multi_hot, text; the scenario when it is an id column)
        -> pooled rows, per table [*L, C_t, D_t]          fields
    vector columns (e.g. image)    [*L, dim] -> Linear -> [*L, default_dim]   fields
    dense columns                  [*L, n_dense] -> sign(x)*log1p(|x|)
    flat = cat(pooled..., vectors..., dense)  [*L, in_dim]

The dense transform is fixed (no BatchNorm): it must behave the same on a
16-row support set under ``vmap`` as on a large plain batch.
"""

from __future__ import annotations

import logging
from typing import Sequence

import torch
from torch import Tensor, nn

from meta_io.batch import FeatureBatch
from meta_io.schema import ID_KINDS, Schema
from common.errors import DataError
from models.embedding import (
    GroupedIndex, GroupLayout, LocalIndex, LocalLookup, LookupIndex, MetaGroupedIndex, TableLayout,
    build_grouped_index, build_meta_index, group_layouts, pool, pool_grouped, pooled_permutation,
)
from models.layers import signed_log1p

log = logging.getLogger(__name__)


class EncodedFeatures:
    """Encoded inputs of a batch with leading shape ``L``.

    Args:
        pooled: per table (``layouts`` order) ``[*L, C_t, D_t]``; None when they come as
            ``pooled_flat`` (the grouped lookup: one tensor, split here only when asked).
        vectors: per vector column ``[*L, default_dim]`` (projected).
        dense: ``[*L, n_dense]`` (transformed).
        pooled_flat: ``[*L, sum C_t * D_t]``: every table's pooled columns, layout order.
        shapes: per table ``(C_t, D_t)``; needed with ``pooled_flat``.
    """

    def __init__(self, pooled: list[Tensor] | None, vectors: list[Tensor], dense: Tensor,
                 pooled_flat: Tensor | None = None, shapes: Sequence[tuple[int, int]] = ()) -> None:
        if pooled is None and pooled_flat is None:
            raise ValueError("EncodedFeatures needs pooled or pooled_flat")
        self._pooled = pooled
        self.vectors = vectors
        self.dense = dense
        self.pooled_flat = pooled_flat
        self._shapes = shapes

    @property
    def pooled(self) -> list[Tensor]:
        """Per table ``[*L, C_t, D_t]`` (views of ``pooled_flat`` when the lookup was grouped)."""
        if self._pooled is None:
            assert self.pooled_flat is not None
            lead = self.pooled_flat.shape[:-1]
            parts = torch.split(self.pooled_flat, [c * d for c, d in self._shapes], dim=-1)
            self._pooled = [p.view(*lead, c, d) for p, (c, d) in zip(parts, self._shapes)]
        return self._pooled

    def flat(self) -> Tensor:
        """All features concatenated: ``[*L, in_dim]``."""
        head = [self.pooled_flat] if self.pooled_flat is not None else [p.flatten(-2) for p in self.pooled]
        return torch.cat(head + self.vectors + [self.dense], dim=-1)


class FeatureEncoder(nn.Module):
    """Lookup + pooling of id columns, vector projections, dense transform.

    Args:
        schema: the data schema.
        dims: table -> embedding dim (``ModelConfig.embedding_dims``).
        vector_dim: width each vector column is projected to.

    Example::

        enc = FeatureEncoder(schema, {"item": 16, "user": 16}, vector_dim=16)
        x = enc(features, rows, index).flat()   # [*L, enc.flat_dim]
    """

    def __init__(self, schema: Schema, dims: dict[str, int], vector_dim: int) -> None:
        super().__init__()
        missing = [t for t in schema.tables if t not in dims]
        if missing:
            raise ValueError(f"no embedding dim for tables {missing}")
        self.layouts = [
            TableLayout.from_columns(t, dims[t], [c for c in schema.id_columns if c.table_name == t])
            for t in schema.tables
        ]
        self._shapes = [(len(lay.columns), lay.dim) for lay in self.layouts]
        self.vector_columns = [c.name for c in schema.vector_columns]
        self.vector_dims = [c.dim for c in schema.vector_columns]
        self.vector_proj = nn.ModuleList(nn.Linear(d, vector_dim) for d in self.vector_dims)
        self.dense_columns = [c.name for c in schema.dense_columns]
        self.vector_dim = vector_dim
        if schema.scenario and schema.column(schema.scenario).kind not in ID_KINDS:
            log.warning(
                "scenario column '%s' is not an id column: it is not a model feature "
                "(declare it kind='sparse' to embed it)",
                schema.scenario,
            )

    @property
    def n_fields(self) -> int:
        """Fields for FM: one per id column and one per vector column."""
        return sum(len(lay.columns) for lay in self.layouts) + len(self.vector_columns)

    @property
    def flat_dim(self) -> int:
        emb = sum(c * d for c, d in self._shapes)
        return emb + self.vector_dim * len(self.vector_columns) + len(self.dense_columns)

    def check(self, features: FeatureBatch) -> None:
        """Eager shape checks of the non-id features (errors name the column)."""
        lead = list(features.shape)
        want = lead + [len(self.dense_columns)]
        if list(features.dense.shape) != want:
            raise DataError(f"dense features {self.dense_columns}: expected shape {want}, got {list(features.dense.shape)}")
        for name, dim in zip(self.vector_columns, self.vector_dims):
            if name not in features.vectors:
                raise DataError(f"batch has no vector column '{name}'; got {sorted(features.vectors)}")
            got = list(features.vectors[name].shape)
            if got != lead + [dim]:
                raise DataError(f"vector column '{name}': expected shape {lead + [dim]}, got {got}")

    def forward(self, features: FeatureBatch, rows: dict[str, Tensor], index: LookupIndex) -> EncodedFeatures:
        pooled = [pool(rows[lay.table], index[lay.table]) for lay in self.layouts]
        return EncodedFeatures(pooled, self._vectors(features), signed_log1p(features.dense))

    def _vectors(self, features: FeatureBatch) -> list[Tensor]:
        return [proj(features.vectors[name]) for name, proj in zip(self.vector_columns, self.vector_proj)]

    def encode_local(self, features: FeatureBatch, rows: dict[str, Tensor], index: LocalLookup) -> EncodedFeatures:
        """:meth:`forward` of one task (or any leading shape) on its own rows per storage group.

        Args:
            features: the rows' features (``L`` leading).
            rows: group key -> the task's rows ``[K_g, D_g]``.
            index: the half's :class:`~models.embedding.LocalLookup`.
        """
        lookup = index.lookup
        parts = [pool_local(rows[key], li, g) for key, li, g in zip(lookup.keys, index.parts, lookup.groups)]
        return self._from_groups(features, parts, lookup.perm)

    def encode_grouped(self, features: FeatureBatch, rows: Sequence[Tensor], index: GroupedIndex,
                       lookup: "GroupedLookup") -> EncodedFeatures:
        """:meth:`forward` with the rows pulled per storage group: one ``embedding_bag`` per group.

        Args:
            features: the batch (leading shape ``L``).
            rows: per group, its pulled ``[N_g, D_g]`` rows (``index.ids[g]`` order).
            index: the batch's :class:`~models.embedding.GroupedIndex` (``lookup.index``).
            lookup: the model's :class:`GroupedLookup`.
        """
        parts = [pool_grouped(r, p, index.lead) for r, p in zip(rows, index.pooled)]
        return self._from_groups(features, parts, lookup.perm)

    def _from_groups(self, features: FeatureBatch, parts: list[Tensor], perm: Tensor | None) -> EncodedFeatures:
        """Encoded features from each storage group's pooled ``[*L, C_g * D_g]`` (group order):
        one concatenation, ``perm`` back to layout order."""
        flat = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        if perm is not None:
            flat = flat.index_select(-1, perm)
        return EncodedFeatures(None, self._vectors(features), signed_log1p(features.dense), pooled_flat=flat,
                               shapes=self._shapes)


def pool_local(rows: Tensor, index: LocalIndex, group: GroupLayout) -> Tensor:
    """One group's pooled features ``[*L, C * D]`` from a task's own rows ``[K, D]`` (vmap-safe):
    gather the slots, weight them, sum each column's slots (a view per width class)."""
    lead = index.pos.shape[:-1]
    d = rows.shape[-1]
    if rows.shape[0] == 0:  # no ids of this group in the batch: everything is padding
        return rows.new_zeros((*lead, group.plan.n_cols * d))
    x = torch.nn.functional.embedding(index.pos, rows) * index.weight.unsqueeze(-1)  # [*L, W, D]
    plan = group.plan
    parts = []
    for first, n_cols, width in plan.blocks:
        block = x[..., first : first + n_cols * width, :]
        parts.append(block if width == 1 else block.reshape(*lead, n_cols, width, d).sum(-2))
    cols = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-2)  # [*L, C, D], class order
    if plan.class_perm is not None:
        cols = cols.index_select(-2, plan.class_perm)
    return cols.flatten(-2)


class GroupedLookup:
    """A model's tables arranged as the PS stores them (``ps.grouping``): per batch one pull, one
    pooling and one gradient per storage group instead of per table.

    Args:
        encoder: the model's :class:`FeatureEncoder`.
        groups: table names per storage group, storage order (``ps.grouping.group_tables``).

    Example::

        lookup = GroupedLookup(model.encoder, [g.names for g in group_tables(ps_cfg.table_configs(model.tables))])
        idx = lookup.index(batch.features, batch.unique_ids)        # prefetch thread: checked there
        rows = [pull(ids) for ids in idx.ids]                        # [N_g, D_g] each
        out = model.outputs(model.encoder.encode_grouped(batch.features, rows, idx, lookup), False)
    """

    def __init__(self, encoder: FeatureEncoder, groups: Sequence[Sequence[str]]) -> None:
        self.encoder = encoder
        self.groups: list[GroupLayout] = group_layouts(encoder.layouts, groups)
        self.perm = pooled_permutation(encoder.layouts, self.groups)
        self.keys = [f"g{i}" for i in range(len(self.groups))]
        """Each group's name in a meta step's rows dict (:class:`~models.embedding.MetaGroupedIndex`)."""

    def meta_index(self, support: FeatureBatch, query: FeatureBatch, unique_ids: dict[str, Tensor]) -> MetaGroupedIndex:
        """Check a meta batch and build its grouped per-task pooling (eager; the prefetch thread's work).

        Raises:
            DataError: as :meth:`CtrModel.lookup_index` does.
        """
        self.encoder.check(support)
        self.encoder.check(query)
        return build_meta_index(self, support, query, unique_ids)

    def index(self, features: FeatureBatch, unique_ids: dict[str, Tensor]) -> GroupedIndex:
        """Check ``features`` and build its :class:`~models.embedding.GroupedIndex` (eager, no per-row Python).

        Raises:
            DataError: as :meth:`CtrModel.lookup_index` does.
        """
        self.encoder.check(features)
        return build_grouped_index(self.groups, features, unique_ids)

