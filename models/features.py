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
from dataclasses import dataclass

import torch
from torch import Tensor, nn

from meta_io.batch import FeatureBatch
from meta_io.schema import ID_KINDS, Schema
from metaps.core.errors import DataError
from models.embedding import LookupIndex, TableLayout, pool
from models.layers import signed_log1p

log = logging.getLogger(__name__)


@dataclass
class EncodedFeatures:
    """Encoded inputs of a batch with leading shape ``L``.

    Args:
        pooled: per table (``layouts`` order) ``[*L, C_t, D_t]``.
        vectors: per vector column ``[*L, default_dim]`` (projected).
        dense: ``[*L, n_dense]`` (transformed).
    """

    pooled: list[Tensor]
    vectors: list[Tensor]
    dense: Tensor

    def flat(self) -> Tensor:
        """All features concatenated: ``[*L, in_dim]``."""
        parts = [p.flatten(-2) for p in self.pooled] + self.vectors + [self.dense]
        return torch.cat(parts, dim=-1)


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
        emb = sum(len(lay.columns) * lay.dim for lay in self.layouts)
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
        vectors = [proj(features.vectors[name]) for name, proj in zip(self.vector_columns, self.vector_proj)]
        return EncodedFeatures(pooled=pooled, vectors=vectors, dense=signed_log1p(features.dense))
