"""Wide & deep (``kind = "dnn"``).

::

    flat [*L, in] --+-- wide: Linear(in, H) --------------------+--> logits [*L, H]
                    +-- deep: MLP(hidden) -> Linear(h_last, H) --+

The wide part is linear in the first-order terms. Its weight over an id's
pooled embedding makes the first-order weight of an id ``<w_col, e_id>``, so the
PS needs no extra 1-dim table for it.
"""

from __future__ import annotations

from typing import Sequence

from torch import Tensor, nn

from meta_io.schema import Schema
from models.base import CtrModel
from models.config import ModelConfig
from models.features import EncodedFeatures
from models.layers import MLP
from models.losses import HeadSpec


class WideDeep(CtrModel):
    """Wide linear part + deep MLP, one logit per head.

    Args:
        schema, config, dims, heads: see :class:`~models.base.CtrModel`.

    Example::

        model = WideDeep(schema, ModelConfig(hidden=[64, 32]), dims, heads_for_schema(schema))
    """

    def __init__(self, schema: Schema, config: ModelConfig, dims: dict[str, int], heads: Sequence[HeadSpec]) -> None:
        super().__init__(schema, config, dims, heads)
        d = self.encoder.flat_dim
        self.wide = nn.Linear(d, len(self.heads))
        self.deep = MLP(d, config.hidden, config.dropout)
        self.out = nn.Linear(self.deep.out_dim, len(self.heads))

    def logits(self, enc: EncodedFeatures) -> Tensor:
        x = enc.flat()
        return self.wide(x) + self.out(self.deep(x))
