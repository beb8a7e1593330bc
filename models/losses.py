"""Masked BCE losses per head, and which label each head is trained on.

Heads and targets (the CTR -> CVR funnel)::

    schema.labels = [click, conversion]
    head 'click'       target = click                 over all impressions (CTR)
    head 'conversion'  target = click * conversion    over all impressions (CTCVR)

Every label after the first is a post-click label, gated by the first. Training
the conversion head on click*conversion over all impressions (instead of on
clicked rows only) avoids the sample-selection bias ESMM was designed against;
for ESMM the head's probability is ``p_ctr * p_cvr`` by construction, for the
other models it is a direct CTCVR estimate.

Padding rows (``features.mask`` False) contribute nothing; a loss is the mean
over real rows, and 0 (not NaN) when there are none.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch
import torch.nn.functional as F
from torch import Tensor

from meta_io.batch import FeatureBatch
from meta_io.schema import Schema
from common.errors import DataError


@dataclass(frozen=True)
class HeadSpec:
    """One output head: its name (= a label), and its training target.

    Args:
        name: head name, equal to the label it predicts.
        label: label column of the target.
        gate: when set, target = labels[label] * labels[gate] (CTCVR).

    Example::

        HeadSpec("conversion", label="conversion", gate="click")
    """

    name: str
    label: str
    gate: str = ""

    def target(self, features: FeatureBatch) -> Tensor:
        for lab in (self.label, self.gate):
            if lab and lab not in features.labels:
                raise DataError(f"head '{self.name}' needs label '{lab}', batch has {sorted(features.labels)}")
        y = features.labels[self.label]
        return y * features.labels[self.gate] if self.gate else y


def heads_for_schema(schema: Schema) -> list[HeadSpec]:
    """One head per label; every label after the first is gated by the first."""
    first = schema.labels[0]
    return [HeadSpec(first, first)] + [HeadSpec(lab, lab, gate=first) for lab in schema.labels[1:]]


def masked_bce(logits: Tensor, target: Tensor, mask: Tensor) -> Tensor:
    """Mean BCE-with-logits over rows where ``mask`` is True (0 when none are)."""
    # where() rather than a multiply: padding rows may carry garbage labels.
    target = torch.where(mask, target, torch.zeros_like(target))
    per_row = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
    per_row = torch.where(mask, per_row, torch.zeros_like(per_row))
    return per_row.sum() / mask.sum().clamp_min(1).to(per_row.dtype)


def loss(
    outputs: dict[str, Tensor],
    features: FeatureBatch,
    heads: Schema | Sequence[HeadSpec],
) -> tuple[Tensor, dict[str, Tensor]]:
    """Total loss (sum over heads) and the loss of each head.

    Args:
        outputs: head -> logits ``[*L]`` (a model's forward).
        features: the batch (labels and mask).
        heads: ``model.heads``, or a schema (heads from :func:`heads_for_schema`).

    Example::

        total, per_head = loss(model(batch.features, rows, batch.unique_ids), batch.features, model.heads)
    """
    specs = heads_for_schema(heads) if isinstance(heads, Schema) else list(heads)
    per_head: dict[str, Tensor] = {}
    for h in specs:
        if h.name not in outputs:
            raise DataError(f"model outputs have no head '{h.name}' (got {sorted(outputs)})")
        per_head[h.name] = masked_bce(outputs[h.name], h.target(features), features.mask)
    total = torch.stack(list(per_head.values())).sum()
    return total, per_head
