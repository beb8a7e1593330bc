"""PsServer: health, metrics, stats, fault hook, staleness, sync barrier, SIGTERM."""

from __future__ import annotations

import signal
import threading
import time
import urllib.request

import grpc
import numpy as np
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

from ps.client import PsRequestError
from ps.config import OptimizerConfig, OptimizerKind, TableConfig
from ps.shard_store import ShardStore
from ps.staleness import StalenessTimeout, StepClock

from .conftest import start_ps_process, write_job


def test_health_serving_and_not_serving_after_stop(ps_fleet) -> None:
    fleet = ps_fleet(1)
    with grpc.insecure_channel(fleet.addresses[0]) as ch:  # health needs no token
        stub = health_pb2_grpc.HealthStub(ch)
        assert stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status == health_pb2.HealthCheckResponse.SERVING


def test_metrics_and_stats(ps_fleet) -> None:
    fleet = ps_fleet(2)
    client = fleet.client()
    ids = np.arange(100, dtype=np.int64)
    client.push({"user": (ids, np.ones((100, 8), np.float32))})
    client.pull({"user": ids, "item": ids})
    pushed = pulled = 0.0
    for s in fleet.servers:
        reg, sh = s.metrics.registry, str(s.shard_id)
        pushed += reg.get_sample_value("metaps_ps_rows_pushed_total", {"shard": sh, "table": "user"})
        pulled += reg.get_sample_value("metaps_ps_rows_pulled_total", {"shard": sh, "table": "item"})
        assert reg.get_sample_value("metaps_ps_rpc_seconds_count", {"shard": sh, "method": "PushMany"}) >= 1
        assert reg.get_sample_value("metaps_ps_table_rows", {"shard": sh, "table": "user"}) > 0  # table fill
        assert reg.get_sample_value("metaps_ps_memory_bytes", {"shard": sh}) > 0
        assert reg.get_sample_value("metaps_ps_map_version", {"shard": sh}) == 0
        for table, method in (("user", "PushMany"), ("user", "PullMany"), ("item", "PullMany")):  # per table (issue 14)
            labels = {"shard": sh, "table": table, "method": method}
            assert reg.get_sample_value("metaps_ps_table_requests_total", labels) == 1
            assert reg.get_sample_value("metaps_ps_table_rpc_seconds_count", labels) == 1
        assert reg.get_sample_value("metaps_ps_table_requests_total", {"shard": sh, "table": "item", "method": "PushMany"}) is None
    assert pushed == 100 and pulled == 100
    stats = client.stats()
    assert [s["shard"] for s in stats] == [0, 1]
    assert sum(s["store"]["tables"]["user"]["rows"] for s in stats) == 100


def test_added_latency_hook_delays_data_rpcs(ps_fleet) -> None:
    calls = []

    def delay() -> float:
        calls.append(1)
        return 0.2

    fleet = ps_fleet(1, server_kw={"added_latency_s": delay})
    client = fleet.client()
    t0 = time.perf_counter()
    client.pull({"user": np.arange(5)})
    assert time.perf_counter() - t0 >= 0.2 and calls


def test_step_clock_bounds() -> None:
    clock = StepClock(max_staleness=1)
    clock.register("a")
    clock.register("b")
    clock.wait_pull("a", 1, 0.1)  # 1 <= 0 + 1
    with pytest.raises(StalenessTimeout, match="slowest worker 'a' has completed 0 steps"):
        clock.wait_pull("a", 2, 0.2)
    clock.advance("a", 0)
    clock.advance("b", 0)
    clock.wait_pull("a", 2, 0.1)
    clock.leave("b")
    assert clock.min_clock() == 1


def test_bounded_staleness_blocks_a_fast_worker(ps_fleet) -> None:
    fleet = ps_fleet(2, max_staleness=1)
    fast = fleet.client(worker_id="fast", register=True)
    slow = fleet.client(worker_id="slow", register=True)
    ids = np.arange(20, dtype=np.int64)
    g = np.ones((20, 8), np.float32)
    fast.pull({"user": ids}, step=0)
    fast.push({"user": (ids, g)}, step=0)
    fast.pull({"user": ids}, step=1)  # 1 step ahead: allowed
    fast.push({"user": (ids, g)}, step=1)
    result: dict[str, float] = {}

    def pull_step2() -> None:
        t0 = time.perf_counter()
        fast.pull({"user": ids}, step=2)  # 2 ahead of slow (clock 0): must wait
        result["waited"] = time.perf_counter() - t0

    t = threading.Thread(target=pull_step2)
    t.start()
    time.sleep(0.6)
    assert "waited" not in result
    slow.pull({"user": ids}, step=0)
    slow.push({"user": (ids, g)}, step=0)  # slow completes step 0 on every shard
    t.join(10)
    assert result["waited"] >= 0.5
    slow.close(leave=True)
    fast.pull({"user": ids}, step=3)  # only its own clock (2) bounds it now


def test_an_idle_worker_leaves_the_clock_and_rejoins(ps_fleet) -> None:
    """A worker waiting for data must not hold back the others (then it counts again)."""
    fleet = ps_fleet(2, max_staleness=1)
    fast = fleet.client(worker_id="fast", register=True)
    idle = fleet.client(worker_id="idle", register=True)
    ids = np.arange(20, dtype=np.int64)
    g = np.ones((20, 8), np.float32)
    for step in range(2):
        fast.pull({"user": ids}, step=step)
        fast.push({"user": (ids, g)}, step=step)
    done = threading.Event()
    t = threading.Thread(target=lambda: (fast.pull({"user": ids}, step=2), done.set()))
    t.start()
    assert not done.wait(0.5), "the fast worker should wait for the idle one"
    idle.leave_clock()
    assert done.wait(10), "leaving the clock must release the fast worker"
    t.join(10)
    fast.push({"user": (ids, g)}, step=2)
    idle.join_clock(3)  # back from the data queue at step 3: counts again
    fast.pull({"user": ids}, step=4)  # 1 ahead of the rejoined clock: allowed


def test_staleness_timeout_is_a_clear_error(ps_fleet) -> None:
    fleet = ps_fleet(1, max_staleness=0)
    for s in fleet.servers:
        s.wait_timeout_s = 0.5
    a = fleet.client(worker_id="a", register=True)
    fleet.client(worker_id="b", register=True)
    with pytest.raises(PsRequestError, match="DEADLINE_EXCEEDED.*worker 'a' pulling step 1 is more than 0 steps ahead"):
        a.pull({"user": np.arange(3)}, step=1)


def _adagrad() -> list[TableConfig]:
    opt = OptimizerConfig(kind=OptimizerKind.ROWWISE_ADAGRAD, lr=0.1)
    return [TableConfig(name="user", dim=8, capacity=1024, optimizer=opt),
            TableConfig(name="item", dim=4, capacity=1024, optimizer=opt)]


def test_sync_one_worker_equals_single_process(ps_fleet) -> None:
    fleet = ps_fleet(3, tables=_adagrad(), sync="sync")
    worker = fleet.client(worker_id="w0", register=True)
    local = ShardStore(_adagrad(), shard_id=0, num_vshards=1, seed=0)
    rng = np.random.default_rng(3)
    ids = rng.integers(0, 1000, 64)
    for step in range(5):
        rows = worker.pull({"user": ids}, step=step)["user"]
        np.testing.assert_allclose(rows, local.pull("user", ids), rtol=0, atol=1e-6)
        grads = (rows * 0.5 + rng.standard_normal(rows.shape)).astype(np.float32)  # depends on the pulled rows
        worker.push({"user": (ids, grads)}, step=step)
        worker.barrier(step)
        local.push("user", ids, grads)
    np.testing.assert_allclose(worker.pull({"user": ids})["user"], local.pull("user", ids), rtol=0, atol=1e-6)


def test_sync_barrier_waits_for_every_worker(ps_fleet) -> None:
    fleet = ps_fleet(2, sync="sync")
    a = fleet.client(worker_id="a", register=True)
    b = fleet.client(worker_id="b", register=True)
    ids = np.arange(10, dtype=np.int64)
    g = np.ones((10, 8), np.float32)
    done = threading.Event()
    a.push({"user": (ids, g)}, step=0)
    t = threading.Thread(target=lambda: (a.barrier(0, timeout_s=10), done.set()))
    t.start()
    time.sleep(0.4)
    assert not done.is_set()  # b has not finished step 0
    before = a.pull({"user": ids})["user"]
    b.push({"user": (ids, g)}, step=0)
    assert done.wait(10)
    t.join()
    np.testing.assert_allclose(a.pull({"user": ids})["user"], before - 0.5, rtol=1e-6)  # b's step-0 push is in


def test_sigterm_exits_cleanly(tmp_path) -> None:
    job = write_job(tmp_path, shards=1)
    proc = start_ps_process(job, 0, tmp_path)
    body = urllib.request.urlopen(f"http://127.0.0.1:{proc.metrics_port}/metrics", timeout=10).read().decode()
    assert "metaps_ps_map_version" in body  # the process serves Prometheus
    with grpc.insecure_channel(proc.address) as ch:
        status = health_pb2_grpc.HealthStub(ch).Check(health_pb2.HealthCheckRequest(), timeout=10).status
    assert status == health_pb2.HealthCheckResponse.SERVING
    proc.proc.send_signal(signal.SIGTERM)
    assert proc.proc.wait(60) == 0
    assert "ps exited cleanly" in proc.log()
