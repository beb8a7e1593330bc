"""Ctrl-C while ``metaps launch`` is still starting its fleet is an expected stop: exit 130, no
process left, and no ERROR line (there was no PS fleet to checkpoint, which is not a failure)."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from tests.metaps.fleet_data import fleet_pids, finish_launch, make_data, reaping, start_launch, wait_for, \
    write_job_file


@pytest.mark.timeout(300)
def test_ctrl_c_during_start_up_stops_cleanly_without_error_lines(tmp_path: Path) -> None:
    data = make_data(tmp_path / "data")
    cfg = write_job_file(tmp_path / "job.toml", data, workers=1, ps=1)
    run = tmp_path / "run"
    log = tmp_path / "launcher.log"
    proc = start_launch(["--config", str(cfg), "--run-dir", str(run), "--no-progress"], log)
    with reaping(proc, run):
        # the controller is up and the PS shard is being started: the launcher is mid start-up
        wait_for(lambda: (run / "controller" / "address").exists() or proc.poll() is not None, 200,
                 "the controller's address file")
        assert proc.poll() is None
        proc.send_signal(signal.SIGINT)
        out = finish_launch(proc, log, 180)
        left = fleet_pids(str(run))
    assert proc.returncode == 130, out[-3000:]
    assert left == []
    errors = [line for line in out.splitlines() if " ERROR " in line or "Traceback" in line]
    assert not errors, "\n".join(errors)
