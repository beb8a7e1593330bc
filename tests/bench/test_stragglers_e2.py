"""E2's per-window accounting (issue 11 point 3): requests per PS, CPU per process, paired ratios.

The counters are read the way the benchmark reads them: a real PS shard's Prometheus
endpoint over loopback, this process's ``/proc`` files. The pairing is checked on
windows built by hand, in ABBA order (the second pair has its fault-off window first).
"""

from __future__ import annotations

import os
import threading
import time
from typing import Any

import numpy as np
import pytest
from prometheus_client import start_http_server

from bench.procstat import stat_cpu_s
from bench.stragglers import _e2_accounting, _e2_snapshot, _e2_window_figures, _ps_requests, _ratio_stats
from tests.ps.conftest import start_fleet


def test_ps_requests_counts_data_and_other_rpcs_of_a_real_shard() -> None:
    fleet = start_fleet(1)
    http, thread = start_http_server(0, addr="127.0.0.1", registry=fleet.servers[0].metrics.registry)
    try:
        port = http.server_port
        before = _ps_requests(port)
        c = fleet.client()
        ids = np.arange(10, dtype=np.int64)
        c.pull({"user": ids})
        c.pull({"user": ids})
        c.push({"user": (ids, np.ones((10, 8), np.float32))})
        c.stats()
        after = _ps_requests(port)
        delta = {m: after.get(m, 0) - before.get(m, 0) for m in after}
        assert delta.get("PullMany") == 2 and delta.get("PushMany") == 1 and delta.get("Stats") == 1, delta
        snap = _e2_snapshot([os.getpid()], [port], [threading.get_native_id()])
        assert snap["requests"][0] == after
        assert snap["cpu"]["ps0"] == pytest.approx(snap["cpu"]["bench"], abs=0.5)  # the same process here
    finally:
        http.shutdown()
        fleet.stop()


def test_thread_cpu_from_proc_matches_the_thread_clock() -> None:
    t0 = time.thread_time()
    x = 0
    for i in range(2_000_000):  # some CPU in this thread
        x += i
    own = time.thread_time()
    got = stat_cpu_s(f"/proc/{os.getpid()}/task/{threading.get_native_id()}/stat")
    # /proc counts whole clock ticks (10 ms); the thread clock is exact
    assert got == pytest.approx(own, abs=0.05)
    assert own > t0


def _snap(t: float, steps_cpu: float, ps1_cpu: float, data1: int, stats1: int) -> dict[str, Any]:
    return {"t": t, "box_busy": int(t * 100), "box_total": int(t * 200),
            "cpu": {"ps0": t * 0.5, "ps1": ps1_cpu, "bench": steps_cpu, "clients": steps_cpu / 2},
            "requests": [{"PullMany": int(t * 10), "Stats": 0}, {"PullMany": data1, "Stats": stats1}]}


def test_window_figures_pair_on_with_off_in_abba_order() -> None:
    on = [True, False, False, True]
    # 4 windows of 2 s at t = 0-2, 2-4, 4-6, 6-8 (s); steps: 20, 10, 10, 30 (Hz 10, 5, 5, 15)
    done = [list(np.arange(0.05, 2, 0.1)) + list(np.arange(2.1, 4, 0.2)) + list(np.arange(4.1, 6, 0.2))
            + list(np.arange(6.0 + 1 / 30, 8, 1 / 15))]
    bench_cpu = [0.0, 1.0, 2.0, 4.0, 6.0]  # bench CPU-s at 0, 2, 4, 6, 8: windows use 1, 1, 2, 2
    ps1_cpu = [0.0, 0.2, 0.6, 1.0, 1.2]     # PS 1 uses 0.2, 0.4, 0.4, 0.2
    data1 = [0, 0, 0, 0, 3]                 # 3 data requests reach PS 1 in the last (fault-on) window
    stats1 = [0, 1, 2, 3, 4]
    snaps = [_snap(2.0 * k, bench_cpu[k], ps1_cpu[k], data1[k], stats1[k]) for k in range(5)]
    samples = [(snaps[k], snaps[k + 1]) for k in range(4)]
    got = _e2_window_figures(samples, done, on)
    assert [w["steps"] for w in got["windows"]] == [20, 10, 10, 30]
    # pair 0: on = window 0 (10 Hz), off = window 1 (5 Hz); pair 1: on = window 3 (15), off = window 2 (5)
    assert got["paired_wall"] == pytest.approx([2.0, 3.0])
    # per client CPU-second: window steps / (bench CPU / 2): 40, 20, 10, 30 -> 2.0, 3.0
    assert got["paired_per_client_cpu"] == pytest.approx([2.0, 3.0])
    # per fleet CPU-second: steps / (ps0 1.0 + ps1 + bench)
    fleet = [20 / (1 + 0.2 + 1), 10 / (1 + 0.4 + 1), 10 / (1 + 0.4 + 2), 30 / (1 + 0.2 + 2)]
    assert got["paired_per_fleet_cpu"] == pytest.approx([fleet[0] / fleet[1], fleet[3] / fleet[2]])
    assert got["ps1_cpu_share_on_minus_off"] == pytest.approx([0.1 - 0.2, 0.1 - 0.2])
    assert [w["requests"][1]["data"] for w in got["windows"]] == [0, 0, 0, 3]
    assert all(w["requests"][1]["other"] == {"Stats": 1} for w in got["windows"])
    assert got["windows"][0]["box_busy"] == pytest.approx(0.5)

    acct = _e2_accounting([got | {"windows": got["windows"]}])
    assert acct["on"]["ps_data_requests"] == [20 + 20, 3] and acct["off"]["ps_data_requests"] == [40, 0]
    assert acct["on"]["ps_other_requests"][1] == {"Stats": 2}
    assert acct["paired_wall"]["pairs"] == 2 and acct["paired_wall"]["above_1"] == 2
    assert acct["on"]["cpu_share"]["ps1"] == pytest.approx(0.4 / 4)


def test_ratio_stats_interval_and_sign_test() -> None:
    same = _ratio_stats([1.1, 0.9, 1.2, 1 / 1.2, 1 / 1.1, 1 / 0.9])
    assert same["geo_mean"] == pytest.approx(1.0)
    lo, hi = same["ci95"]
    assert lo < 1.0 < hi
    assert same["sign_p"] == pytest.approx(1.0)
    up = _ratio_stats([1.2] * 10)
    assert up["ci95"] == pytest.approx([1.2, 1.2]) and up["sign_p"] == pytest.approx(2 / 2 ** 10, abs=1e-4)
    # 8 of 12 above 1: p = 2 * P(X <= 4 | n=12) = 2 * 794 / 4096
    assert _ratio_stats([1.1] * 8 + [0.9] * 4)["sign_p"] == pytest.approx(2 * 794 / 4096, abs=1e-4)
