"""Optimizer parity: every kind vs torch.optim (per-row params) or the reference formula.

FTRL is checked against McMahan et al. 2013 in tests/ps/test_ftrl_reference.py.

Pushes carry duplicate ids (summed first: "exact" semantics) and untouched rows;
rows and optimizer state must match a dense reference within float tolerance.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ps.config import OptimizerConfig, OptimizerKind, TableConfig
from ps.embedding_table import EmbeddingTable

DIM = 8
IDS = np.array([11, 22, 33, 44, 55], dtype=np.int64)
DEVICES = [
    "cpu",
    pytest.param("cuda", marks=pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")),
]

# fbgemm's CPU backward spins OpenMP threads: on 2 shared cores more than one
# thread made each push ~100x slower here. PS processes run single-threaded too.
torch.set_num_threads(1)


def push_sequence() -> list[tuple[np.ndarray, np.ndarray]]:
    rng = np.random.default_rng(3)
    seq = []
    for ids in ([11, 22, 11, 33], [22, 22, 44], [11, 55, 33, 11, 11], [44, 22]):
        ids = np.array(ids, dtype=np.int64)
        seq.append((ids, rng.normal(size=(len(ids), DIM)).astype(np.float32)))
    return seq


def aggregate(ids: np.ndarray, g: np.ndarray) -> dict[int, np.ndarray]:
    out: dict[int, np.ndarray] = {}
    for i, row in zip(ids.tolist(), g.astype(np.float64)):
        out[i] = out.get(i, 0.0) + row
    return out


def run_table(cfg: OptimizerConfig, device: str) -> tuple[EmbeddingTable, np.ndarray]:
    t = EmbeddingTable(TableConfig(name="t", dim=DIM, capacity=16, optimizer=cfg, init_scale=0.1), seed=1, device=device)
    w0 = t.pull(IDS)
    for ids, g in push_sequence():
        t.push(ids, g)
    return t, w0


def state_of(t: EmbeddingTable) -> dict[str, np.ndarray]:
    rows = t.export_rows(t.lookup_rows(IDS))
    np.testing.assert_array_equal(rows.ids, IDS)
    return rows.state


def torch_reference(cfg: OptimizerConfig, w0: np.ndarray):
    """One torch Parameter + optimizer per row: a row steps only when pushed."""
    params, opts = {}, {}
    for i, id_ in enumerate(IDS.tolist()):
        p = torch.nn.Parameter(torch.tensor(w0[i], dtype=torch.float32))
        if cfg.kind == OptimizerKind.SGD:
            o = torch.optim.SGD([p], lr=cfg.lr, weight_decay=cfg.weight_decay)
        elif cfg.kind == OptimizerKind.ADAGRAD:
            o = torch.optim.Adagrad([p], lr=cfg.lr, eps=cfg.eps, weight_decay=cfg.weight_decay,
                                    initial_accumulator_value=cfg.initial_accumulator)
        else:
            o = torch.optim.Adam([p], lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps,
                                 weight_decay=cfg.weight_decay)
        params[id_], opts[id_] = p, o
    for ids, g in push_sequence():
        for id_, gsum in aggregate(ids, g).items():
            params[id_].grad = torch.tensor(gsum, dtype=torch.float32)
            opts[id_].step()
    w = np.stack([params[i].detach().numpy() for i in IDS.tolist()])
    return w, params, opts


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("kind", [OptimizerKind.SGD, OptimizerKind.ADAGRAD, OptimizerKind.ADAM])
def test_parity_with_torch_optim(kind: OptimizerKind, device: str) -> None:
    cfg = OptimizerConfig(kind=kind, lr=0.05, eps=1e-6, weight_decay=0.01, initial_accumulator=0.1)
    t, w0 = run_table(cfg, device)
    want, params, opts = torch_reference(cfg, w0)
    np.testing.assert_allclose(t.pull(IDS), want, rtol=1e-5, atol=1e-6)
    st = state_of(t)
    if kind == OptimizerKind.ADAGRAD:
        ref = np.stack([opts[i].state[params[i]]["sum"].numpy() for i in IDS.tolist()])
        np.testing.assert_allclose(st["momentum"], ref, rtol=1e-5, atol=1e-6)
    elif kind == OptimizerKind.ADAM:
        for ours, theirs in (("m", "exp_avg"), ("v", "exp_avg_sq")):
            ref = np.stack([opts[i].state[params[i]][theirs].numpy() for i in IDS.tolist()])
            np.testing.assert_allclose(st[ours], ref, rtol=1e-5, atol=1e-7)
        ref_step = np.array([int(opts[i].state[params[i]]["step"]) for i in IDS.tolist()])
        np.testing.assert_array_equal(st["step"], ref_step)
        assert ref_step.tolist() == [2, 3, 2, 2, 1]  # per-row step counts
    else:
        assert st == {}


@pytest.mark.parametrize("device", DEVICES)
def test_rowwise_adagrad_reference_formula(device: str) -> None:
    cfg = OptimizerConfig(kind=OptimizerKind.ROWWISE_ADAGRAD, lr=0.1, eps=1e-8, weight_decay=0.02, initial_accumulator=0.0)
    t, w0 = run_table(cfg, device)
    w = {i: w0[k].astype(np.float64) for k, i in enumerate(IDS.tolist())}
    m = {i: 0.0 for i in IDS.tolist()}
    for ids, g in push_sequence():
        for i, gs in aggregate(ids, g).items():
            gs = gs + cfg.weight_decay * w[i]
            m[i] += float(np.mean(gs * gs))
            w[i] = w[i] - cfg.lr * gs / (np.sqrt(m[i]) + cfg.eps)
    np.testing.assert_allclose(t.pull(IDS), np.stack([w[i] for i in IDS.tolist()]), rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(state_of(t)["momentum"], [m[i] for i in IDS.tolist()], rtol=1e-5)


def test_untouched_rows_do_not_move() -> None:
    cfg = OptimizerConfig(kind=OptimizerKind.ADAM, lr=0.1, weight_decay=0.1)
    t = EmbeddingTable(TableConfig(name="t", dim=DIM, capacity=8, optimizer=cfg), seed=0)
    g = np.ones((2, DIM), np.float32)
    t.push(np.array([1, 2], np.int64), g)
    before = t.pull(np.array([2], np.int64))
    t.push(np.array([1], np.int64), g[:1])
    np.testing.assert_array_equal(t.pull(np.array([2], np.int64)), before)
