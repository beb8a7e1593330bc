"""FTRL against McMahan et al. 2013, "Ad Click Prediction: a View from the Trenches", Algorithm 1.

The reference below is written from the paper, one coordinate at a time in plain
Python floats (float64), not from ps/optimizers.py. Per coordinate i, for each
round t in which the coordinate receives a gradient::

    w_i = 0                                                   if |z_i| <= l1
        = -(z_i - sgn(z_i) l1) / ((beta + sqrt(n_i)) / alpha + l2)   otherwise
    sigma_i = (sqrt(n_i + g_i^2) - sqrt(n_i)) / alpha
    z_i <- z_i + g_i - sigma_i w_i
    n_i <- n_i + g_i^2

with z_i = 0 and n_i = 0 at the start (the paper's state; ``initial_accumulator``
generalises n's start and is 0 here). A push is one round: duplicate ids in a
push are one feature whose gradients add up.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from ps.config import InitKind, OptimizerConfig, OptimizerKind, PsConfig, TableConfig, TableDefaults
from ps.embedding_table import EmbeddingTable

torch.set_num_threads(1)

DIM = 4
ALPHA, BETA, L2 = 0.1, 1.0, 0.05
PUSHED = [11, 22, 33, 44]
NEVER = np.array([5, 66, 777], dtype=np.int64)


def pushes() -> list[tuple[list[int], list[list[float]]]]:
    """Several pushes with duplicate ids; gradients are small round-ish numbers."""
    rng = np.random.default_rng(7)
    out = []
    for ids in ([11, 22, 11, 33], [22, 22, 44], [11, 33, 11, 11, 44], [44, 22], [11, 11]):
        g = (rng.normal(size=(len(ids), DIM)) * 0.7).astype(np.float32)
        out.append((ids, g.tolist()))
    return out


class PaperFtrl:
    """Algorithm 1, per coordinate (dicts of floats, no vector ops)."""

    def __init__(self, l1: float) -> None:
        self.l1 = l1
        self.z: dict[tuple[int, int], float] = {}
        self.n: dict[tuple[int, int], float] = {}

    def weight(self, key: tuple[int, int]) -> float:
        z = self.z.get(key, 0.0)
        n = self.n.get(key, 0.0)
        if abs(z) <= self.l1:
            return 0.0
        sgn = 1.0 if z > 0 else -1.0
        return -(z - sgn * self.l1) / ((BETA + math.sqrt(n)) / ALPHA + L2)

    def round(self, ids: list[int], grads: list[list[float]]) -> None:
        summed: dict[int, list[float]] = {}
        for id_, row in zip(ids, grads):
            acc = summed.setdefault(id_, [0.0] * DIM)
            for i in range(DIM):
                acc[i] += row[i]
        for id_, row in summed.items():
            for i in range(DIM):
                key = (id_, i)
                w = self.weight(key)  # w_{t,i}, from the state before this round
                g = row[i]
                n = self.n.get(key, 0.0)
                sigma = (math.sqrt(n + g * g) - math.sqrt(n)) / ALPHA
                self.z[key] = self.z.get(key, 0.0) + g - sigma * w
                self.n[key] = n + g * g


def ftrl_table(l1: float) -> EmbeddingTable:
    opt = OptimizerConfig(kind=OptimizerKind.FTRL, ftrl_alpha=ALPHA, ftrl_beta=BETA, ftrl_l1=l1, ftrl_l2=L2)
    return EmbeddingTable(TableConfig(name="t", dim=DIM, capacity=16, optimizer=opt, init=InitKind.ZEROS), seed=3)


@pytest.mark.parametrize("l1", [0.0, 0.4])
def test_ftrl_matches_mcmahan_algorithm_1(l1: float) -> None:
    t = ftrl_table(l1)
    ref = PaperFtrl(l1)
    for ids, g in pushes():
        t.push(np.array(ids, dtype=np.int64), np.array(g, dtype=np.float32))
        ref.round(ids, g)
        got = t.pull(np.array(PUSHED, dtype=np.int64))
        want = np.array([[ref.weight((id_, i)) for i in range(DIM)] for id_ in PUSHED])
        np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)
        # a coordinate the paper puts at 0 reads exactly +0.0
        zero = want == 0.0
        assert (got[zero] == 0.0).all() and not np.signbit(got[zero]).any()
    rows = t.export_rows(t.lookup_rows(np.array(PUSHED, dtype=np.int64)))
    np.testing.assert_allclose(rows.state["z"], [[ref.z[(i, j)] for j in range(DIM)] for i in PUSHED], rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(rows.state["n"], [[ref.n[(i, j)] for j in range(DIM)] for i in PUSHED], rtol=1e-5, atol=1e-6)
    if l1:
        assert (want == 0.0).sum() >= 3, "the L1 case must zero some coordinates"
        assert (want != 0.0).sum() >= 3, "and leave others non-zero"
    # never-pushed ids read exactly zero, before and after other ids are pushed
    never = t.pull(NEVER)
    assert never.shape == (3, DIM) and (never == 0.0).all() and not np.signbit(never).any()


def test_ftrl_weight_is_derived_from_state_not_stored() -> None:
    """Rows imported with weights that disagree with (z, n) serve w(z, n), and updates start from it."""
    t = ftrl_table(0.0)
    ref = PaperFtrl(0.0)
    seq = pushes()
    for ids, g in seq[:2]:
        t.push(np.array(ids, dtype=np.int64), np.array(g, dtype=np.float32))
        ref.round(ids, g)
    rows = t.export_rows(t.lookup_rows(np.array(PUSHED, dtype=np.int64)))
    rows.weights = np.full_like(rows.weights, 0.123)  # e.g. a TF-style checkpoint whose w was a variable
    fresh = ftrl_table(0.0)
    fresh.import_rows(rows)
    want = np.array([[ref.weight((id_, i)) for i in range(DIM)] for id_ in PUSHED])
    np.testing.assert_allclose(fresh.pull(np.array(PUSHED, dtype=np.int64)), want, rtol=1e-5, atol=1e-6)
    for ids, g in seq[2:]:
        fresh.push(np.array(ids, dtype=np.int64), np.array(g, dtype=np.float32))
        ref.round(ids, g)
    want = np.array([[ref.weight((id_, i)) for i in range(DIM)] for id_ in PUSHED])
    np.testing.assert_allclose(fresh.pull(np.array(PUSHED, dtype=np.int64)), want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("init, scale", [(InitKind.NORMAL, 0.01), (InitKind.UNIFORM, 0.1)])
def test_ftrl_table_with_random_init_is_refused(init: InitKind, scale: float) -> None:
    opt = OptimizerConfig(kind=OptimizerKind.FTRL)
    with pytest.raises(ValueError, match=r"table 'user': optimizer kind 'ftrl' .* needs init = \"zeros\", got init = \""
                       + init.value):
        TableConfig(name="user", dim=8, optimizer=opt, init=init, init_scale=scale).validate()
    # through the [ps] section: the default init is normal, so the table must say zeros
    cfg = PsConfig(table_defaults=TableDefaults(optimizer=opt))
    with pytest.raises(ValueError, match=r"table 'user': optimizer kind 'ftrl'"):
        cfg.table_configs(["user"])
    ok = PsConfig(table_defaults=TableDefaults(optimizer=opt, init=InitKind.ZEROS)).table_configs(["user"])
    assert ok[0].init == InitKind.ZEROS
    TableConfig(name="user", dim=8, optimizer=opt, init=init, init_scale=0.0).validate()  # scale 0 = zeros
