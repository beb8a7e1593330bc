"""Fault injection config and helpers."""

from __future__ import annotations

import pytest

from common.config import from_mapping
from common.errors import ConfigError
from common.faults import Fault, FaultConfig, FaultInjector


def test_toml_shape_and_helpers() -> None:
    cfg = from_mapping(FaultConfig, {"faults": [
        {"target": "worker", "index": 1, "kind": "slow", "factor": 4.0, "start_s": 10.0, "duration_s": 5.0},
        {"target": "ps", "index": 0, "kind": "latency", "latency_s": 0.02},
        {"target": "worker", "index": 1, "kind": "kill", "at_s": 30.0},
    ]}, where="job.toml", prefix="faults")
    w = FaultInjector(cfg, "worker", 1, t0=0.0, clock=lambda: 0.0)
    assert w.step_delay(0.5, now=9.0) == 0.0
    assert w.step_delay(0.5, now=12.0) == pytest.approx(1.5)  # 0.5 s step x4 -> sleep 1.5 s more
    assert w.step_delay(0.5, now=15.0) == 0.0  # duration over
    assert not w.kill_due(now=29.9) and w.kill_due(now=30.0)
    assert w.kill_due(now=31.0, born=2.0)  # alive at at_s: dies
    assert not w.kill_due(now=45.0, born=31.0)  # its replacement, started after at_s, is spared
    assert w.added_latency(now=12.0) == 0.0
    ps = FaultInjector(cfg, "ps", 0, t0=0.0, clock=lambda: 0.0)
    assert ps.added_latency(now=1e6) == 0.02  # duration 0 = persistent
    assert FaultInjector(cfg, "worker", 0, t0=0.0).empty


def test_bad_faults_are_named() -> None:
    with pytest.raises(ConfigError, match=r"job.toml: \[faults.faults\[0\]\]: slow fault on worker 2: factor must be > 1, got 0.5"):
        from_mapping(FaultConfig, {"faults": [{"target": "worker", "index": 2, "kind": "slow", "factor": 0.5}]},
                     where="job.toml", prefix="faults")
    with pytest.raises(ConfigError, match=r"faults.faults\[0\].kind.*expected one of \['slow', 'latency', 'kill'\]"):
        from_mapping(FaultConfig, {"faults": [{"target": "worker", "index": 2, "kind": "explode"}]},
                     where="job.toml", prefix="faults")
    with pytest.raises(ValueError, match="latency_s must be > 0"):
        Fault("ps", 0, "latency").validate()


def test_ps_added_latency_hook(monkeypatch: pytest.MonkeyPatch) -> None:
    from common.faults import ps_added_latency

    cfg = FaultConfig(faults=[Fault("ps", 1, "latency", latency_s=0.03, start_s=5.0)])
    assert ps_added_latency(cfg, 0) is None  # no fault on shard 0: no hook, no per-request cost
    monkeypatch.setenv("METAPS_T0", "100.0")
    hook = ps_added_latency(cfg, 1)
    assert hook is not None
    assert hook(now=104.0) == 0.0 and hook(now=105.0) == pytest.approx(0.03)  # t0 from $METAPS_T0


def test_slow_basis_compute_or_step() -> None:
    """``basis = "compute"`` scales the forward/backward only; ``"step"`` the whole step less the
    waits for slower workers; a loop that measures no step falls back to compute."""
    comp = FaultInjector(FaultConfig([Fault("worker", 0, "slow", factor=4.0)]), "worker", 0, t0=0.0)
    step = FaultInjector(FaultConfig([Fault("worker", 0, "slow", factor=4.0, basis="step")]), "worker", 0, t0=0.0)
    assert comp.step_delay(0.1, 0.5, now=1.0) == pytest.approx(0.3)
    assert step.step_delay(0.1, 0.5, now=1.0) == pytest.approx(1.5)
    assert step.step_delay(0.1, None, now=1.0) == pytest.approx(0.3)
    with pytest.raises(ValueError):
        Fault("worker", 0, "slow", factor=4.0, basis="wall")


def test_faults_scheduled_from_training() -> None:
    """Steps (the run's step numbers) or seconds after the worker's first training step: a fault
    fires however long the launch took; an ``at_step`` kill spares the replacement incarnation."""
    by_step = FaultInjector(FaultConfig([Fault("worker", 0, "slow", factor=3.0, start_step=5, end_step=7)]),
                            "worker", 0, t0=0.0)
    assert [s for s in range(1, 10) if by_step.step_delay(0.1, now=1e6, step=s) > 0] == [5, 6]
    assert by_step.step_delay(0.1, now=1e6) == 0.0  # a loop that passes no step: a step fault never applies
    rec = by_step.fired()[0]
    assert (rec["first_step"], rec["last_step"], rec["count"], rec["schedule"]) == (5, 6, 2, "steps 5-6")
    trained = FaultInjector(FaultConfig([Fault("worker", 0, "slow", factor=2.0, since="train", start_s=5.0,
                                               duration_s=10.0)]), "worker", 0, t0=0.0)
    assert trained.step_delay(1.0, now=100.0) == 0.0 and not trained.fired()  # not armed: training not started
    trained.arm_training(now=200.0)
    trained.arm_training(now=300.0)  # once
    assert [trained.step_delay(1.0, now=t) for t in (204.0, 205.0, 214.9, 215.0)] == [0.0, 1.0, 1.0, 0.0]
    kill = FaultInjector(FaultConfig([Fault("worker", 1, "kill", at_step=30)]), "worker", 1, t0=0.0)
    assert not kill.kill_due(now=1e6, step=29, start_step=0) and kill.kill_due(now=1e6, step=30, start_step=0)
    assert not kill.kill_due(now=1e6, step=31, start_step=30)  # the replacement resumed past it: spared
    for bad, msg in ((Fault("ps", 0, "latency", latency_s=0.1, start_step=3), "worker faults only"),
                     (Fault("ps", 0, "latency", latency_s=0.1, since="train"), "for worker faults"),
                     (Fault("worker", 0, "slow", factor=2.0, start_step=3, start_s=1.0), "both by steps"),
                     (Fault("worker", 0, "slow", factor=2.0, start_step=9, end_step=9), "must be > start_step"),
                     (Fault("worker", 0, "kill", since="train", at_s=3.0), "use at_step")):
        with pytest.raises(ValueError, match=msg):
            bad.validate()
