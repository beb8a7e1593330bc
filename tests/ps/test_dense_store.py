"""DenseStore: register/pull/push/set/state, parity with torch.optim, bad input."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ps.config import OptimizerConfig, OptimizerKind
from ps.dense_store import DenseStore
from ps.errors import BadRequest

# fbgemm's CPU backward spins OpenMP threads: on 2 shared cores more than one
# thread made each push ~100x slower here. PS processes run single-threaded too.
torch.set_num_threads(1)


@pytest.mark.parametrize("kind", [OptimizerKind.ADAM, OptimizerKind.ADAMW, OptimizerKind.ADAGRAD, OptimizerKind.SGD])
def test_push_matches_torch_optim(kind: OptimizerKind) -> None:
    cfg = OptimizerConfig(kind=kind, lr=0.01, weight_decay=0.01)
    d = DenseStore(cfg)
    w0 = np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4)
    d.register("w", w0)
    d.register("b", (4,))
    p = torch.nn.Parameter(torch.tensor(w0))
    ref = {OptimizerKind.ADAM: lambda: torch.optim.Adam([p], lr=0.01, eps=cfg.eps, weight_decay=0.01),
           OptimizerKind.ADAMW: lambda: torch.optim.AdamW([p], lr=0.01, eps=cfg.eps, weight_decay=0.01),
           OptimizerKind.ADAGRAD: lambda: torch.optim.Adagrad([p], lr=0.01, eps=cfg.eps, weight_decay=0.01),
           OptimizerKind.SGD: lambda: torch.optim.SGD([p], lr=0.01, weight_decay=0.01)}[kind]()
    rng = np.random.default_rng(0)
    for _ in range(3):
        g = rng.normal(size=(3, 4)).astype(np.float32)
        d.push({"w": g})
        p.grad = torch.tensor(g)
        ref.step()
    np.testing.assert_allclose(d.pull(["w"])["w"], p.detach().numpy(), rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(d.pull(["b"])["b"], np.zeros(4, np.float32))  # never pushed


def test_register_idempotent_and_mismatch() -> None:
    d = DenseStore()
    assert d.register("w", (2, 3)) is True
    d.set({"w": np.ones((2, 3), np.float32)})
    assert d.register("w", (2, 3)) is False
    assert d.pull(["w"])["w"].sum() == 6  # stored value wins
    with pytest.raises(BadRequest, match=r"dense 'w': already registered with shape \(2, 3\), got \(3, 2\)"):
        d.register("w", (3, 2))
    with pytest.raises(BadRequest, match="must be float32, got float64"):
        d.register("x", np.ones(3))


def test_bad_push_changes_nothing() -> None:
    d = DenseStore()
    d.register("a", (2,))
    d.register("b", (2,))
    before = d.state()
    with pytest.raises(BadRequest, match=r"unknown dense parameter\(s\) \['zz'\]"):
        d.push({"a": np.ones(2, np.float32), "zz": np.ones(2, np.float32)})
    with pytest.raises(BadRequest, match=r"dense 'b': gradient shape \(3,\), expected \(2,\)"):
        d.push({"a": np.ones(2, np.float32), "b": np.ones(3, np.float32)})
    with pytest.raises(BadRequest, match=r"dense 'b': gradient holds NaN/Inf"):
        d.push({"a": np.ones(2, np.float32), "b": np.array([1, np.nan], np.float32)})
    after = d.state()
    assert before.keys() == after.keys()
    for k in before:
        assert before[k].keys() == after[k].keys()
        for sk in before[k]:
            np.testing.assert_array_equal(before[k][sk], after[k][sk])


def test_state_round_trip_continues_identically() -> None:
    a = DenseStore(OptimizerConfig(kind=OptimizerKind.ADAM, lr=0.1))
    a.register("w", np.arange(4, dtype=np.float32))
    a.push({"w": np.ones(4, np.float32)})
    b = DenseStore(OptimizerConfig(kind=OptimizerKind.ADAM, lr=0.1))
    b.load_state(a.state())
    g = np.array([1, -1, 2, 0], np.float32)
    a.push({"w": g})
    b.push({"w": g})
    np.testing.assert_array_equal(a.pull()["w"], b.pull()["w"])


def test_rejects_sparse_only_optimizer() -> None:
    with pytest.raises(ValueError, match="dense optimizer must be one of"):
        DenseStore(OptimizerConfig(kind=OptimizerKind.FTRL))


@pytest.mark.parametrize("kind", [OptimizerKind.ADAM, OptimizerKind.ADAMW, OptimizerKind.ADAGRAD, OptimizerKind.SGD])
def test_fused_push_equals_per_parameter_push(kind: OptimizerKind) -> None:
    """A push of every parameter runs fused over the flat buffers: the per-parameter bits exactly,
    across a late registration (relayout), partial pushes (step counts differ) and a state load."""
    cfg = OptimizerConfig(kind=kind, lr=0.01, weight_decay=0.01)
    rng = np.random.default_rng(3)
    shapes = {"a": (3, 4), "b": (4,), "c": (2, 5)}
    fused, ref = DenseStore(cfg), DenseStore(cfg)
    for name in ("a", "b"):
        v = rng.normal(size=shapes[name]).astype(np.float32)
        fused.register(name, v)
        ref.register(name, v)

    def grads(names: list[str]) -> dict[str, np.ndarray]:
        return {n: rng.normal(size=shapes[n]).astype(np.float32) for n in names}

    def push_ref(g: dict[str, np.ndarray]) -> None:
        for n, v in g.items():  # one parameter at a time: the per-parameter path
            ref.push({n: v})

    plan = [["a", "b"], ["a", "b"], ["b"], ["a", "b"], ["a"], ["a", "b"], "register c", ["a", "b", "c"],
            ["a", "b", "c"], "load", ["a", "b", "c"]]
    for item in plan:
        if item == "register c":
            v = rng.normal(size=shapes["c"]).astype(np.float32)
            fused.register("c", v)
            ref.register("c", v)
            fused.push({"a": np.zeros(shapes["a"], np.float32)})  # align step counts: a, b and c
            push_ref({"a": np.zeros(shapes["a"], np.float32)})
            continue
        if item == "load":
            saved = ref.state()
            fused.load_state(saved)
            continue
        g = grads(item)
        fused.push(g)
        push_ref(g)
        for n, v in ref.state().items():
            for k, arr in v.items():
                np.testing.assert_array_equal(fused.state()[n][k], arr, err_msg=f"{item} {n} {k}")
    assert fused.memory_bytes() == ref.memory_bytes()


@pytest.mark.parametrize("kind", [OptimizerKind.ADAM, OptimizerKind.ADAMW, OptimizerKind.ADAGRAD, OptimizerKind.SGD])
def test_fused_kernel_on_odd_sizes(kind: OptimizerKind) -> None:
    """Sizes that are not multiples of the kernel's vector width: a push of every parameter (one
    call over the flat buffers) and pushes of one parameter at a time give the same bits, and both
    match torch.optim (its default, unfused update) to the same tolerance as above."""
    cfg = OptimizerConfig(kind=kind, lr=0.01, weight_decay=0.01)
    rng = np.random.default_rng(11)
    shapes = {"a": (37, 29), "b": (1000,), "c": (3,), "d": (17,)}
    init = {n: rng.normal(size=s).astype(np.float32) for n, s in shapes.items()}
    fused, each = DenseStore(cfg), DenseStore(cfg)
    for n, v in init.items():
        fused.register(n, v)
        each.register(n, v)
    params = {n: torch.nn.Parameter(torch.tensor(v)) for n, v in init.items()}
    ref = {OptimizerKind.ADAM: lambda: torch.optim.Adam(params.values(), lr=0.01, eps=cfg.eps, weight_decay=0.01),
           OptimizerKind.ADAMW: lambda: torch.optim.AdamW(params.values(), lr=0.01, eps=cfg.eps, weight_decay=0.01),
           OptimizerKind.ADAGRAD: lambda: torch.optim.Adagrad(params.values(), lr=0.01, eps=cfg.eps,
                                                              weight_decay=0.01),
           OptimizerKind.SGD: lambda: torch.optim.SGD(params.values(), lr=0.01, weight_decay=0.01)}[kind]()
    for _ in range(4):
        g = {n: rng.normal(size=s).astype(np.float32) for n, s in shapes.items()}
        fused.push(g)
        for n, v in g.items():
            each.push({n: v})
        for n, p in params.items():
            p.grad = torch.tensor(g[n])
        ref.step()
    got, per = fused.state(), each.state()
    for n in shapes:
        for k, arr in per[n].items():
            np.testing.assert_array_equal(got[n][k], arr, err_msg=f"{n} {k}")
        np.testing.assert_allclose(got[n]["value"], params[n].detach().numpy(), rtol=1e-6, atol=1e-7)


def test_pull_of_every_parameter_is_a_copy() -> None:
    """The one-copy pull of every parameter returns arrays the store does not share."""
    d = DenseStore(OptimizerConfig(kind=OptimizerKind.SGD, lr=1.0))
    d.register("a", np.ones((2, 3), np.float32))
    d.register("b", np.full(5, 2.0, np.float32))
    got = d.pull()
    assert got["a"].shape == (2, 3) and got["b"].shape == (5,)
    got["a"][...] = 7.0
    d.push({"a": np.ones((2, 3), np.float32), "b": np.ones(5, np.float32)})
    np.testing.assert_array_equal(d.pull(["a"])["a"], np.zeros((2, 3), np.float32))
    np.testing.assert_array_equal(d.pull()["b"], np.ones(5, np.float32))


@pytest.mark.parametrize("kind", [OptimizerKind.ADAMW, OptimizerKind.SGD])
def test_weight_decay_spares_the_meta_learner(kind: OptimizerKind) -> None:
    """One step with a zero gradient: a model parameter moves by exactly the decay rule (SGD's L2:
    -lr * wd * w; AdamW's decoupled shrink: -lr * wd * w, Adam's step being 0 on a zero gradient);
    a ``meta_learner.*`` parameter (a learned log inner rate) does not move. The exempt prefix is the
    meta learner's."""
    from models.meta_learner import PREFIX
    from ps.dense_store import DECAY_EXEMPT_PREFIXES

    assert DECAY_EXEMPT_PREFIXES == (PREFIX,)
    lr, wd = 0.1, 0.5
    d = DenseStore(OptimizerConfig(kind=kind, lr=lr, weight_decay=wd))
    w0 = np.linspace(-2, 2, 6, dtype=np.float32)
    d.register("deep.0.weight", w0)
    d.register(PREFIX + "dense_log_lr.0", w0)
    zero = np.zeros(6, np.float32)
    d.push({"deep.0.weight": zero, PREFIX + "dense_log_lr.0": zero})
    got = d.pull()
    np.testing.assert_allclose(got["deep.0.weight"], w0 - lr * wd * w0, rtol=1e-6, atol=1e-7)
    np.testing.assert_array_equal(got[PREFIX + "dense_log_lr.0"], w0)
    d.push({PREFIX + "dense_log_lr.0": zero})  # a push of one parameter (its own span) spares it too
    np.testing.assert_array_equal(d.pull()[PREFIX + "dense_log_lr.0"], w0)
