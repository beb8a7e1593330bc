"""Straggler detection, the ND and DD policies, and the controller applying their actions."""

from __future__ import annotations

import random
import time

import pytest

from controller.config import ControllerConfig, DdConfig, DdsConfig, MonitorConfig, NdConfig, PolicyKind
from controller.monitor import MonitorSnapshot, WindowStats
from controller.policy import make_policy
from controller.policy.base import (ActionKind, DetectOnlyPolicy, MoveVshards, RestartNode, SetBatchSizes,
                                    ShrinkShards, SlowDetected, StragglerDetector)
from controller.policy.dd import DdPolicy, proportional_batch_sizes
from controller.policy.nd import NdPolicy
from tests.controller.conftest import client

SIX = {0: 5.0, 1: 5.0, 2: 5.0, 3: 5.0, 4: 15.0, 5: 15.0}


def test_acceptance_five_five_five_five_fifteen_fifteen_flags_the_last_two() -> None:
    det = StragglerDetector(ratio=2.0, consecutive=3)
    for _ in range(3):
        verdicts = det.observe(SIX)
    assert det.flagged == {4, 5}
    assert verdicts[4].peer_median == 5.0 and verdicts[4].slow
    one = StragglerDetector(ratio=2.0, consecutive=1)
    one.observe(SIX)  # six workers in one window
    assert one.flagged == {4, 5}


def test_a_single_spike_flags_none() -> None:
    det = StragglerDetector(ratio=2.0, consecutive=3)
    det.observe({0: 5.0, 1: 5.0, 2: 5.0, 3: 5.0, 4: 5.0, 5: 15.0})
    for _ in range(5):
        det.observe({k: 5.0 for k in range(6)})
    assert det.flagged == set()
    det2 = StragglerDetector(ratio=2.0, consecutive=3)
    for values in (SIX, SIX, {k: 5.0 for k in range(6)}, SIX, SIX):  # interrupted streaks
        det2.observe(values)
    assert det2.flagged == set()


def test_threshold_is_configurable_and_missing_windows_keep_the_streak() -> None:
    det = StragglerDetector(ratio=4.0, consecutive=2)
    det.observe(SIX)
    det.observe(SIX)
    assert det.flagged == set()  # 15 / 5 = 3 < 4
    det = StragglerDetector(ratio=2.0, consecutive=2)
    det.observe(SIX)
    det.observe({k: v for k, v in SIX.items() if k != 5})  # worker 5 reported nothing
    det.observe(SIX)
    assert det.flagged == {4, 5}
    with pytest.raises(ValueError, match="ratio must be > 1.0"):
        StragglerDetector(ratio=1.0)


def snap(*windows: dict[int, float], ps: tuple[dict[int, float], ...] = ()) -> MonitorSnapshot:
    ws = []
    for i, w in enumerate(windows):
        ws.append(WindowStats(i, i, i + 1, worker_batch_time=w, ps_latency=ps[i] if i < len(ps) else {}))
    return MonitorSnapshot(float(len(windows)), tuple(ws))


def test_nd_shrinks_then_restarts_a_persistent_straggler() -> None:
    pol = NdPolicy(MonitorConfig(consecutive=3), NdConfig(restart_after=2))
    acts = pol.evaluate(snap(SIX, SIX), 2.0)
    assert acts == []
    acts = pol.evaluate(snap(SIX, SIX, SIX), 3.0)
    assert [(a.kind, a.node) for a in acts] == [
        (ActionKind.SLOW_DETECTED, "worker:4"), (ActionKind.SHRINK_SHARDS, "worker:4"), (ActionKind.RELEASE_CLOCK, "worker:4"),
        (ActionKind.SLOW_DETECTED, "worker:5"), (ActionKind.SHRINK_SHARDS, "worker:5"), (ActionKind.RELEASE_CLOCK, "worker:5")]
    assert acts[0].evidence["ratio"] == 3.0 and acts[0].evidence["streak"] == 3
    acts = pol.evaluate(snap(*[SIX] * 5), 5.0)
    assert sorted((a.index for a in acts if isinstance(a, RestartNode))) == [4, 5]


def test_nd_transient_slowdowns_take_no_action() -> None:
    pol = NdPolicy(MonitorConfig(consecutive=3), NdConfig())
    normal = {k: 5.0 for k in range(4)}
    windows = [normal, {**normal, 1: 20.0}, normal, {**normal, 2: 20.0}, {**normal, 2: 20.0}, normal, normal]
    assert pol.evaluate(snap(*windows, ps=tuple({0: 0.01, 1: 0.05 if i == 3 else 0.01} for i in range(7))), 7.0) == []


def test_nd_moves_vshards_away_from_a_slow_ps() -> None:
    pol = NdPolicy(MonitorConfig(consecutive=2), NdConfig(move_vshards=16, cooldown_windows=3))
    w = {0: 1.0, 1: 1.0}
    ps = ({0: 0.01, 1: 0.08, 2: 0.02},) * 6
    acts = pol.evaluate(snap(*[w] * 6, ps=ps), 6.0)
    moves = [a for a in acts if isinstance(a, MoveVshards)]
    assert [(m.src, m.dst, m.n) for m in moves] == [(1, 0, 16), (1, 0, 16)]  # windows 1 and 4 (cooldown 3)
    assert any(isinstance(a, SlowDetected) and a.node == "ps:1" for a in acts)


def test_dd_batch_sizes_always_sum_to_the_global_batch() -> None:
    rng = random.Random(1234)
    for _ in range(2000):
        n = rng.randint(1, 64)
        g = rng.randint(n, 5000)
        speeds = {i: rng.choice([rng.uniform(1e-3, 1e4), rng.lognormvariate(0, 3)]) for i in range(n)}
        sizes = proportional_batch_sizes(speeds, g)
        assert sum(sizes.values()) == g
        assert min(sizes.values()) >= 1
        exact = {k: g * v / sum(speeds.values()) for k, v in speeds.items()}
        if all(q >= 1 for q in exact.values()):  # nobody lifted to 1: within one of the exact share
            assert all(abs(sizes[k] - exact[k]) < 1.0 for k in speeds)
    assert proportional_batch_sizes({0: 100.0, 1: 100.0, 2: 100.0, 3: 50.0}, 352) == {0: 101, 1: 101, 2: 100, 3: 50}
    assert proportional_batch_sizes({0: 1000.0, 1: 1.0, 2: 1.0}, 10) == {0: 8, 1: 1, 2: 1}
    with pytest.raises(ValueError, match="global batch 2 is smaller than the 3 workers"):
        proportional_batch_sizes({0: 1.0, 1: 1.0, 2: 1.0}, 2)
    with pytest.raises(ValueError, match="speeds must be finite and > 0"):
        proportional_batch_sizes({0: 1.0, 1: float("nan")}, 8)


def test_dd_policy_rebalances_only_on_real_change() -> None:
    pol = DdPolicy(MonitorConfig(), DdConfig(global_batch=100, min_change=0.05, smoothing=1.0, damping=1.0))

    def window(i: int, sps: dict[int, float]) -> WindowStats:
        return WindowStats(i, i, i + 1, worker_samples_per_s=sps)

    ws = [window(0, {0: 100.0, 1: 100.0})]
    acts = [a for a in pol.evaluate(MonitorSnapshot(1, tuple(ws)), 1) if isinstance(a, SetBatchSizes)]
    assert acts[0].sizes == {0: 50, 1: 50}
    ws.append(window(1, {0: 101.0, 1: 99.0}))
    assert [a for a in pol.evaluate(MonitorSnapshot(2, tuple(ws)), 2) if isinstance(a, SetBatchSizes)] == []
    ws.append(window(2, {0: 100.0, 1: 50.0}))
    acts = [a for a in pol.evaluate(MonitorSnapshot(3, tuple(ws)), 3) if isinstance(a, SetBatchSizes)]
    assert acts[0].sizes == {0: 67, 1: 33}


class RecordingMover:
    def __init__(self) -> None:
        self.calls: list[tuple[int, int, int]] = []

    def move_vshards(self, src_ps: int, dst_ps: int, n_vshards: int) -> None:
        self.calls.append((src_ps, dst_ps, n_vshards))


def wait_for(pred, timeout: float = 10.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.02)


def test_controller_applies_nd_actions_and_records_events(controller) -> None:
    cfg = ControllerConfig(tick_s=0.05, policy=PolicyKind.ND, dds=DdsConfig(batches_per_shard=8, slow_shrink=4),
                           monitor=MonitorConfig(window_s=0.15, consecutive=2), nd=NdConfig(restart_after=2, move_vshards=4))
    mover = RecordingMover()
    srv = controller(cfg, ps_mover=mover)
    workers = [client(srv, i) for i in range(3)]
    agent = client(srv, 2, source="agent")
    ps = [client(srv, i, role="ps") for i in range(2)]
    restart = None
    deadline = time.monotonic() + 15
    while restart is None and time.monotonic() < deadline:
        for i, w in enumerate(workers):
            w.report_metrics(batch_times_s=[0.05 if i < 2 else 0.2], samples_per_s=100.0)
        for i, p in enumerate(ps):
            p.report_metrics(request_latency_s=0.01 if i == 0 else 0.05)
        restart = next((c for c in agent.heartbeat().commands if c.kind == "restart"), None)
        time.sleep(0.03)
    assert restart is not None and restart.reason == "persistently slow"
    assert srv.dds.shard_size(2) == 2 and srv.dds.shard_size(0) == 8
    assert srv.dds.get_shard(2, "train").lease.batches <= 2
    wait_for(lambda: (1, 0, 4) in mover.calls)
    st = workers[0].status()
    kinds = {(e["kind"], e["node"]) for e in st["events"]}
    assert {("slow_detected", "worker:2"), ("shrink_shards", "worker:2"), ("restart", "worker:2"),
            ("slow_detected", "ps:1"), ("move_vshards", "ps:1")} <= kinds
    ev = next(e for e in st["events"] if e["kind"] == "shrink_shards")
    assert ev["evidence"]["shard_size"] == 2 and ev["evidence"]["ratio"] >= 2.0 and ev["action"] == "shrink_shards"
    assert next(n for n in st["nodes"] if n["role"] == "worker" and n["index"] == 2)["slow"]
    wait_for(lambda: any(e.kind == "move_vshards_done" for e in srv.events.list()))


def test_controller_dd_batch_sizes_reach_the_worker(controller) -> None:
    cfg = ControllerConfig(tick_s=0.05, policy=PolicyKind.DD, monitor=MonitorConfig(window_s=0.1),
                           dd=DdConfig(global_batch=300, damping=1.0))
    srv = controller(cfg)
    workers = [client(srv, i) for i in range(3)]
    cmd = None
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        for i, w in enumerate(workers):
            w.report_metrics(samples_per_s=200.0 if i < 2 else 100.0)
        reply = workers[2].heartbeat()
        cmd = next((c for c in reply.commands if c.kind == "set_batch_size"), cmd)
        if cmd is not None and cmd.batch_size == 60:
            break
        time.sleep(0.03)
    assert cmd is not None and cmd.batch_size == 60
    assert workers[2].heartbeat().batch_size == 60
    assert workers[0].heartbeat().batch_size == 120
    ev = [e for e in srv.events.list() if e.kind == "set_batch_sizes"][-1]
    assert ev.evidence["sizes"] == {"0": 120, "1": 120, "2": 60}


def test_make_policy_builds_the_policy_the_config_names() -> None:
    nd = make_policy(ControllerConfig(policy=PolicyKind.ND, nd=NdConfig(move_vshards=3)))
    assert isinstance(nd, NdPolicy) and nd.cfg.move_vshards == 3
    assert isinstance(make_policy(ControllerConfig(policy=PolicyKind.DD)), DdPolicy)
    assert isinstance(make_policy(ControllerConfig(policy=PolicyKind.NONE)), DetectOnlyPolicy)
    assert isinstance(make_policy(ControllerConfig(policy="dd")), DdPolicy)  # a string from TOML still works
    with pytest.raises(ValueError, match=r"\[controller\] policy: unknown policy 'bogus'"):
        make_policy(ControllerConfig(policy="bogus"))  # type: ignore[arg-type]
