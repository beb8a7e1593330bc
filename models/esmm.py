"""ESMM (``kind = "esmm"``): CTR and CVR towers over shared embeddings.

::

    flat [*L, in] -> bottom (shared | MMoE) -> [*L, 2, h] -> 2 towers (BatchedMLP) -> [*L, 2]
                                                               ctr logit a, cvr logit b
    p_ctr   = sigmoid(a)                          head 'click'       (target: click)
    p_ctcvr = sigmoid(a) * sigmoid(b)             head 'conversion'  (target: click * conversion)

Both heads are trained over all impressions, so the CVR tower is learned without
sample-selection bias. The 'conversion' logit returned by :meth:`forward` is
``logit(p_ctcvr)``, computed in log space::

    log p     = logsigmoid(a) + logsigmoid(b)
    log (1-p) = log1mexp(log p)
    logit     = log p - log(1-p)

so BCE-with-logits on it is the BCE of ``p_ctcvr``. ``log p`` is clamped at
-1e-7 (p <= 1 - 1e-7) to keep ``log(1-p)`` finite.
"""

from __future__ import annotations

import math
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from meta_io.schema import Schema
from models.base import CtrModel
from models.config import BottomKind, ModelConfig
from models.features import EncodedFeatures
from models.layers import BatchedLinear, BatchedMLP
from models.losses import HeadSpec
from models.mmoe import MMoE, SharedBottom

_LN2 = math.log(2.0)


def log1mexp(x: Tensor) -> Tensor:
    """``log(1 - exp(x))`` for ``x < 0``, stable at both ends (NaN-free gradients)."""
    near0 = x > -_LN2
    # Feed each branch only inputs it is safe on, so the unused branch has finite grads.
    a = torch.log(-torch.expm1(torch.where(near0, x, torch.full_like(x, -1.0))))
    b = torch.log1p(-torch.exp(torch.where(near0, torch.full_like(x, -1.0), x)))
    return torch.where(near0, a, b)


class ESMM(CtrModel):
    """Entire-space multi-task model with a shared or MMoE bottom.

    Args:
        schema, config, dims: see :class:`~models.base.CtrModel`.
        heads: exactly two: the click head, then the conversion head gated by click.

    Example::

        model = build_model(schema, ModelConfig(kind="esmm", bottom="mmoe"))
        p = model.predict(features, rows, unique_ids)   # {"click": p_ctr, "conversion": p_ctcvr}
    """

    def __init__(self, schema: Schema, config: ModelConfig, dims: dict[str, int], heads: Sequence[HeadSpec]) -> None:
        super().__init__(schema, config, dims, heads)
        if len(self.heads) != 2:
            raise ValueError(f"ESMM needs exactly 2 labels (click, conversion), schema has {schema.labels}")
        d = self.encoder.flat_dim
        self.bottom: MMoE | SharedBottom
        if config.bottom == BottomKind.MMOE:
            self.bottom = MMoE(d, 2, config.n_experts, config.expert_hidden, config.dropout)
        else:
            self.bottom = SharedBottom(d, 2, config.expert_hidden, config.dropout)
        self.towers = BatchedMLP(2, self.bottom.out_dim, config.hidden, config.dropout)
        self.tower_out = BatchedLinear(2, self.towers.out_dim, 1)

    def tower_logits(self, enc: EncodedFeatures) -> tuple[Tensor, Tensor]:
        """``(ctr_logit, cvr_logit)``, each ``[*L]``."""
        h = self.towers(self.bottom(enc.flat()), shared_input=False)  # [*L, 2, h]
        z = self.tower_out(h, shared_input=False).squeeze(-1)  # [*L, 2]
        return z[..., 0], z[..., 1]

    def outputs(self, enc: EncodedFeatures, probabilities: bool) -> dict[str, Tensor]:
        a, b = self.tower_logits(enc)
        click, conversion = self.heads[0].name, self.heads[1].name
        if probabilities:
            return {click: torch.sigmoid(a), conversion: torch.sigmoid(a) * torch.sigmoid(b)}
        log_p = (F.logsigmoid(a) + F.logsigmoid(b)).clamp(max=-1e-7)
        return {click: a, conversion: log_p - log1mexp(log_p)}
