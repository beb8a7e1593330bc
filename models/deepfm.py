"""DeepFM (``kind = "deepfm"``).

::

    fields [*L, F, D] -- FM: sum_{i<j} <v_i, v_j> -----------------> [*L]   (shared by heads)
    flat   [*L, in]   -- first order: Linear(in, H) --------------> [*L, H]
    flat   [*L, in]   -- deep: MLP(hidden) -> Linear(h_last, H) ---> [*L, H]
    logits = first + fm + deep

Fields are the pooled id columns and the projected vector columns. FM needs one
width D (= ``default_dim``); tables with another dim get a bias-free projection.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn

from meta_io.schema import Schema
from models.base import CtrModel
from models.config import ModelConfig
from models.features import EncodedFeatures
from models.layers import MLP, fm_interaction
from models.losses import HeadSpec


class DeepFM(CtrModel):
    """FM second-order interactions + first-order linear + deep MLP.

    Args:
        schema, config, dims, heads: see :class:`~models.base.CtrModel`.

    Example::

        model = DeepFM(schema, ModelConfig(kind="deepfm"), dims, heads_for_schema(schema))
    """

    def __init__(self, schema: Schema, config: ModelConfig, dims: dict[str, int], heads: Sequence[HeadSpec]) -> None:
        super().__init__(schema, config, dims, heads)
        d = self.encoder.flat_dim
        self.fm_dim = config.default_dim
        # Only tables whose dim differs from the FM width need a projection.
        self.field_proj = nn.ModuleDict(
            {str(i): nn.Linear(lay.dim, self.fm_dim, bias=False)
             for i, lay in enumerate(self.layouts) if lay.dim != self.fm_dim}
        )
        self.first_order = nn.Linear(d, len(self.heads))
        self.deep = MLP(d, config.hidden, config.dropout)
        self.out = nn.Linear(self.deep.out_dim, len(self.heads))

    def fields(self, enc: EncodedFeatures) -> Tensor:
        """``[*L, F, fm_dim]``: every id column and vector column as an FM field."""
        parts = []
        for i, p in enumerate(enc.pooled):
            proj = self.field_proj[str(i)] if str(i) in self.field_proj else None
            parts.append(proj(p) if proj is not None else p)
        parts += [v.unsqueeze(-2) for v in enc.vectors]
        return torch.cat(parts, dim=-2)

    def logits(self, enc: EncodedFeatures) -> Tensor:
        x = enc.flat()
        fm = fm_interaction(self.fields(enc)).unsqueeze(-1)
        return self.first_order(x) + fm + self.out(self.deep(x))
