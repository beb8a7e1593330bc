"""``[ps] intra_op_threads``: a large pull or push split over threads gives the same bits.

* ``intra_op.run`` runs every span (on distinct threads), returns the results in span
  order, and raises a span's error only after every span finished;
* a table's pull (the split lookup + gather; unknown ids' initial rows span by span)
  and push (known and new ids: the split lookup and rowwise-Adagrad update)
  equal the one-thread table bit for bit, weights, optimizer state and metadata;
* the same through real shards on 127.0.0.1 (``ps_fleet``, framed gRPC);
* the config key and ``set_threads`` refuse bad values naming the key; ``metaps ps`` applies the
  job's value (its log line) and serves split requests.
"""

from __future__ import annotations

import threading
from typing import Iterator

import numpy as np
import pytest
import torch

from ps import intra_op
from ps.config import OptimizerConfig, OptimizerKind, PsConfig, TableConfig
from ps.embedding_table import EmbeddingTable

torch.set_num_threads(1)
DIM = 16
N = 3 * intra_op.MIN_ROWS_PER_THREAD + 123  # three uneven spans at 3 threads


@pytest.fixture
def threads() -> Iterator[None]:
    yield
    intra_op.set_threads(1)


def _table() -> EmbeddingTable:
    cfg = TableConfig(name="t", dim=DIM, capacity=4 * N,
                      optimizer=OptimizerConfig(kind=OptimizerKind.ROWWISE_ADAGRAD, lr=0.05))
    return EmbeddingTable(cfg, seed=3)


def _state(t: EmbeddingTable) -> dict[str, np.ndarray]:
    out = {"weights": t.weights.numpy().copy(), "row_ids": t.row_ids.copy(), "freq": t.freq.copy(),
           "last_step": t.last_step.copy(), "version": t.row_version.copy()}
    out.update({k: v.numpy().copy() for k, v in t.optimizer.state_tensors().items()})
    return out


def test_run_covers_every_span_in_order_on_several_threads(threads: None) -> None:
    intra_op.set_threads(3)
    assert intra_op.spans(N) == [(0, N // 3), (N // 3, 2 * N // 3), (2 * N // 3, N)]
    assert intra_op.spans(2 * intra_op.MIN_ROWS_PER_THREAD - 1) == [(0, 2 * intra_op.MIN_ROWS_PER_THREAD - 1)]
    seen: dict[int, int] = {}
    got = intra_op.run(N, lambda lo, hi: (seen.__setitem__(lo, threading.get_ident()), (lo, hi))[1])
    assert got == intra_op.spans(N)
    me = threading.get_ident()  # the caller runs span 0, the pool the others
    assert seen[0] == me and seen[N // 3] != me and seen[2 * N // 3] != me

    finished: list[int] = []

    def fail_first(lo: int, hi: int) -> int:
        if lo == 0:
            raise ValueError("span 0 failed")
        threading.Event().wait(0.2)  # the other spans still run when span 0 fails
        finished.append(lo)
        return lo

    with pytest.raises(ValueError, match="span 0 failed"):
        intra_op.run(N, fail_first)
    assert sorted(finished) == [N // 3, 2 * N // 3]  # every span had finished when run raised
    intra_op.set_threads(1)
    assert intra_op.spans(N) == [(0, N)]


def _spy_run(monkeypatch: pytest.MonkeyPatch) -> list[list[int]]:
    """Wraps ``intra_op.run``: one entry per call, the thread each of its spans ran on."""
    calls: list[list[int]] = []
    real = intra_op.run

    def run(n: int, fn):  # type: ignore[no-untyped-def]
        seen: list[int] = []
        calls.append(seen)

        def span(lo: int, hi: int):  # type: ignore[no-untyped-def]
            seen.append(threading.get_ident())
            return fn(lo, hi)

        return real(n, span)

    monkeypatch.setattr(intra_op, "run", run)
    return calls


def test_split_pull_and_push_equal_one_thread_bit_for_bit(threads: None, monkeypatch: pytest.MonkeyPatch) -> None:
    rng = np.random.default_rng(0)
    one, split = _table(), _table()
    calls = _spy_run(monkeypatch)
    for step in range(4):
        # unique ids, unsorted: known ones and (after step 0) a third never seen
        ids = rng.choice(3 * N, size=N, replace=False).astype(np.int64)
        g = rng.standard_normal((N, DIM)).astype(np.float32)
        intra_op.set_threads(1)
        r1 = one.push(ids, g)
        pull1 = one.pull(ids)
        intra_op.set_threads(3)
        calls.clear()
        r2 = split.push(ids, g)
        out = np.full((N, DIM), np.nan, dtype=np.float32)
        pull2 = split.pull(ids, out=out)
        # the push's lookup and update and the pull's lookup + gather each ran as 3 spans, not
        # all on the caller's thread (the pool may run both of its spans on one worker)
        assert [len(c) for c in calls] == [3, 3, 3], step
        assert all(set(c) != {threading.get_ident()} for c in calls), step
        assert r1 == r2, step
        np.testing.assert_array_equal(pull1, pull2)
        for k, v in _state(one).items():
            np.testing.assert_array_equal(v, _state(split)[k], err_msg=f"{k} after push {step}")
    # a pull with unknown ids in the last span: that span writes their initial rows, the others gather
    ids = np.concatenate([rng.choice(3 * N, size=N - 5, replace=False), np.arange(10**9, 10**9 + 5)]).astype(np.int64)
    intra_op.set_threads(1)
    ref = one.pull(ids)
    intra_op.set_threads(3)
    calls.clear()
    np.testing.assert_array_equal(split.pull(ids), ref)
    assert [len(c) for c in calls] == [3]


def test_split_through_real_shards(ps_fleet, threads: None) -> None:
    tables = [TableConfig(name="user", dim=DIM, capacity=4 * N,
                          optimizer=OptimizerConfig(kind=OptimizerKind.ROWWISE_ADAGRAD, lr=0.05))]
    rng = np.random.default_rng(1)
    pushes = [(rng.choice(2 * N, size=N, replace=False).astype(np.int64),
               rng.standard_normal((N, DIM)).astype(np.float32)) for _ in range(3)]
    known = rng.choice(np.unique(np.concatenate([ids for ids, _ in pushes])), size=N, replace=False)
    probes = {"known": known, "some unknown": rng.choice(3 * N, size=N, replace=False).astype(np.int64)}
    pulled = []
    for n_threads in (1, 2):
        intra_op.set_threads(n_threads)
        c = ps_fleet(1, tables=tables, max_request_rows=1 << 20).client()
        for ids, g in pushes:
            c.push({"user": (ids, g)})
        pulled.append({k: c.pull({"user": p})["user"] for k, p in probes.items()})
    for k in probes:
        np.testing.assert_array_equal(pulled[0][k], pulled[1][k], err_msg=k)


def test_bad_thread_counts_are_refused_naming_the_key() -> None:
    for bad in (0, 65, True, 2.0):
        with pytest.raises(ValueError, match=r"intra_op_threads must be an integer in \[1, 64\].*got"):
            PsConfig(intra_op_threads=bad).validate()  # type: ignore[arg-type]
        with pytest.raises(ValueError, match=r"intra_op_threads must be an integer in \[1, 64\]"):
            intra_op.set_threads(bad)  # type: ignore[arg-type]
    assert intra_op.threads() == 1
    PsConfig(intra_op_threads=4).validate()


def test_metaps_ps_applies_the_configured_thread_count(tmp_path) -> None:
    """``metaps ps`` sets ``[ps] intra_op_threads`` from the job (its log says so) and serves split requests."""
    from ps.client import PsClient
    from tests.ps.conftest import start_ps_process, write_job

    job = write_job(tmp_path, shards=1, dim=DIM, capacity=4 * N)
    job.write_text(job.read_text().replace("[ps]\n", "[ps]\nintra_op_threads = 2\n", 1))
    proc = start_ps_process(job, 0, tmp_path)
    try:
        assert 'msg="intra-op threads per request" threads=2' in proc.log()
        ids = np.arange(1, N + 1, dtype=np.int64)
        g = np.random.default_rng(0).standard_normal((N, DIM)).astype(np.float32)
        from common.rpc import RpcConfig
        from tests.ps.conftest import TOKEN

        with PsClient([proc.address], RpcConfig(token=TOKEN, timeout_s=20.0)) as c:
            c.push({"user": (ids, g)})
            before = c.pull({"user": ids})["user"]
            c.push({"user": (ids, np.zeros_like(g))})  # zero gradient: rowwise Adagrad leaves the rows as they are
            np.testing.assert_array_equal(c.pull({"user": ids})["user"], before)
    finally:
        proc.proc.kill()
        proc.proc.wait(30)
