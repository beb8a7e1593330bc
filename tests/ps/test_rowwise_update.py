"""ps.rowwise_update: the vectorized rowwise-Adagrad step equals fbgemm's fused TBE backward bit for bit.

The reference is the TBE of a real :class:`ps.embedding_table.EmbeddingTable` (the path
every fused table used before), run on the same weights, momenta, rows and gradients.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ps import rowwise_update
from ps.config import OptimizerConfig, OptimizerKind, TableConfig
from ps.embedding_table import EmbeddingTable

torch.set_num_threads(1)  # fbgemm's CPU backward is slow with OpenMP threads on shared cores


def _table(dim: int, lr: float, eps: float, capacity: int = 3000) -> EmbeddingTable:
    opt = OptimizerConfig(kind=OptimizerKind.ROWWISE_ADAGRAD, lr=lr, eps=eps)
    return EmbeddingTable(TableConfig(name="t", dim=dim, capacity=capacity, optimizer=opt), seed=0)


def _tbe_step(t: EmbeddingTable, rows: torch.Tensor, g: torch.Tensor) -> None:
    offsets = torch.arange(rows.numel() + 1, dtype=torch.int64)
    t.optimizer.tbe(rows, offsets).backward(g)


@pytest.mark.parametrize("dim", [8, 24, 64, 128, 1024])
@pytest.mark.parametrize("lr,eps", [(0.05, 1e-8), (0.7, 1e-3), (1e-3, 0.0)])
def test_same_bits_as_tbe(dim: int, lr: float, eps: float) -> None:
    assert rowwise_update.supported(dim)
    t = _table(dim, lr, eps)
    m = t.optimizer.state_tensors()["momentum"]
    gen = torch.Generator().manual_seed(dim)
    cap = t.capacity
    t.weights.copy_(torch.randn(cap, dim, generator=gen))
    m.copy_(torch.rand(cap, generator=gen) * torch.rand(cap, generator=gen).pow(8) * 10)
    w0, m0 = t.weights.clone(), m.clone()
    rows = torch.randperm(cap, generator=gen)[: cap * 2 // 3]
    # magnitudes over many decades, a zero row, tiny values (the eps-dominated denominators)
    g = torch.randn(rows.numel(), dim, generator=gen) * torch.logspace(-6, 3, rows.numel()).unsqueeze(1)
    g[0] = 0.0
    _tbe_step(t, rows, g)
    w_tbe, m_tbe = t.weights.clone(), m.clone()
    t.weights.copy_(w0)
    m.copy_(m0)
    rowwise_update.rowwise_adagrad_update(t.weights, m, rows, g, lr, eps)
    assert torch.equal(m, m_tbe), f"momentum differs in {int((m != m_tbe).sum())} rows"
    assert torch.equal(t.weights, w_tbe), f"weights differ in {int((t.weights != w_tbe).sum())} values"


def test_table_pushes_take_the_vectorized_path_and_match_tbe() -> None:
    """Whole pushes (duplicates, new ids, clipping, weight decay) give TBE's tables exactly."""
    cfg = TableConfig(
        name="t", dim=16, capacity=500,
        optimizer=OptimizerConfig(kind=OptimizerKind.ROWWISE_ADAGRAD, lr=0.1, weight_decay=0.01),
        grad_clip_norm=5.0,
    )
    fast, ref = EmbeddingTable(cfg, seed=3), EmbeddingTable(cfg, seed=3)
    assert fast.optimizer._vectorized  # type: ignore[attr-defined]
    ref.optimizer._vectorized = False  # type: ignore[attr-defined]  # the TBE backward, as before
    rng = np.random.default_rng(0)
    for _ in range(6):
        ids = rng.integers(0, 300, size=200).astype(np.int64)
        g = (rng.standard_normal((200, 16)) * 3).astype(np.float32)
        assert fast.push(ids, g) == ref.push(ids, g)
    assert torch.equal(fast.weights, ref.weights)
    mom = "momentum"
    assert torch.equal(fast.optimizer.state_tensors()[mom], ref.optimizer.state_tensors()[mom])


def test_dims_off_the_lane_width_keep_tbe() -> None:
    assert not rowwise_update.supported(12) and not rowwise_update.supported(0)
    assert not _table(12, 0.05, 1e-8).optimizer._vectorized  # type: ignore[attr-defined]
