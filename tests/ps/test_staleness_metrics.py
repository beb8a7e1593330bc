"""The staleness bound at work, as an operator sees it (issue 14).

Real gRPC shards on 127.0.0.1 with ``max_staleness = 1``: worker-0 runs two
steps ahead of worker-1, so its pull of step 2 is held back. While it waits:

* the worker side counts the wait (``PsClient.waits`` -> the worker's
  ``metaps_worker_stale_waits_total`` / ``..._stale_wait_seconds_total``), a wait
  in progress included;
* each shard shows both clocks and worker-1's lag behind the fastest clock
  (``metaps_ps_worker_clock`` / ``metaps_ps_worker_clock_lag``) and the bound.

Then worker-1 steps, worker-0's pull goes through, and the wait is closed.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path
from typing import Any, Callable

import numpy as np
from prometheus_client import REGISTRY

from tests.ps.conftest import Fleet
from workers.row_source import RemoteRowSource
from workers.telemetry import CountingRowSource, Telemetry

DEADLINE_S = 60.0


def _until(what: str, fn: Callable[[], Any]) -> Any:
    deadline = time.monotonic() + DEADLINE_S
    while time.monotonic() < deadline:
        v = fn()
        if v:
            return v
        time.sleep(0.02)
    raise AssertionError(f"no {what} within {DEADLINE_S}s (last: {fn()!r})")


def _push(client: Any, step: int) -> None:
    ids = np.arange(4, dtype=np.int64)
    client.push({"user": (ids, np.zeros((4, 8), np.float32))}, step=step)


def test_a_worker_held_back_by_the_bound_shows_its_wait_and_the_ps_shows_the_lag(
        ps_fleet: Callable[..., Fleet], tmp_path: Path) -> None:
    fleet = ps_fleet(2, max_staleness=1)
    fast = fleet.client(worker_id="worker-0", register=True, wait_timeout_s=120.0)
    slow = fleet.client(worker_id="worker-1", register=True, wait_timeout_s=120.0)
    tel = Telemetry(tmp_path / "run", rank=70, every=0)
    rows = CountingRowSource(RemoteRowSource(fast), tel)

    def worker_waits(kind: str) -> tuple[float | None, float | None]:
        labels = {"rank": "70", "kind": kind}
        return (REGISTRY.get_sample_value("metaps_worker_stale_waits_total", labels),
                REGISTRY.get_sample_value("metaps_worker_stale_wait_seconds_total", labels))

    def ps_gauge(shard: int, name: str, **labels: str) -> float | None:
        return fleet.servers[shard].metrics.registry.get_sample_value(name, {"shard": str(shard), **labels})

    ids = {"user": np.arange(4, dtype=np.int64)}
    rows.pull(ids, step=0)
    _push(fast, 0)
    rows.pull(ids, step=1)
    _push(fast, 1)  # worker-0 completed 2 steps, worker-1 none
    assert worker_waits("pull") == (None, None)  # not held back so far
    done = threading.Event()
    errors: list[BaseException] = []

    def step_2() -> None:
        try:
            rows.pull(ids, step=2)  # 2 > min clock 0 + bound 1: waits for worker-1
        except BaseException as exc:  # noqa: BLE001 - reported by the test thread
            errors.append(exc)
        finally:
            done.set()

    t = threading.Thread(target=step_2, daemon=True)
    t.start()
    try:
        # the wait shows while it lasts: counted at once, its seconds growing
        _until("a wait in progress on the worker", lambda: (worker_waits("pull")[0] or 0) >= 1)
        first_s = worker_waits("pull")[1] or 0.0
        _until("the wait's seconds growing", lambda: (worker_waits("pull")[1] or 0.0) > first_s)
        assert not done.is_set(), errors
        for shard in range(2):
            assert ps_gauge(shard, "metaps_ps_worker_clock", worker="worker-0") == 2
            assert ps_gauge(shard, "metaps_ps_worker_clock", worker="worker-1") == 0
            assert ps_gauge(shard, "metaps_ps_worker_clock_lag", worker="worker-1") == 2
            assert ps_gauge(shard, "metaps_ps_worker_clock_lag", worker="worker-0") == 0
            assert ps_gauge(shard, "metaps_ps_max_staleness") == 1
    finally:
        _push(slow, 0)  # worker-1 completes step 0: the bound lets worker-0 pull step 2
        assert done.wait(DEADLINE_S), "worker-0's pull never went through"
        t.join(DEADLINE_S)
    assert not errors, errors
    n, secs = worker_waits("pull")
    assert n == 1 and secs is not None and secs > 0
    assert fast.waits.totals()["pull"][0] == 1 and "pull" not in slow.waits.totals()
    assert ps_gauge(0, "metaps_ps_worker_clock_lag", worker="worker-1") == 1
    # the wait is closed: its seconds no longer grow
    assert fast.waits.totals()["pull"] == fast.waits.totals()["pull"]
    assert worker_waits("pull") == worker_waits("pull")


def test_barrier_waits_are_counted(ps_fleet: Callable[..., Fleet]) -> None:
    fleet = ps_fleet(1, sync="sync")
    a = fleet.client(worker_id="worker-0", register=True, wait_timeout_s=120.0)
    b = fleet.client(worker_id="worker-1", register=True, wait_timeout_s=120.0)
    t = threading.Thread(target=a.barrier, args=(0,), daemon=True)
    t.start()
    _until("worker-0 waiting at the barrier", lambda: a.waits.totals().get("barrier", (0, 0.0))[0] >= 1)
    b.barrier(0)
    t.join(DEADLINE_S)
    assert not t.is_alive()
    n, secs = a.waits.totals()["barrier"]
    assert n == 1 and secs > 0
