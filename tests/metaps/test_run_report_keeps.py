"""``metaps run-report`` never overwrites a run's report (a finished launch's report holds
what only the launcher knew: coverage complete, the controller's events); ``--out`` writes
the assembled one elsewhere."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from tests.metaps.fleet_data import write_job_file

REPO = Path(__file__).resolve().parents[2]


def _run_report(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "metaps", "run-report", *args], cwd=REPO, capture_output=True,
                          text=True, timeout=300)


def test_run_report_refuses_to_overwrite_and_writes_elsewhere_with_out(tmp_path: Path) -> None:
    run = tmp_path / "run"
    (run / "workers").mkdir(parents=True)
    write_job_file(run / "job.toml", {"train": tmp_path / "nodata", "eval": tmp_path / "nodata"}, workers=1)
    finished = {"status": "succeeded", "coverage_summary": "complete", "controller": {"events": [{"kind": "x"}]}}
    (run / "report.json").write_text(json.dumps(finished))
    before = (run / "report.json").read_bytes()
    r = _run_report("--run-dir", str(run))
    assert r.returncode == 1, r.stderr
    assert "report.json exists (status succeeded, coverage complete)" in r.stderr and "--out" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1, r.stderr
    assert (run / "report.json").read_bytes() == before and not (run / "plots").exists()
    r = _run_report("--run-dir", str(run), "--out", str(run / "report.json"))
    assert r.returncode == 1 and "never overwrites" in r.stderr
    out = tmp_path / "assembled.json"
    r = _run_report("--run-dir", str(run), "--out", str(out))
    assert json.loads(out.read_text())["notes"] == ["assembled by metaps run-report"], r.stderr
    assert (run / "report.json").read_bytes() == before
