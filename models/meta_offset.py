"""A per-task logit offset per head, fitted by Newton on the task's support rows (``[meta] offset_steps``).

After the gradient inner steps, each task fits one scalar ``b_h`` per head ``h`` on its real
support rows (mask ``m``, labels ``y`` = the head's training target, adapted logits ``z``)::

    minimize  sum_i m_i * BCE(y_i, sigmoid(z_i + b)) + lambda / 2 * b^2       lambda = [meta] offset_prior
    b_0 = 0;  per iteration (offset_steps of them):
        p = sigmoid(z + b)
        g = sum_i m_i (p_i - y_i) + lambda b
        H = sum_i m_i p_i (1 - p_i) + lambda                                   (>= lambda > 0)
        b = b - g / H

then adds ``b_h`` to head ``h``'s logit on the task's query rows. The objective is convex with
curvature >= lambda, so each iteration is a damped Newton step (the prior keeps H away from 0 and
shrinks ``b`` towards 0 on little evidence); one iteration from 0 is the Laplace/ridge estimate
``b = sum m (y - p) / (sum m p (1 - p) + lambda)``. Padding rows (``m = 0``) change nothing, a task
without real support rows gets ``b = 0``.

The logit is the one the loss sees (``CtrModel.forward`` without ``probabilities``): for ESMM's
conversion head that is ``logit(p_ctcvr)``, so the offset is fitted on, and added to, the CTCVR
logit the model is trained on (BCE of ``p_ctcvr``), and the adapted CTCVR probability is
``sigmoid(logit(p_ctcvr) + b)``: no longer exactly ``p_ctr * p_cvr`` for an adapted task.

Everything is tensor ops over the task's rows (``torch.where`` masks, sums): no per-row Python,
and the function runs unchanged under ``vmap`` (one task) and in a loop. Whether the offset is
differentiated (second order) or detached (first order) is the caller's choice of ``logits``.
"""

from __future__ import annotations

from typing import Sequence

import torch
from torch import Tensor

from meta_io.batch import FeatureBatch
from models.losses import HeadSpec


def fit_offsets(
    logits: dict[str, Tensor], support: FeatureBatch, heads: Sequence[HeadSpec], steps: int, prior: float
) -> dict[str, Tensor]:
    """Head -> scalar offset ``b_h`` fitted by ``steps`` damped Newton iterations (module docstring).

    Args:
        logits: head -> the task's (adapted) support logits ``[S]`` (any leading shape matching the mask).
        support: the task's support rows: labels and ``mask`` (True = a real row).
        heads: the model's heads (their targets: click, click * conversion, ...).
        steps: Newton iterations (>= 1).
        prior: lambda > 0, the prior precision of ``b``.

    Returns:
        head -> 0-d tensor in the logits' dtype.
    """
    mask = support.mask.bool()
    out: dict[str, Tensor] = {}
    for h in heads:
        z = logits[h.name]
        m = mask.to(z.dtype)
        y = torch.where(mask, h.target(support).to(z.dtype), torch.zeros_like(z))  # padding: garbage labels
        z = torch.where(mask, z, torch.zeros_like(z))  # padding: garbage logits (no NaN * 0)
        b = z.new_zeros(())
        for _ in range(steps):
            p = torch.sigmoid(z + b)
            g = (m * (p - y)).sum() + prior * b
            hess = (m * p * (1.0 - p)).sum() + prior
            b = b - g / hess
        out[h.name] = b
    return out


def shift(outputs: dict[str, Tensor], offsets: dict[str, Tensor]) -> dict[str, Tensor]:
    """Head -> logits + that head's offset (heads without an offset unchanged)."""
    return {h: (z + offsets[h] if h in offsets else z) for h, z in outputs.items()}
