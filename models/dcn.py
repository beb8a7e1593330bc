"""DCN-v2 (``kind = "dcnv2"``), parallel structure.

::

    flat [*L, in] --+-- CrossNetV2(cross_layers, cross_rank) --> [*L, in]      --+
                    +-- deep: MLP(hidden) ----------------------> [*L, h_last] --+--> cat --> Linear(., H)

``cross_rank = 0`` is the full-rank cross matrix ``[in, in]`` per layer; a rank
r > 0 uses ``U V^T`` (2 * in * r weights), cheaper with many features.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor, nn

from meta_io.schema import Schema
from models.base import CtrModel
from models.config import ModelConfig
from models.features import EncodedFeatures
from models.layers import MLP, CrossNetV2
from models.losses import HeadSpec


class DCNv2(CtrModel):
    """Cross network v2 + deep MLP in parallel, one logit per head.

    Args:
        schema, config, dims, heads: see :class:`~models.base.CtrModel`.

    Example::

        model = DCNv2(schema, ModelConfig(kind="dcnv2", cross_rank=16), dims, heads_for_schema(schema))
    """

    def __init__(self, schema: Schema, config: ModelConfig, dims: dict[str, int], heads: Sequence[HeadSpec]) -> None:
        super().__init__(schema, config, dims, heads)
        d = self.encoder.flat_dim
        self.cross = CrossNetV2(d, config.cross_layers, config.cross_rank)
        self.deep = MLP(d, config.hidden, config.dropout)
        self.out = nn.Linear(d + self.deep.out_dim, len(self.heads))

    def logits(self, enc: EncodedFeatures) -> Tensor:
        x = enc.flat()
        return self.out(torch.cat([self.cross(x), self.deep(x)], dim=-1))
