"""``CtrModel``: the base class of every model in the zoo.

A model owns only dense parameters. Embedding rows come in with the batch::

    outputs = model(features, rows, unique_ids)      # head -> logits [*L]
    probs   = model.predict(features, rows, unique_ids)

``L`` is any leading shape: ``[B]`` for a plain batch, ``[T, S]`` for the
support half of a meta batch. The forward is differentiable w.r.t. ``rows``
(the row gradients are what the worker pushes to the PS) and is a pure tensor
function once the lookup index is built, so ``torch.func`` can call it with
substituted parameters and rows (:mod:`models.meta`).
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn

from meta_io.batch import FeatureBatch
from meta_io.schema import Schema
from common.errors import DataError
from models.config import ModelConfig
from models.embedding import LocalLookup, LookupIndex, TableLayout, build_index
from models.features import EncodedFeatures, FeatureEncoder
from models.losses import HeadSpec


class CtrModel(nn.Module):
    """Base of the zoo: feature encoding, lookup checks, heads.

    Subclasses implement :meth:`logits` (``[*L, H]``, one column per head) or,
    when heads are not independent logits (ESMM), :meth:`outputs`.

    Args:
        schema: the data schema.
        config: the model config.
        dims: table -> embedding dim.
        heads: the output heads, in order.

    Example::

        model = build_model(schema, ModelConfig(kind="deepfm"))
        out = model(batch.features, rows, batch.unique_ids)   # {"click": [B], "conversion": [B]}
    """

    def __init__(self, schema: Schema, config: ModelConfig, dims: dict[str, int], heads: Sequence[HeadSpec]) -> None:
        super().__init__()
        self.schema = schema
        self.config = config
        self.dims = dict(dims)
        self.heads = list(heads)
        self.encoder = FeatureEncoder(schema, self.dims, vector_dim=config.default_dim)

    @property
    def layouts(self) -> list[TableLayout]:
        return self.encoder.layouts

    @property
    def tables(self) -> list[str]:
        """Tables whose rows :meth:`forward` needs."""
        return [lay.table for lay in self.layouts]

    def lookup_index(
        self, features: FeatureBatch, unique_ids: dict[str, Tensor], rows: dict[str, Tensor] | None = None
    ) -> LookupIndex:
        """Check the batch (and rows) and map ids to row positions (eager; not under vmap).

        Raises:
            DataError: naming the table/column, expected vs got.
        """
        self.encoder.check(features)
        return build_index(self.layouts, features, unique_ids, rows)

    def forward(
        self,
        features: FeatureBatch,
        rows: dict[str, Tensor],
        unique_ids: dict[str, Tensor] | None = None,
        *,
        index: LookupIndex | LocalLookup | None = None,
        probabilities: bool = False,
    ) -> dict[str, Tensor]:
        """Head -> logits ``[*L]`` (or probabilities).

        Args:
            features: batch with leading shape ``L``.
            rows: table -> ``[U_t, dim_t]`` rows of ``unique_ids[t]``.
            unique_ids: table -> sorted ids ``[U_t]``; needed unless ``index`` is given.
            index: a precomputed :meth:`lookup_index` (skips the checks; used by meta), or a
                :class:`~models.embedding.LocalLookup` (a meta task's rows per storage group: ``rows``
                is then group key -> the task's rows).
            probabilities: return probabilities instead of logits.
        """
        if isinstance(index, LocalLookup):  # a meta task's rows per storage group (models.meta, grouped)
            return self.outputs(self.encoder.encode_local(features, rows, index), probabilities)
        if index is None:
            if unique_ids is None:
                raise DataError("forward needs unique_ids (or a precomputed index)")
            index = self.lookup_index(features, unique_ids, rows)
        return self.outputs(self.encoder(features, rows, index), probabilities)

    @torch.no_grad()
    def predict(self, features: FeatureBatch, rows: dict[str, Tensor], unique_ids: dict[str, Tensor]) -> dict[str, Tensor]:
        """Head -> probability ``[*L]`` (ESMM: click = p_ctr, conversion = p_ctcvr)."""
        return self.forward(features, rows, unique_ids, probabilities=True)

    # -- subclass hooks ------------------------------------------------------
    def logits(self, enc: EncodedFeatures) -> Tensor:
        """``[*L, H]`` logits, column i for ``self.heads[i]``."""
        raise NotImplementedError

    def outputs(self, enc: EncodedFeatures, probabilities: bool) -> dict[str, Tensor]:
        z = self.logits(enc)
        if probabilities:
            z = torch.sigmoid(z)
        return {h.name: z[..., i] for i, h in enumerate(self.heads)}
