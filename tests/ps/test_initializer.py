"""Initial rows (ps/initializer.py): what is guaranteed, not how it is computed.

* a row depends only on (table name, id, seed): not on batch composition, order,
  duplicates, shard, slot, capacity or insertion order;
* identical in every process (a fresh interpreter gives the same bytes, and the
  bytes are pinned: a change of the values must be deliberate);
* normal rows have the configured std, uniform rows the configured half-width
  (mean / std / range on 1M draws and a Kolmogorov-Smirnov distance);
* no visible correlation between neighbouring ids, neighbouring columns, or the
  64-column chunks of a long row;
* the constant tables are built from IEEE-exact operations: each normal column
  is a permutation of the unit-RMS normal quantiles, which match the stdlib's
  ``NormalDist.inv_cdf``.
"""

from __future__ import annotations

import hashlib
import json
import math
import statistics
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from ps.config import InitKind, TableConfig
from ps.embedding_table import EmbeddingTable
from ps.initializer import TABLE_ROWS, RowInitializer, _log, _normal_tables, normal_quantiles
from tests.ps.conftest import REPO

torch.set_num_threads(1)

N_DRAWS = 1 << 20
"""Values per distribution test: 16384 ids x dim 64."""


def _ks_normal(x: np.ndarray) -> float:
    """Kolmogorov-Smirnov distance of ``x`` to N(0, 1)."""
    xs = np.sort(x.astype(np.float64))
    cdf = torch.special.ndtr(torch.from_numpy(xs)).numpy()
    n = xs.size
    i = np.arange(1, n + 1, dtype=np.float64)
    return float(max(np.max(i / n - cdf), np.max(cdf - (i - 1) / n)))


def _ks_uniform(x: np.ndarray) -> float:
    """Kolmogorov-Smirnov distance of ``x`` to U(-1, 1)."""
    cdf = (np.sort(x.astype(np.float64)) + 1.0) / 2.0
    n = cdf.size
    i = np.arange(1, n + 1, dtype=np.float64)
    return float(max(np.max(i / n - cdf), np.max(cdf - (i - 1) / n)))


KS_LIMIT = 1.95 / math.sqrt(N_DRAWS)
"""KS critical value at p = 0.001 for 1M independent draws (a real N(0,1) sample passes 999 in 1000)."""


def _ids(n: int, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).integers(-(2**63), 2**63 - 1, size=n, dtype=np.int64)


@pytest.mark.parametrize("scale", [0.01, 3.0])
def test_normal_has_configured_std_and_shape(scale: float) -> None:
    x = RowInitializer("user", 64, InitKind.NORMAL, scale, 7)(_ids(N_DRAWS // 64)).reshape(-1)
    assert x.dtype == np.float32 and x.size == N_DRAWS and np.isfinite(x).all()
    z = x.astype(np.float64) / scale
    assert abs(z.mean()) < 5 / math.sqrt(N_DRAWS), z.mean()
    assert abs(z.std() - 1.0) < 0.005, z.std()
    assert _ks_normal(z) < KS_LIMIT, _ks_normal(z)
    # tails like a normal: P(|z| > 3) = 0.0027, P(|z| > 4) = 6.3e-5; bounded by the tables (<= 4.4 sqrt 3)
    assert abs(np.mean(np.abs(z) > 3) - 0.0027) < 0.0006
    assert 0 < np.sum(np.abs(z) > 4) < 3 * 6.3e-5 * N_DRAWS
    assert np.abs(z).max() < 7.7


@pytest.mark.parametrize("scale", [0.05, 2.0])
def test_uniform_has_configured_half_width(scale: float) -> None:
    x = RowInitializer("item", 64, InitKind.UNIFORM, scale, 3)(_ids(N_DRAWS // 64, 1)).reshape(-1)
    assert x.dtype == np.float32 and x.size == N_DRAWS
    assert -scale < x.min() and x.max() < scale
    assert x.min() < -0.999 * scale and x.max() > 0.999 * scale  # the whole range is used
    z = x.astype(np.float64) / scale
    assert abs(z.mean()) < 5 / math.sqrt(3 * N_DRAWS)
    assert abs(z.std() - 1 / math.sqrt(3)) < 0.003, z.std()
    assert _ks_uniform(z) < KS_LIMIT, _ks_uniform(z)


@pytest.mark.parametrize("kind", [InitKind.NORMAL, InitKind.UNIFORM])
def test_no_correlation_between_neighbouring_ids_columns_or_chunks(kind: InitKind) -> None:
    n = 1 << 15
    x = RowInitializer("user", 192, kind, 1.0, 0)(np.arange(-5, n - 5, dtype=np.int64)).astype(np.float64)
    x -= x.mean()
    x /= x.std()
    lim = 5 / math.sqrt(n * 64)  # 5 sigma of a correlation over n * 64 pairs

    def corr(a: np.ndarray, b: np.ndarray) -> float:
        return float(np.mean(a * b))

    assert abs(corr(x[1:, :64], x[:-1, :64])) < lim  # id i vs id i + 1
    assert abs(corr(x[2:, :64], x[:-2, :64])) < lim  # id i vs id i + 2
    assert abs(corr(x[:, 1:65], x[:, 0:64])) < lim  # column j vs j + 1 of the same row
    assert abs(corr(x[:, 64:128], x[:, 0:64])) < lim  # chunk 1 vs chunk 0
    assert abs(corr(x[:, 128:192], x[:, 64:128])) < lim
    # no two of these consecutive ids share a row
    assert np.unique(x[:, :4], axis=0).shape[0] == n


def test_row_depends_only_on_table_id_and_seed() -> None:
    ids = _ids(5000, 2)
    init = RowInitializer("user", 24, InitKind.NORMAL, 0.1, 11)
    whole = init(ids)
    perm = np.random.default_rng(3).permutation(ids.size)
    np.testing.assert_array_equal(init(ids[perm]), whole[perm])  # order
    np.testing.assert_array_equal(np.concatenate([init(ids[:7]), init(ids[7:])]), whole)  # batch split
    dup = np.concatenate([ids[:100], ids[:100]])
    np.testing.assert_array_equal(init(dup), np.concatenate([whole[:100], whole[:100]]))  # duplicates
    np.testing.assert_array_equal(RowInitializer("user", 24, InitKind.NORMAL, 0.1, 11)(ids), whole)  # new object
    for other in (RowInitializer("users", 24, InitKind.NORMAL, 0.1, 11), RowInitializer("user", 24, InitKind.NORMAL, 0.1, 12)):
        assert np.mean(other(ids) == whole) < 0.001  # table name and seed change every row
    # a long row's first 64 columns are the 64-column row's
    np.testing.assert_array_equal(
        RowInitializer("user", 150, InitKind.NORMAL, 0.1, 11)(ids)[:, :24], whole
    )
    assert not RowInitializer("user", 8, InitKind.ZEROS, 0.1, 11)(ids).any()
    assert not RowInitializer("user", 8, InitKind.NORMAL, 0.0, 11)(ids).any()


def test_stored_rows_equal_the_formula_whatever_slot_shard_or_order() -> None:
    """Rows admitted into different slots (capacity, insertion order, shards) hold exactly init(id)."""
    ids = np.unique(_ids(3000, 4))
    cfg = dict(name="user", dim=16, init=InitKind.NORMAL, init_scale=0.2)
    a = EmbeddingTable(TableConfig(capacity=4000, **cfg), seed=9)  # type: ignore[arg-type]
    b = EmbeddingTable(TableConfig(capacity=9000, **cfg), seed=9)  # type: ignore[arg-type]
    a.push(ids, np.zeros((ids.size, 16), np.float32))
    rev = ids[::-1].copy()
    b.push(rev[:5], np.zeros((5, 16), np.float32))  # different slots for every id
    b.push(rev[5:], np.zeros((rev.size - 5, 16), np.float32))
    assert a.size == b.size == ids.size
    ra, rb = a.lookup_rows(ids), b.lookup_rows(ids)
    assert (ra != rb).any()
    want = RowInitializer("user", 16, InitKind.NORMAL, 0.2, 9)(ids)
    np.testing.assert_array_equal(a.weights[torch.from_numpy(ra)].numpy(), want)
    np.testing.assert_array_equal(b.weights[torch.from_numpy(rb)].numpy(), want)
    np.testing.assert_array_equal(a.pull(ids), EmbeddingTable(TableConfig(capacity=8, **cfg), seed=9).pull(ids))  # type: ignore[arg-type]


PINNED_SHA256 = {
    "normal": "944c0280d6e905bdafe4d96151543697c03dabb73d541d261f8aac41d9fa3769",
    "uniform": "9187b7ffc42b242b1e0e06a710427ba7ff2439c05f6d804ae5e8f3cec5a29d70",
}
"""sha256 of the rows of ids -1000..999 (dim 100, scale 0.5, seed 42, table 'pin'): the values
are part of the job's semantics (checkpoints hold only pushed rows); change them deliberately."""


def _digest(kind: str) -> str:
    ids = np.arange(-1000, 1000, dtype=np.int64)
    ids = ids[ids != -1]
    rows = RowInitializer("pin", 100, InitKind(kind), 0.5, 42)(ids)
    return hashlib.sha256(np.ascontiguousarray(rows).tobytes()).hexdigest()


def test_values_pinned_and_identical_in_a_fresh_process() -> None:
    code = (
        "import json; from tests.ps.test_initializer import _digest; "
        "print(json.dumps({k: _digest(k) for k in ('uniform', 'normal')}))"
    )
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr
    fresh = json.loads(out.stdout.strip().splitlines()[-1])
    here = {k: _digest(k) for k in ("normal", "uniform")}
    assert fresh == here
    assert here == PINNED_SHA256


def test_tables_are_permuted_normal_quantiles() -> None:
    q = normal_quantiles()
    ref = np.array([statistics.NormalDist().inv_cdf((k + 0.5) / TABLE_ROWS) for k in range(TABLE_ROWS)])
    assert np.max(np.abs(q - ref) / np.abs(ref)) < 2e-9  # Acklam's approximation
    np.testing.assert_array_equal(q, -q[::-1])  # exactly antisymmetric: mean 0
    tabs = _normal_tables()
    assert tabs.shape == (3, TABLE_ROWS, 64) and tabs.dtype == np.float32 and not tabs.flags.writeable
    srt = np.sort(tabs, axis=1)
    np.testing.assert_array_equal(srt, np.broadcast_to(srt[0, :, :1], srt.shape))  # every column: same multiset
    col = srt[0, :, 0].astype(np.float64)
    assert abs(math.sqrt(np.mean(col * col)) - 1.0) < 1e-6  # unit RMS
    assert np.max(np.abs(col / ref.astype(np.float32) - 1 / math.sqrt(np.mean(ref * ref)))) < 1e-6
    # the columns are different permutations (not copies of each other)
    assert np.mean(tabs[0, :, 0] == tabs[0, :, 1]) < 0.001 and np.mean(tabs[0, :, 0] == tabs[1, :, 0]) < 0.001


def test_log_is_libm_accurate() -> None:
    x = np.concatenate([np.random.default_rng(5).random(100_000) + 1e-300, [1e-300, 0.5, 1.0, 2.0, 1e300]])
    np.testing.assert_allclose(_log(x), np.log(x), rtol=3e-16, atol=0)


@pytest.mark.parametrize("dim", [8, 64, 100])
def test_values_do_not_depend_on_the_scaled_table_cache(dim: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``_SCALED_MAX`` cached (width, scale) tables the unfused path gives the same bits."""
    import ps.initializer as pi

    ids = _ids(3000, 6)
    fused = RowInitializer("user", dim, InitKind.NORMAL, 0.37, 1)(ids)
    monkeypatch.setattr(pi, "_weights", {})
    monkeypatch.setattr(pi, "_SCALED_MAX", 0)
    assert pi._scaled_weight(64, np.float32(0.37)) is None
    unfused = RowInitializer("user", dim, InitKind.NORMAL, 0.37, 1)(ids)
    assert np.array_equal(fused.view(np.uint32), unfused.view(np.uint32))


def test_tables_built_by_columns_equal_the_full_build(monkeypatch: pytest.MonkeyPatch) -> None:
    """Only the columns a process needs are built (issue 36 item 4); narrow first, then wider, the
    bits equal the 64-column build, for the normal and the uniform tables."""
    import ps.initializer as pi

    full_n, full_u = _normal_tables().copy(), pi._uniform_tables().copy()
    monkeypatch.setattr(pi, "_tables", {})
    monkeypatch.setattr(pi, "_weights", {})
    for w in (8, 16, 4, 40, 64):
        n, u = _normal_tables(w), pi._uniform_tables(w)
        assert n.shape == u.shape == (3, TABLE_ROWS, w) and not n.flags.writeable and not u.flags.writeable
        assert np.array_equal(n.view(np.uint32), full_n[:, :, :w].view(np.uint32))
        assert np.array_equal(u, full_u[:, :, :w])
    assert pi._tables["normal"].shape[2] == 64  # widened on demand, never narrowed


@pytest.mark.parametrize("kind", [InitKind.NORMAL, InitKind.UNIFORM])
def test_a_store_builds_the_tables_before_its_first_pull(kind: InitKind, monkeypatch: pytest.MonkeyPatch) -> None:
    """``TableGroup`` warms the initializer at construction (dim 16: 16 columns), so a first pull
    builds nothing; the rows are the same as a cold initializer's."""
    import ps.initializer as pi
    from ps.table_group import TableGroup

    ids = _ids(500, 12)
    cold = RowInitializer("user", 16, kind, 0.05, 4)(ids)
    monkeypatch.setattr(pi, "_tables", {})
    monkeypatch.setattr(pi, "_weights", {})
    g = TableGroup([TableConfig("user", dim=16, capacity=64, init=kind, init_scale=0.05),
                    TableConfig("item", dim=16, capacity=64, init=kind, init_scale=0.05)], seed=4)
    built = dict(pi._tables), dict(pi._weights)
    assert pi._tables[kind.value].shape[2] == 16
    if kind == InitKind.NORMAL:
        assert list(pi._weights) == [(16, float(np.float32(0.05 / math.sqrt(3.0))))]
    rows = g.pull(np.array([ids.size, 0], dtype=np.int64), torch.from_numpy(ids)).numpy()
    assert (dict(pi._tables), dict(pi._weights)) == built  # the pull built nothing
    assert np.array_equal(rows.view(np.uint32), cold.view(np.uint32))


def test_restored_rows_and_never_pushed_rows_agree(tmp_path: Path) -> None:
    """Rows admitted with a zero gradient (their initial value), checkpointed on 2 shards and
    restored on 3 with another vshard count, read exactly as never-pushed ids do, and as
    RowInitializer computes them."""
    from common.hashing import vshard_of
    from ps.checkpoint import load_shard
    from tests.ps.test_checkpoint import fleet, owned, save_all

    ids = np.unique(_ids(500, 9))
    old = fleet(2, 16)
    for k, s in enumerate(old):
        sel = ids[vshard_of(ids, 16) % 2 == k]
        s.push("user", sel, np.zeros((sel.size, 8), np.float32))  # admitted, rowwise adagrad: w unchanged
    assert sum(s.tables["user"].size for s in old) == ids.size
    final = save_all(old, tmp_path, 1)
    new = fleet(3, 8)
    for k, s in enumerate(new):
        load_shard(s, final, owned(k, 3, 8))
    restored = np.empty((ids.size, 8), np.float32)
    for k, s in enumerate(new):
        sel = vshard_of(ids, 8) % 3 == k
        assert (s.tables["user"].lookup_rows(ids[sel]) >= 0).all()  # really restored rows
        restored[sel] = s.pull("user", ids[sel])
    never = fleet(1, 8)[0].pull("user", ids)  # a fresh store: every id unknown
    np.testing.assert_array_equal(restored, never)
    cfg = old[0].tables["user"].cfg
    want = RowInitializer("user", 8, cfg.init, cfg.init_scale, 3)(ids)
    np.testing.assert_array_equal(restored, want)
