"""``[train] overlap = "auto"``: measured windows of both modes, then the faster one.

The probe is judged on its schedule and decision with known step times, and in a
real fleet (a PS process, a worker over gRPC): the worker's report carries the
decision and both figures, and every step after the decision ran in the chosen mode.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from workers.overlap import AUTO, OverlapProbe


def _run(probe: OverlapProbe, cost: dict[bool, float], steps: int) -> list[bool]:
    modes = []
    for step in range(steps):
        on = probe.overlap(step)
        modes.append(on)
        probe.record(step, cost[on])
    return modes


@pytest.mark.parametrize("faster", [True, False])
def test_auto_measures_both_modes_then_keeps_the_faster(faster: bool) -> None:
    probe = OverlapProbe(AUTO, in_process=False, warmup=2, window=3, rounds=2)
    cost = {faster: 0.010, not faster: 0.012}
    modes = _run(probe, cost, 30)
    # warm-up (overlapped), then windows on, off, on, off of 3 steps each, then the decision
    assert modes[:14] == [True] * 2 + [True] * 3 + [False] * 3 + [True] * 3 + [False] * 3
    assert modes[14:] == [faster] * 16
    rep = probe.report()
    assert rep["chosen"] == ("on" if faster else "off")
    assert rep["on_ms"] == pytest.approx(cost[True] * 1e3) and rep["off_ms"] == pytest.approx(cost[False] * 1e3)
    assert "measured" in rep["why"]


def test_fixed_settings_and_in_process_rows_do_not_measure() -> None:
    for setting, in_process, chosen in ((True, False, "on"), (False, False, "off"), (AUTO, True, "off")):
        probe = OverlapProbe(setting, in_process=in_process)
        assert _run(probe, {True: 1.0, False: 2.0}, 40) == [chosen == "on"] * 40
        rep = probe.report()
        assert rep["chosen"] == chosen and "on_ms" not in rep and "off_ms" not in rep
    short = OverlapProbe(AUTO, in_process=False)
    _run(short, {True: 1.0, False: 1.0}, 5)
    assert short.report()["chosen"] is None and "too short" in short.report()["why"]
    with pytest.raises(ValueError, match="overlap must be"):
        OverlapProbe("sometimes", in_process=False)


def test_a_fleet_worker_reports_its_decision_and_keeps_it(worker_data, ps_servers, tmp_path: Path) -> None:
    """A real worker over gRPC with ``overlap = "auto"``: the decision is in its report, and every
    step recorded after the probe's windows ran in the chosen mode."""
    from tests.workers.conftest import make_job
    from workers.worker import run_worker

    job = make_job(worker_data["plain"], tmp_path, mode="plain", shards=1,
                   train={"overlap": "auto", "max_steps": 40, "log_every": 1, "epochs": 4})
    addrs = ps_servers(job)
    rep = run_worker(job, 0, addrs, run_dir=tmp_path / "run")
    over = rep["overlap"]
    assert over["setting"] == AUTO and over["chosen"] in ("on", "off"), over
    assert over["on_ms"] > 0 and over["off_ms"] > 0
    decided_after = 3 + 2 * 3 * 4  # warm-up + two modes x rounds x window (the defaults)
    late = [h["overlapped"] for h in rep["history"] if h["step"] > decided_after + 1]
    assert late and set(late) == {over["chosen"] == "on"}
    early = [h["overlapped"] for h in rep["history"] if 3 < h["step"] <= decided_after]
    assert True in early and False in early  # both modes were measured
