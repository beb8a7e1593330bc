"""``runs/latest`` names the live run from its start, and never a failed one.

A real ``metaps launch`` (controller, PS and worker agents on loopback) into an
auto-named run dir next to an earlier run that ``latest`` names: while the fleet
runs, ``latest`` names the new run; the run fails (``--timeout``), and ``latest``
goes back to the earlier run while ``last-failed`` names the failed one.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from metaps.launch import mark_latest, settle_latest
from tests.metaps.fleet_data import make_data, reaping, write_job_file

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_data(tmp_path_factory.mktemp("latest-data"))


def test_latest_follows_a_succeeded_run_and_skips_failed_ones(tmp_path: Path) -> None:
    runs = tmp_path / "runs"
    first, second, third = (runs / n for n in ("a", "b", "c"))
    for d in (first, second, third):
        d.mkdir(parents=True)
    prev = mark_latest(first)
    assert prev == "" and os.readlink(runs / "latest") == "a"
    settle_latest(first, True, prev)
    assert os.readlink(runs / "latest") == "a"

    prev = mark_latest(second)
    assert prev == "a" and os.readlink(runs / "latest") == "b"  # live from the start
    settle_latest(second, False, prev)
    assert os.readlink(runs / "latest") == "a" and os.readlink(runs / "last-failed") == "b"

    prev = mark_latest(third)
    settle_latest(third, True, prev)
    assert os.readlink(runs / "latest") == "c" and os.readlink(runs / "last-failed") == "b"


@pytest.mark.timeout(600)
def test_latest_names_the_running_launch_and_not_the_failed_one(data: dict[str, Path], tmp_path: Path) -> None:
    cfg = write_job_file(tmp_path / "job.toml", data, workers=1, ps=1)
    runs = tmp_path / "runs"  # [run] dir of job_mapping
    (runs / "test-earlier").mkdir(parents=True)
    (runs / "latest").symlink_to("test-earlier")
    env = dict(os.environ, PYTHONPATH=str(REPO))
    proc = subprocess.Popen([sys.executable, "-m", "metaps", "launch", "--config", str(cfg), "--no-progress",
                             "--timeout", "2"], cwd=REPO, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    seen: dict[str, Any] = {}
    with reaping(proc, runs):
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline and proc.poll() is None:
            target = os.readlink(runs / "latest") if (runs / "latest").is_symlink() else ""
            if target != "test-earlier" and target:
                seen["target"] = target
                seen["alive"] = proc.poll() is None
                seen["logs"] = (runs / target / "logs").is_dir()
                break
            time.sleep(0.1)
        out, _ = proc.communicate(timeout=400)
    assert seen.get("alive"), f"latest never named the running run:\n{out[-3000:]}"
    run = runs / seen["target"]
    assert seen["target"].startswith("test-") and seen["logs"]
    assert proc.returncode == 1, out[-3000:]
    assert json.loads((run / "report.json").read_text())["status"] == "failed"
    assert os.readlink(runs / "latest") == "test-earlier", "latest left at the failed run"
    assert os.readlink(runs / "last-failed") == seen["target"]
