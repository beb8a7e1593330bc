"""The PS screens updates, not only inputs: nothing non-finite is ever stored.

Huge-but-finite gradients (|g| > ~1.8e19 makes g^2 overflow float32) used to
turn FTRL rows into NaN and freeze Adagrad rows at an Inf accumulator. Now a
row whose update would be NaN/Inf keeps its previous weights and state, the
drop is counted (PushResult / PushCounts ``update_nonfinite_dropped``, table
stat), and the other rows of the same push are applied. Also here: the
per-table gradient clip and fp16 pulls of rows beyond the fp16 range.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from common.config import ConfigError, from_mapping
from ps import wire
from ps.config import TABLE_OPTIMIZERS, InitKind, OptimizerConfig, OptimizerKind, PsConfig, TableConfig, TableDefaults, TableOverride
from ps.embedding_table import EmbeddingTable, TableRows
from ps.errors import BadRequest
from ps.optimizers import FusedTbeOptimizer, clip_rows

torch.set_num_threads(1)

DIM = 8
F32_MAX = float(np.finfo(np.float32).max)


def opt_cfg(kind: OptimizerKind) -> OptimizerConfig:
    # sgd: lr * g must overflow for a finite g, so lr > 1
    return OptimizerConfig(kind=kind, lr=4.0 if kind == OptimizerKind.SGD else 0.05, weight_decay=0.0)


def table(kind: OptimizerKind, **kw) -> EmbeddingTable:
    init = InitKind.ZEROS if kind == OptimizerKind.FTRL else InitKind.NORMAL
    return EmbeddingTable(TableConfig(name="t", dim=DIM, capacity=32, optimizer=opt_cfg(kind), init=init, **kw), seed=0)


def huge(kind: OptimizerKind) -> float:
    # finite float32; g^2 overflows (adagrad kinds, ftrl; adam's (1-b2) g^2 too), and 4 * g for sgd (lr 4)
    return 1e38


def snapshot(t: EmbeddingTable, ids: list[int]) -> tuple[bytes, dict[str, bytes]]:
    r = t.export_rows(t.lookup_rows(np.array(ids, dtype=np.int64)))
    return r.weights.tobytes(), {k: v.tobytes() for k, v in r.state.items()}


def all_finite(t: EmbeddingTable) -> bool:
    r = t.export_rows(t.used_rows())
    return bool(np.isfinite(r.weights).all()) and all(np.isfinite(v).all() for v in r.state.values())


@pytest.mark.parametrize("kind", TABLE_OPTIMIZERS)
def test_huge_finite_gradient_is_not_written_and_counted(kind: OptimizerKind) -> None:
    rng = np.random.default_rng(0)
    t, twin = table(kind), table(kind)
    warm_ids = np.array([1, 2, 3], dtype=np.int64)
    warm = rng.normal(size=(3, DIM)).astype(np.float32)
    for tb in (t, twin):
        tb.push(warm_ids, warm)
    before = snapshot(t, [2])

    ids = np.array([1, 2, 3, 2], dtype=np.int64)  # id 2 twice: its sum stays finite
    g = rng.normal(size=(4, DIM)).astype(np.float32)
    g[1, :] = huge(kind)
    res = t.push(ids, g)
    assert (res.update_nonfinite_dropped, res.applied, res.nonfinite_dropped) == (1, 2, 0)
    assert t.stats()["update_nonfinite_dropped"] == 1
    assert snapshot(t, [2]) == before  # weights and optimizer state untouched
    assert all_finite(t)
    # the other rows got exactly the update they get without id 2 in the push
    twin.push(np.array([1, 3], dtype=np.int64), g[[0, 2]])
    assert snapshot(t, [1, 3]) == snapshot(twin, [1, 3])
    # the row still trains
    res = t.push(np.array([2], dtype=np.int64), g[[0]])
    assert (res.applied, res.update_nonfinite_dropped) == (1, 0)
    assert snapshot(t, [2]) != before and all_finite(t)


@pytest.mark.parametrize("kind", [k for k in TABLE_OPTIMIZERS if k != OptimizerKind.ADAM])
def test_huge_updates_are_written_until_one_would_overflow(kind: OptimizerKind) -> None:
    """Updates that stay finite are applied even when huge; the first that would overflow is not.

    (Adam's v is a moving average, bounded by max g^2: it never accumulates past the range.)
    """
    cfg = OptimizerConfig(kind=kind, lr=1.0, weight_decay=0.0)
    init = InitKind.ZEROS if kind == OptimizerKind.FTRL else InitKind.NORMAL
    t = EmbeddingTable(TableConfig(name="t", dim=DIM, capacity=8, optimizer=cfg, init=init), seed=0)
    ids = np.array([7, 8], dtype=np.int64)
    g = np.ones((2, DIM), np.float32)
    t.push(ids, g)
    # one element just below sqrt(FLT_MAX): g^2 is finite, the accumulated sum of squares is not (sgd: w -= g)
    g[0, 0] = -1.5e38 if kind == OptimizerKind.SGD else 1.8e19
    dropped = []
    for _ in range(12):
        before = snapshot(t, [7])
        res = t.push(ids, g)
        assert res.applied + res.update_nonfinite_dropped == 2 and all_finite(t)
        dropped.append(res.update_nonfinite_dropped)
        if res.update_nonfinite_dropped:
            assert snapshot(t, [7]) == before
            break
    assert dropped[-1] == 1 and len(dropped) >= 2 and not any(dropped[:-1]), dropped
    assert t.stats()["update_nonfinite_dropped"] == 1


@pytest.mark.parametrize("kind", [OptimizerKind.ADAGRAD, OptimizerKind.ROWWISE_ADAGRAD, OptimizerKind.SGD])
def test_fused_exact_path_only_when_the_bound_says_so(kind: OptimizerKind) -> None:
    """Ordinary pushes skip the snapshot; a row imported near the float32 limit forces it."""
    t = table(kind)
    opt = t.optimizer
    assert isinstance(opt, FusedTbeOptimizer)
    rng = np.random.default_rng(1)
    ids = np.arange(1, 11, dtype=np.int64)
    for _ in range(5):
        t.push(ids, rng.normal(size=(10, DIM)).astype(np.float32))
    assert opt.exact_pushes == 0
    # a migrated/restored row near the float32 limit: an ordinary gradient can now overflow it
    rows = t.export_rows(t.lookup_rows(np.array([3], dtype=np.int64)))
    rows.weights[:] = 0.99 * F32_MAX
    if "momentum" in rows.state:
        rows.state["momentum"][:] = 0.99 * F32_MAX
    t.import_rows(rows)
    g = np.full((2, DIM), -0.2 * F32_MAX if kind == OptimizerKind.SGD else 3e18, np.float32)
    res = t.push(np.array([3, 4], dtype=np.int64), g)
    assert opt.exact_pushes == 1
    assert res.update_nonfinite_dropped >= 1 and all_finite(t)


def test_weight_decay_overflow_is_screened() -> None:
    """g + wd * w can overflow although g and w are finite."""
    cfg = OptimizerConfig(kind=OptimizerKind.ADAGRAD, lr=0.05, weight_decay=10.0)
    t = EmbeddingTable(TableConfig(name="t", dim=DIM, capacity=8, optimizer=cfg), seed=0)
    t.push(np.array([1, 2], dtype=np.int64), np.ones((2, DIM), np.float32))
    rows = t.export_rows(t.lookup_rows(np.array([1], dtype=np.int64)))
    rows.weights[:] = 1e38
    t.import_rows(rows)
    before = snapshot(t, [1])
    res = t.push(np.array([1, 2], dtype=np.int64), np.ones((2, DIM), np.float32))
    assert (res.applied, res.update_nonfinite_dropped) == (1, 1)
    assert snapshot(t, [1]) == before and all_finite(t)


def test_import_refuses_nonfinite_rows() -> None:
    t = table(OptimizerKind.ADAM)
    t.push(np.array([1, 2], dtype=np.int64), np.ones((2, DIM), np.float32))
    good = t.export_rows(t.lookup_rows(np.array([1, 2], dtype=np.int64)))
    before = snapshot(t, [1, 2])
    for field in ("weights", "v"):
        bad = TableRows(good.ids, good.weights.copy(), {k: v.copy() for k, v in good.state.items()},
                        good.freq, good.last_step)
        (bad.weights if field == "weights" else bad.state["v"])[1, 3] = np.nan
        with pytest.raises(BadRequest, match=r"table 't': 1 imported row\(s\) hold NaN/Inf .* first id 2"):
            t.import_rows(bad)
    assert snapshot(t, [1, 2]) == before and all_finite(t)


# -- gradient clip ----------------------------------------------------------------------
def test_grad_clip_norm_and_value() -> None:
    sgd = OptimizerConfig(kind=OptimizerKind.SGD, lr=1.0)
    t = EmbeddingTable(TableConfig(name="t", dim=4, capacity=8, optimizer=sgd, init=InitKind.ZEROS,
                                   grad_clip_norm=1.0), seed=0)
    g = np.array([[3.0, 4.0, 0.0, 0.0], [0.3, 0.4, 0.0, 0.0]], np.float32)  # norms 5 and 0.5
    t.push(np.array([1, 2], dtype=np.int64), g)
    np.testing.assert_allclose(t.pull(np.array([1, 2], dtype=np.int64)), [[-0.6, -0.8, 0, 0], [-0.3, -0.4, 0, 0]],
                               rtol=1e-6)
    assert t.stats()["grad_clipped"] == 1
    # a huge finite gradient is clipped, not dropped
    res = t.push(np.array([3], dtype=np.int64), np.full((1, 4), 1e30, np.float32))
    assert (res.applied, res.update_nonfinite_dropped) == (1, 0)
    np.testing.assert_allclose(t.pull(np.array([3], dtype=np.int64)), [[-0.5] * 4], rtol=1e-6)

    tv = EmbeddingTable(TableConfig(name="t", dim=4, capacity=8, optimizer=sgd, init=InitKind.ZEROS,
                                    grad_clip_value=0.5), seed=0)
    tv.push(np.array([1], dtype=np.int64), np.array([[3.0, -0.2, -4.0, 0.5]], np.float32))
    np.testing.assert_array_equal(tv.pull(np.array([1], dtype=np.int64)), np.float32([[-0.5, 0.2, 0.5, -0.5]]))
    assert tv.stats()["grad_clipped"] == 1


def test_clip_rows_is_per_row_after_summing() -> None:
    g = torch.tensor([[1e20, 0.0], [0.0, 0.0], [0.6, 0.8]])
    out, n = clip_rows(g, norm=0.5)
    np.testing.assert_allclose(out.numpy(), [[0.5, 0.0], [0.0, 0.0], [0.3, 0.4]], rtol=1e-6)
    assert n == 2
    same, n = clip_rows(g, 0.0, 0.0)
    assert same is g and n == 0


@pytest.mark.parametrize("key", ["grad_clip_norm", "grad_clip_value"])
@pytest.mark.parametrize("value", [-1.0, float("inf"), float("nan"), "1"])
def test_grad_clip_config_is_validated(key: str, value: object) -> None:
    with pytest.raises(ValueError, match=rf"table 'user': {key} must be a finite number > 0, or 0 = off"):
        TableConfig(name="user", **{key: value}).validate()
    with pytest.raises(ValueError, match=rf"table 'user': {key} must be"):
        PsConfig(tables=[TableOverride(name="user", **{key: value})]).validate()
    if isinstance(value, float):  # as a job file reads it ([ps.table_defaults] in TOML)
        with pytest.raises(ConfigError, match=rf"\[ps.table_defaults\]: table_defaults: {key} must be"):
            from_mapping(PsConfig, {"table_defaults": {key: value}}, where="job.toml", prefix="ps")


def test_grad_clip_override_resolves() -> None:
    cfg = PsConfig(table_defaults=TableDefaults(grad_clip_norm=2.0),
                   tables=[TableOverride(name="item", grad_clip_norm=0.0, grad_clip_value=1.5)])
    user, item = cfg.table_configs(["user", "item"])
    assert (user.grad_clip_norm, user.grad_clip_value) == (2.0, 0.0)
    assert (item.grad_clip_norm, item.grad_clip_value) == (0.0, 1.5)


# -- fp16 pulls ---------------------------------------------------------------------------
def test_fp16_pull_saturates_and_counts() -> None:
    t = table(OptimizerKind.SGD)
    t.push(np.array([1, 2], dtype=np.int64), np.zeros((2, DIM), np.float32))
    rows = t.export_rows(t.lookup_rows(np.array([1], dtype=np.int64)))
    rows.weights[0, :3] = [1e5, -3e37, 65504.0]
    t.import_rows(rows)
    ids = np.array([1, 2], dtype=np.int64)
    exact = t.pull(ids)
    assert exact[0, 1] == np.float32(-3e37)  # fp32 pulls are untouched
    got = t.pull(ids, fp16=True)
    np.testing.assert_array_equal(got[0, :3], [65504.0, -65504.0, 65504.0])
    np.testing.assert_array_equal(got[1], exact[1])
    assert t.stats()["fp16_saturated"] == 2
    decoded = wire.decode_rows(wire.encode_rows(got, wire.DType.FP16), wire.DType.FP16, 2, DIM)
    assert np.isfinite(decoded).all()


def test_fp16_encode_never_turns_a_finite_value_into_inf() -> None:
    rows = np.array([[1e5, -7e4, 1.0, 65504.0], [np.nan, 2.0, -1e38, 0.5]], np.float32)
    out = wire.decode_rows(wire.encode_rows(rows, wire.DType.FP16), wire.DType.FP16, 2, 4).astype(np.float32)
    np.testing.assert_array_equal(out[0], [65504.0, -65504.0, 1.0, 65504.0])
    assert np.isnan(out[1, 0]) and out[1, 2] == -65504.0 and out[1, 1] == 2.0
    small = np.array([[1.0, -2.0, 0.5, 3.0]], np.float32)  # in range: plain conversion
    assert wire.encode_rows(small, wire.DType.FP16) == small.astype(np.float16).tobytes()


# -- over gRPC ---------------------------------------------------------------------------
def test_counts_and_stats_over_grpc(ps_fleet) -> None:
    opt = OptimizerConfig(kind=OptimizerKind.ADAGRAD, lr=0.1)
    fleet = ps_fleet(2, tables=[TableConfig(name="user", dim=DIM, capacity=64, optimizer=opt)])
    client = fleet.client(value_dtype="fp16")
    ids = np.arange(1, 9, dtype=np.int64)
    g = np.ones((8, DIM), np.float32)
    g[[2, 5]] = 1e20
    counts = client.push({"user": (ids, g)})["user"]
    assert (counts["applied"], counts["update_nonfinite_dropped"], counts["nonfinite_dropped"]) == (6, 2, 0)
    stats = [s.store.stats()["tables"]["user"] for s in fleet.servers]
    assert sum(st["update_nonfinite_dropped"] for st in stats) == 2
    rows = client.pull({"user": ids})["user"]
    assert np.isfinite(rows).all()
    # a row beyond the fp16 range reaches an fp16 client saturated, not as Inf
    big = 3
    for s in fleet.servers:
        t = s.store.tables["user"]
        if t.lookup_rows(np.array([big], dtype=np.int64))[0] >= 0:
            r = t.export_rows(t.lookup_rows(np.array([big], dtype=np.int64)))
            r.weights[0, 0] = -1e6
            s.store.import_rows("user", r)
    got = client.pull({"user": np.array([big, 1], dtype=np.int64)})["user"]
    assert got[0, 0] == -65504.0 and np.isfinite(got).all()
    assert sum(s.store.stats()["tables"]["user"]["fp16_saturated"] for s in fleet.servers) == 1
