"""Rowwise Adagrad on CPU as a few vectorized torch ops, bit-identical to fbgemm's fused backward.

The fused kinds used to update through TBE: a forward pass with one row per bag,
then ``out.backward(grads)`` (autograd, the codegen backward, then fbgemm's JIT
rowwise-Adagrad kernel). For a push of 16K rows of dim 64 that was ~11 ms of
thread CPU time, of which the update itself is a fraction. This module computes
the same update directly::

    m_new = m + sum(g^2) / D          (momentum, one float per row)
    w_new = w - (lr / (sqrt(m_new) + eps)) * g

with elementwise ops on the [k, D] gradient block and one ``index_add_`` each into
the weights and the momenta (rows are unique: the caller sums duplicate ids first).

**Same bits as fbgemm.** Float addition is not associative, so "the same formula"
is not enough: the sum of squares is reduced in the order fbgemm's AVX2 kernel
uses (8 float lanes accumulated block by block over D, then the 8 lanes added
pairwise: (l0+l1), (l2+l3), ... as ``hadd`` does), the mean is a division by D,
the root is correctly rounded (taken in float64: torch's float32 ``sqrt`` is
not), and the weight step is a separate multiply and subtract (no FMA). The equality
with TBE is checked bit for bit by tests/ps/test_rowwise_update.py for every
dimension this path takes (:func:`supported`); other dimensions keep TBE.

Example::

    rowwise_adagrad_update(weights, momentum, rows, grads, lr=0.05, eps=1e-8)
"""

from __future__ import annotations

import torch

__all__ = ["LANES", "supported", "rowwise_adagrad_update"]

LANES = 8
"""float32 lanes of one AVX2 register: fbgemm's accumulation width."""

_MAX_DIM = 1024
"""Largest dimension checked bit for bit against TBE (larger ones keep TBE)."""


def supported(dim: int) -> bool:
    """Whether :func:`rowwise_adagrad_update` reproduces fbgemm's bits at ``dim``.

    Args:
        dim: the table's row dimension.
    """
    return 0 < dim <= _MAX_DIM and dim % LANES == 0


def _sum_squares(g: torch.Tensor) -> torch.Tensor:
    """Per-row sum of squares of ``g`` [k, D] in fbgemm's order (see the module docstring)."""
    sq = g * g
    acc = sq[:, :LANES].clone()
    for lo in range(LANES, g.shape[1], LANES):  # D / 8 tensor ops (not per row)
        acc += sq[:, lo : lo + LANES]
    while acc.shape[1] > 1:
        acc = acc[:, 0::2] + acc[:, 1::2]
    return acc[:, 0]


def rowwise_adagrad_update(
    weights: torch.Tensor, momentum: torch.Tensor, rows: torch.Tensor, grads: torch.Tensor, lr: float, eps: float
) -> None:
    """Apply one rowwise-Adagrad step to ``rows`` in place.

    Args:
        weights: float32 [C, D] table weights (CPU).
        momentum: float32 [C] per-row sum of mean squared gradients.
        rows: int64 [k] unique rows to update.
        grads: float32 [k, D] their gradients (summed over duplicate ids, decayed, clipped).
        lr: learning rate.
        eps: added to the root in the denominator.
    """
    if rows.numel() == 0:
        return
    g = grads.to(torch.float32).contiguous()
    # index_add_ reads and writes each touched row in one pass (the row is in cache for its write);
    # an index_select + index_copy_ pair costs two random passes (~2x here). w + (-(g*s)) is
    # bit-equal to w - g*s (negation is exact), and m + mean is the same single addition.
    momentum.index_add_(0, rows, _sum_squares(g) / float(g.shape[1]))
    m = momentum.index_select(0, rows)
    # torch's float32 sqrt is not correctly rounded here (SLEEF, ~0.5 ulp); fbgemm's vsqrtps is:
    # the float64 root rounded to float32 is the correctly rounded float32 root
    root = m.double().sqrt_().float()
    step = torch.tensor(lr, dtype=torch.float32) / (root + torch.tensor(eps, dtype=torch.float32))
    weights.index_add_(0, rows, g * step.neg_().unsqueeze(1))
