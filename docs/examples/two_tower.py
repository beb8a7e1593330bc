"""A two-tower model, written against metaps' custom-model contract (a model metaps does not ship).

Name it in a job file placed in this folder (``class_dir`` defaults to the job file's folder)::

    [model]
    kind = "custom"
    class = "two_tower:TwoTower"
    hidden = [32]          # each tower's MLP
    default_dim = 8        # tables not in embedding_dims below

::

    user tower: user-side features (the task key, columns named user*) + dense -> MLP -> [*L, H, d]
    item tower: every other feature (item, scene, lists, title, image)       -> MLP -> [*L, H, d]
    logit_h = <u_h, v_h> / sqrt(d) + b_h          one dot product per head h

The contract (docs/design/models.md, "Your own model"): built as ``TwoTower(spec)`` from a
``models.custom.ModelSpec``; ``forward(features, dense)`` gets feature name -> pooled embedding
``[*L, width]`` and the dense features ``[*L, n_dense]``, and returns head -> logits ``[*L]``.
``L`` is any leading shape; rows are computed independently (no BatchNorm), so the meta inner
loop can ``vmap`` it over tasks.
"""

from __future__ import annotations

import math

import torch
from torch import Tensor, nn


class TwoTower(nn.Module):
    """User tower x item tower, one dot product per head.

    Args:
        spec: a ``models.custom.ModelSpec`` (features and their widths, dense columns, heads, config).
    """

    embedding_dims = {"item": 16}
    """Declared table dims: the PS sizes the ``item`` table from this (the others: ``default_dim``)."""

    def __init__(self, spec) -> None:  # noqa: ANN001 -- a models.custom.ModelSpec; no metaps import needed
        super().__init__()
        self.heads = list(spec.heads)
        self.user_side = [f for f in spec.features if f == spec.task_key or f.startswith("user")]
        self.item_side = [f for f in spec.features if f not in self.user_side]
        if not self.item_side:
            raise ValueError(f"no item-side feature among {list(spec.features)}")
        self.d = 8
        width = spec.config.hidden[-1]
        out = len(self.heads) * self.d
        self.user = _tower(sum(spec.features[f] for f in self.user_side) + len(spec.dense), width, out)
        self.item = _tower(sum(spec.features[f] for f in self.item_side), width, out)
        self.bias = nn.Parameter(torch.zeros(len(self.heads)))

    def forward(self, features: dict[str, Tensor], dense: Tensor) -> dict[str, Tensor]:
        u = self.user(torch.cat([features[f] for f in self.user_side] + [dense], dim=-1))
        v = self.item(torch.cat([features[f] for f in self.item_side], dim=-1))
        lead = u.shape[:-1]
        dots = (u.view(*lead, len(self.heads), self.d) * v.view(*lead, len(self.heads), self.d)).sum(-1)
        logits = dots / math.sqrt(self.d) + self.bias
        return {h: logits[..., i] for i, h in enumerate(self.heads)}


def _tower(n_in: int, width: int, n_out: int) -> nn.Module:
    return nn.Sequential(nn.Linear(n_in, width), nn.ReLU(), nn.Linear(width, n_out))
