"""No PS handler thread ever waits for another worker (issue 10, point 2).

A real shard with the default handler threads (``[ps] server_threads``) and 32
workers in this process: 31 fast workers wait on the staleness bound (or a
Barrier) for one slow worker. Their waits happen client-side, so the slow
worker's pushes keep being served; then everyone proceeds. On the old server
every waiting pull held one of the 8 handler threads, the slow worker's pushes
queued behind them and failed DEADLINE_EXCEEDED.
"""

from __future__ import annotations

import math
import threading
import time

import grpc
import numpy as np
import pytest

from common.rpc import RpcConfig
from ps.client import PsClient, PsStalenessTimeout
from ps.config import PsConfig
from ps.factory import build_server
from ps.types import ERROR_KEY, STALE_WAIT, WAIT_TIMEOUT_KEY
from protos import ps_pb2

from .conftest import TOKEN, sgd_tables

WORKERS = 32
SLOW_PUSHES = 6
DEFAULT_THREADS = PsConfig().server_threads
IDS = np.arange(16, dtype=np.int64)
GRAD = np.ones((16, 8), np.float32)


class _Shard:
    """One real shard with the default [ps] server_threads (not the fixtures' explicit 8)."""

    def __init__(self, **ps_kw) -> None:
        cfg = PsConfig(shards=1, num_vshards=32, device="cpu", **ps_kw)
        # A short per-call deadline on purpose: a push queued behind blocked handler threads misses it.
        self.rpc = RpcConfig(token=TOKEN, timeout_s=5.0)
        self.server = build_server(cfg, self.rpc, sgd_tables(), 0, wait_timeout_s=120.0)
        self.address = f"127.0.0.1:{self.server.start('127.0.0.1:0')}"
        self.clients: list[PsClient] = []

    def client(self, **kw) -> PsClient:
        c = PsClient([self.address], self.rpc, retry_timeout_s=60.0, **kw)
        self.clients.append(c)
        return c

    def workers(self, n: int) -> list[PsClient]:
        return [self.client(worker_id=f"w{k}", register=True) for k in range(n)]

    def pushed_rows(self) -> float:
        return (self.server.metrics.registry.get_sample_value("metaps_ps_rows_pushed_total", {"shard": "0", "table": "user"}) or 0)

    def deadline_errors(self) -> float:
        return sum(s.value for m in self.server.metrics.errors.collect() for s in m.samples
                   if s.name.endswith("_total") and s.labels.get("code") == "DEADLINE_EXCEEDED")

    def wait_answers(self) -> float:
        return sum(s.value for m in self.server.metrics.wait_answers.collect() for s in m.samples
                   if s.name.endswith("_total"))

    def until_all_wait(self, n: int, timeout: float = 30.0) -> None:
        """Poll until ``n`` callers have been told to wait (bounded: an old, blocking server never
        tells them; the test then goes on and shows what a blocked server does to pushes)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline and self.wait_answers() < n:
            time.sleep(0.05)

    def stop(self) -> None:
        for c in self.clients:
            c.close()
        self.server.stop(0)


def _start(targets: list) -> tuple[list[threading.Thread], list[BaseException]]:
    errors: list[BaseException] = []

    def wrap(fn):
        def run():
            try:
                fn()
            except BaseException as exc:  # noqa: BLE001 - reported by the test
                errors.append(exc)
        return run

    threads = [threading.Thread(target=wrap(t), daemon=True) for t in targets]
    for t in threads:
        t.start()
    return threads, errors


def test_fast_workers_waiting_on_staleness_do_not_starve_the_slow_workers_pushes() -> None:
    assert DEFAULT_THREADS < WORKERS - 1  # the old server had every thread held by a waiting pull
    shard = _Shard(max_staleness=1)
    try:
        clients = shard.workers(WORKERS)
        slow, fast = clients[0], clients[1:]
        init = slow.pull({"user": IDS})["user"]
        for c in fast:  # steps 0 and 1: at most 1 ahead of slow's clock 0, allowed
            for step in range(2):
                c.pull({"user": IDS}, step=step)
                c.push({"user": (IDS, GRAD)}, step=step)
        done = [threading.Event() for _ in fast]

        def fast_step2(c: PsClient, ev: threading.Event):
            return lambda: (c.pull({"user": IDS}, step=2), ev.set())  # 2 ahead of slow: must wait

        threads, errors = _start([fast_step2(c, ev) for c, ev in zip(fast, done)])
        shard.until_all_wait(len(fast))
        # 31 pulls wait; the slow worker's pushes are still served, each within its 5 s deadline.
        for _ in range(SLOW_PUSHES):
            slow.push({"user": (IDS, GRAD)})  # no step: slow's clock stays 0
        assert not any(ev.is_set() for ev in done), "the bound must still hold: slow has not finished step 0"
        slow.pull({"user": IDS}, step=0)
        slow.push({"user": (IDS, GRAD)}, step=0)  # completes step 0: releases everyone
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert all(ev.is_set() for ev in done)
        assert shard.deadline_errors() == 0
        assert shard.wait_answers() >= len(fast)  # every fast worker really waited
        pushes = 2 * len(fast) + SLOW_PUSHES + 1  # SGD lr 0.5, gradient 1: every push landed once
        np.testing.assert_allclose(slow.pull({"user": IDS})["user"], init - 0.5 * pushes, rtol=1e-5)
    finally:
        shard.stop()


def test_barrier_with_32_workers_does_not_starve_the_slow_workers_pushes() -> None:
    shard = _Shard(sync="sync")
    try:
        clients = shard.workers(WORKERS)
        slow, fast = clients[0], clients[1:]
        init = slow.pull({"user": IDS})["user"]
        for c in fast:
            c.push({"user": (IDS, GRAD)}, step=0)
        done = [threading.Event() for _ in fast]

        def barrier(c: PsClient, ev: threading.Event):
            return lambda: (c.barrier(0), ev.set())

        threads, errors = _start([barrier(c, ev) for c, ev in zip(fast, done)])
        shard.until_all_wait(len(fast))
        for _ in range(SLOW_PUSHES):
            slow.push({"user": (IDS, GRAD)})  # no step: the barrier stays closed
        assert not any(ev.is_set() for ev in done), "the barrier must hold until slow completes step 0"
        slow.push({"user": (IDS, GRAD)}, step=0)
        slow.barrier(0)
        for t in threads:
            t.join(120)
        assert not errors, errors
        assert all(ev.is_set() for ev in done)
        assert shard.wait_answers() >= len(fast)  # every fast worker really waited
        pushes = len(fast) + SLOW_PUSHES + 1
        assert shard.pushed_rows() == IDS.size * pushes
        np.testing.assert_allclose(slow.pull({"user": IDS})["user"], init - 0.5 * pushes, rtol=1e-5)
    finally:
        shard.stop()


def test_barrier_timeout_from_the_client_is_capped_or_refused() -> None:
    shard = _Shard(sync="sync")
    try:
        a, _b = shard.workers(2)
        stub = a.stub(0)
        for bad in (math.nan, math.inf, -1.0):
            with pytest.raises(grpc.RpcError) as err:
                stub.Barrier(ps_pb2.BarrierRequest(worker_id="w0", step=0, timeout_s=bad), timeout=10)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
            assert "timeout_s must be a finite number >= 0" in err.value.details()
        # 1e9 s: answered at once (no thread held), the wait it grants is capped to the shard's wait_timeout_s
        with pytest.raises(grpc.RpcError) as err:
            stub.Barrier(ps_pb2.BarrierRequest(worker_id="w0", step=0, timeout_s=1e9), timeout=10)
        md = dict(err.value.trailing_metadata())
        assert err.value.code() == grpc.StatusCode.ABORTED and md[ERROR_KEY] == STALE_WAIT
        assert float(md[WAIT_TIMEOUT_KEY]) == 120.0
        # the client honours the cap: with the shard's cap lowered, a 1e9 s barrier ends in a clear error
        shard.server.wait_timeout_s = 0.5
        with pytest.raises(PsStalenessTimeout, match="DEADLINE_EXCEEDED.*barrier of step 0.*slowest worker 'w1'"):
            a.barrier(0, timeout_s=1e9)
    finally:
        shard.stop()
