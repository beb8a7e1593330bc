"""PsClient: dedup, order, fp16, async, concurrency, dense, retry across a PS restart."""

from __future__ import annotations

import logging
import threading
import time

import numpy as np
import pytest
import torch

from ps.client import PsClient, PsUnavailableError
from ps.config import OptimizerConfig
from ps.factory import build_server


def test_pull_dedups_and_keeps_request_order(ps_fleet) -> None:
    fleet = ps_fleet(3)
    client = fleet.client()
    ids = np.array([[9, 3, 9], [7, 3, 1_000_000_007]], dtype=np.int64)
    rows = client.pull({"user": ids, "item": torch.tensor([5, 5, 2])})
    assert rows["user"].shape == (6, 8) and rows["item"].shape == (3, 4)
    np.testing.assert_array_equal(rows["user"][0], rows["user"][2])
    np.testing.assert_array_equal(rows["user"][1], rows["user"][4])
    single = np.stack([client.pull({"user": np.array([i])})["user"][0] for i in ids.reshape(-1)])
    np.testing.assert_array_equal(rows["user"], single)
    # Each unique id crossed the wire once.
    pulled = sum(s.metrics.registry.get_sample_value("metaps_ps_rows_pulled_total", {"shard": str(s.shard_id), "table": "user"}) or 0
                 for s in fleet.servers)
    assert pulled == 4 + 6  # 4 unique in the batch, then 6 single pulls
    empty = client.pull({"user": np.array([], dtype=np.int64)})["user"]
    assert empty.shape == (0, 8)


def test_push_aggregates_duplicates(ps_fleet) -> None:
    client = ps_fleet(2).client()
    ids = np.array([4, 4, 4, 8], dtype=np.int64)
    before = client.pull({"user": ids})["user"]
    g = np.stack([np.full(8, v, np.float32) for v in (1.0, 2.0, 3.0, 1.0)])
    counts = client.push({"user": (ids, g)})["user"]
    assert counts["rows"] == 2 and counts["applied"] == 2  # unique ids on the wire
    after = client.pull({"user": ids})["user"]
    np.testing.assert_allclose(after[0], before[0] - 0.5 * 6.0, rtol=1e-6)  # SGD lr 0.5, summed grad 6
    np.testing.assert_allclose(after[3], before[3] - 0.5 * 1.0, rtol=1e-6)


def test_fp16_values_and_grads(ps_fleet) -> None:
    fleet = ps_fleet(2)
    c32 = fleet.client()
    c16 = fleet.client(value_dtype="fp16", grad_dtype="fp16")
    ids = np.arange(50, dtype=np.int64)
    r32, r16 = c32.pull({"user": ids})["user"], c16.pull({"user": ids})["user"]
    assert r16.dtype == np.float32
    np.testing.assert_allclose(r16, r32, rtol=1e-3, atol=1e-6)
    c16.push({"user": (ids, np.full((50, 8), 0.25, np.float32))})  # 0.25 is exact in fp16
    np.testing.assert_allclose(c32.pull({"user": ids})["user"], r32 - 0.125, rtol=1e-6)


def test_pull_async_overlaps(ps_fleet) -> None:
    client = ps_fleet(2).client()
    ids = np.arange(100, dtype=np.int64)
    fut = client.pull_async({"user": ids})
    ids[:] = 0  # the caller may reuse its buffer: the async pull copied it
    rows = fut.result(timeout=20)["user"]
    np.testing.assert_array_equal(rows, client.pull({"user": np.arange(100)})["user"])


def test_concurrent_clients_sum_of_updates(ps_fleet) -> None:
    fleet = ps_fleet(3)
    ids = np.arange(64, dtype=np.int64)
    before = fleet.client().pull({"user": ids, "item": ids})
    workers, steps = 4, 15
    errors: list[BaseException] = []

    def work(w: int) -> None:
        try:
            c = fleet.client()
            for s in range(steps):
                c.push({"user": (ids, np.full((64, 8), w + 1, np.float32)),
                        "item": (ids[::2], np.full((32, 4), 1.0, np.float32))})
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=work, args=(w,)) for w in range(workers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors, errors
    after = fleet.client().pull({"user": ids, "item": ids})
    total_user = steps * sum(range(1, workers + 1))
    np.testing.assert_allclose(after["user"], before["user"] - 0.5 * total_user, rtol=1e-5)
    np.testing.assert_allclose(after["item"][::2], before["item"][::2] - 0.5 * workers * steps, rtol=1e-5)
    np.testing.assert_array_equal(after["item"][1::2], before["item"][1::2])


def test_dense_register_pull_push(ps_fleet) -> None:
    fleet = ps_fleet(3, dense_optimizer=OptimizerConfig(kind="sgd", lr=0.1))
    client = fleet.client()
    params = {f"layer{i}.weight": np.full((2, 3), float(i), np.float32) for i in range(5)}
    assert sorted(client.register_dense(params)) == sorted(params)
    assert client.register_dense({"layer0.weight": np.zeros((2, 3), np.float32)}) == []  # existing keeps its value
    got = client.pull_dense(params)
    for k, v in params.items():
        np.testing.assert_array_equal(got[k], v)
    client.push_dense({k: np.ones((2, 3), np.float32) for k in params})
    got = client.pull_dense(list(params))
    for k, v in params.items():
        np.testing.assert_allclose(got[k], v - 0.1, rtol=1e-6)
    holders = [len(s.store.dense.names()) for s in fleet.servers]
    assert sum(holders) == 5 and max(holders) < 5  # spread by name over shards


def test_set_dense_overwrites_and_registers(ps_fleet) -> None:
    fleet = ps_fleet(2, dense_optimizer=OptimizerConfig(kind="sgd", lr=0.1))
    client = fleet.client()
    client.register_dense({"w": np.zeros((2, 2), np.float32)})
    client.set_dense({"w": np.full((2, 2), 3.0, np.float32), "b": np.ones(4, np.float32)})
    got = client.pull_dense(["w", "b"])
    np.testing.assert_array_equal(got["w"], np.full((2, 2), 3.0, np.float32))
    np.testing.assert_array_equal(got["b"], np.ones(4, np.float32))


def test_retry_across_ps_restart(ps_fleet, caplog) -> None:
    fleet = ps_fleet(1)
    client = fleet.client(backoff_s=0.05, max_backoff_s=0.3)
    ids = np.arange(10, dtype=np.int64)
    client.push({"user": (ids, np.ones((10, 8), np.float32))})
    port = fleet.servers[0].port
    fleet.servers[0].stop(0)

    def restart() -> None:
        time.sleep(1.0)
        s = build_server(fleet.ps_cfg, fleet.rpc, fleet.tables, 0)
        s.start(f"127.0.0.1:{port}")
        fleet.servers.append(s)

    t = threading.Thread(target=restart)
    t.start()
    with caplog.at_level(logging.INFO, logger="ps.client"):
        rows = client.pull({"user": ids})["user"]  # blocks through the restart
    t.join()
    assert rows.shape == (10, 8)
    msgs = [r.getMessage() for r in caplog.records]
    assert any("unavailable; retrying" in m for m in msgs), msgs
    assert any("reachable again" in m for m in msgs), msgs
    client.push({"user": (ids, np.ones((10, 8), np.float32))})  # and training continues


def test_unavailable_beyond_budget_raises(ps_fleet) -> None:
    fleet = ps_fleet(1)
    client = fleet.client(retry_timeout_s=1.0, backoff_s=0.05)
    fleet.servers[0].stop(0)
    with pytest.raises(PsUnavailableError, match="could not complete within 1s"):
        client.pull({"user": np.arange(3)})
    with pytest.raises(PsUnavailableError, match="no PS shard reachable"):
        PsClient(fleet.addresses, fleet.rpc, retry_timeout_s=0.5)
