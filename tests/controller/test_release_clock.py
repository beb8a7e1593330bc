"""``[controller.nd] release_slow_clock``: the ND policy takes a flagged worker out of the PS
step clocks and puts it back when it recovers; the controller hands the worker the commands.

The worker side (a real fleet: the fast worker runs past the staleness bound) is
tests/workers/test_release_slow_clock.py.
"""

from __future__ import annotations

import time

import pytest

from controller.config import ControllerConfig, MonitorConfig, NdConfig, PolicyKind
from controller.monitor import MonitorSnapshot, WindowStats
from controller.policy.base import ActionKind
from controller.policy.nd import NdPolicy
from tests.controller.conftest import client

FAST = {0: 1.0, 1: 1.0, 2: 1.0}
SLOW2 = {0: 1.0, 1: 1.0, 2: 5.0}


def snap(*windows: dict[int, float]) -> MonitorSnapshot:
    return MonitorSnapshot(float(len(windows)),
                           tuple(WindowStats(i, i, i + 1, worker_batch_time=w) for i, w in enumerate(windows)))


def _clock_actions(pol: NdPolicy, *windows: dict[int, float]) -> list[tuple[ActionKind, str]]:
    return [(a.kind, a.node) for a in pol.evaluate(snap(*windows), float(len(windows)))
            if a.kind in (ActionKind.RELEASE_CLOCK, ActionKind.REJOIN_CLOCK)]


def test_nd_releases_a_flagged_worker_and_rejoins_it_on_recovery() -> None:
    pol = NdPolicy(MonitorConfig(consecutive=2), NdConfig(restart_after=0))
    assert NdConfig().release_slow_clock is True  # on by default
    assert _clock_actions(pol, SLOW2) == []  # one slow window: not flagged yet
    assert _clock_actions(pol, SLOW2, SLOW2) == [(ActionKind.RELEASE_CLOCK, "worker:2")]
    assert _clock_actions(pol, SLOW2, SLOW2, SLOW2) == []  # still flagged: nothing new
    assert _clock_actions(pol, SLOW2, SLOW2, SLOW2, FAST) == [(ActionKind.REJOIN_CLOCK, "worker:2")]


def test_nd_keeps_the_clock_when_the_key_is_off() -> None:
    pol = NdPolicy(MonitorConfig(consecutive=2), NdConfig(restart_after=0, release_slow_clock=False))
    kinds = [a.kind for a in pol.evaluate(snap(SLOW2, SLOW2, SLOW2, FAST), 4.0)]
    assert ActionKind.SHRINK_SHARDS in kinds and ActionKind.RESTORE_SHARDS in kinds
    assert ActionKind.RELEASE_CLOCK not in kinds and ActionKind.REJOIN_CLOCK not in kinds


def test_release_slow_clock_must_be_a_bool() -> None:
    with pytest.raises(ValueError, match=r"nd\.release_slow_clock must be true or false, got 1"):
        NdConfig(release_slow_clock=1).validate()  # type: ignore[arg-type]


def test_controller_sends_release_then_rejoin_to_the_worker_process(controller) -> None:
    cfg = ControllerConfig(tick_s=0.05, policy=PolicyKind.ND, monitor=MonitorConfig(window_s=0.15, consecutive=2),
                           nd=NdConfig(restart_after=0, move_vshards=0))
    srv = controller(cfg)
    workers = [client(srv, i) for i in range(3)]
    got: list[str] = []
    deadline = time.monotonic() + 60
    while got[-1:] != ["rejoin_clock"]:
        assert time.monotonic() < deadline, f"commands seen: {got}; events: {[e.kind for e in srv.events.list()]}"
        slow = "release_clock" not in got  # slow until released, then fast again
        for i, w in enumerate(workers):
            w.report_metrics(batch_times_s=[0.2 if (i == 2 and slow) else 0.05], samples_per_s=100.0)
        got += [c.kind for c in workers[2].heartbeat().commands if c.kind.endswith("_clock")]
        for w in workers[:2]:
            assert not [c for c in w.heartbeat().commands if c.kind.endswith("_clock")]
        time.sleep(0.03)
    assert got == ["release_clock", "rejoin_clock"]
    ev = [(e.node, e.kind, e.action) for e in srv.events.list() if e.kind.endswith("_clock")]
    assert ev == [("worker:2", "release_clock", "release_clock"), ("worker:2", "rejoin_clock", "rejoin_clock")]
