"""Issue 37 item 7, end to end: a real ``metaps launch`` whose checkpoint root is a full disk
(a 64 KiB tmpfs mounted on ``RUN/checkpoints`` in a private mount namespace, as ``bench.chaos``'s
``disk_full``): every shard file of the final checkpoint hits ENOSPC.

Training finishes; the final checkpoint cannot be written. That is deterministic, so the run
ends once: no worker is restarted (one incarnation each, no agent restart), the reason is one
line naming the checkpoint path and the OS error, the report says training finished and the
final checkpoint failed, and no ``ckpt-*.tmp`` (or partial shard file) is left on the disk.

The fleet (2 PS, 2 workers, G-Meta) trains a model metaps does not ship: the two-tower of
docs/examples/two_tower.py, copied next to the job file and named ``class = "two_tower:TwoTower"``
with no ``class_dir`` and no PYTHONPATH: every process (the launcher's preflight, the PS sizing its
tables from the class's declared dims, the workers) finds it in the job file's folder, through the
run directory's copy of the job.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
import sys
from pathlib import Path

from tests.metaps.fleet_data import make_data, reaping, write_job_file
from tests.tmpfs import LEFT_MARK, tmpfs_once_made

ROOT = Path(__file__).resolve().parents[2]


def test_a_final_checkpoint_on_a_full_disk_fails_the_run_once(tmp_path: Path) -> None:
    data = make_data(tmp_path / "data")
    shutil.copy(ROOT / "docs" / "examples" / "two_tower.py", tmp_path / "two_tower.py")
    # restart_limit 3: the old behaviour restarted the leader three times on the same error
    cfg = write_job_file(tmp_path / "job.toml", data, workers=2, ps=2,
                         model={"kind": "custom", "class": "two_tower:TwoTower", "hidden": [8]},
                         controller={"agent": {"heartbeat_s": 0.5, "restart_limit": 3, "backoff_s": 0.2,
                                               "stop_grace_s": 5.0}})
    run = tmp_path / "run"
    launch = [sys.executable, "-m", "metaps", "launch", "--config", str(cfg), "--run-dir", str(run),
              "--no-progress", "--timeout", "240"]
    log = tmp_path / "launcher.log"
    with log.open("wb") as out:
        proc = subprocess.Popen(tmpfs_once_made(run / "checkpoints", "64k", launch), cwd=ROOT, stdout=out,
                                stderr=subprocess.STDOUT)
    with reaping(proc, run):
        proc.wait(timeout=300)
    text = log.read_text(errors="replace")
    assert "@@tmpfs-mount-failed" not in text, text[-3000:]
    assert proc.returncode == 1, text[-5000:]

    rep = json.loads((run / "report.json").read_text())
    assert rep["status"] == "failed" and rep["exit_code"] == 1
    reason = rep["reason"]
    assert "\n" not in reason
    assert re.match(r"training finished \(train (\d+)/\1 batches\); the final checkpoint failed: ", reason), reason
    assert "/checkpoints/ckpt-" in reason and "no space left on device" in reason and "ENOSPC" in reason, reason
    assert rep["training"] == "finished" and rep["controller"]["coverage"]["complete"], rep["coverage_summary"]
    # the custom model trained on both workers, from the job file's folder (made absolute in RUN/job.toml)
    assert rep["config"]["model"]["class"] == "two_tower:TwoTower"
    assert rep["config"]["model"]["class_dir"] == str(tmp_path.resolve())
    assert all(w["steps"] > 0 for w in rep["workers"]), [w["steps"] for w in rep["workers"]]
    assert rep["final_checkpoint"]["state"] == "failed", rep["final_checkpoint"]
    assert "no space left on device" in rep["final_checkpoint"]["error"]
    assert rep["checkpoint"] == ""
    assert "no final checkpoint: it could not be written (see the reason); not retried" in rep["notes"], rep["notes"]
    events = rep["controller"]["events"]
    failed = [e for e in events if e["kind"] == "run_failed"]
    assert len(failed) == 1 and failed[0]["evidence"]["cause"] == "final_checkpoint", failed
    # one run, once: no worker restarted on the deterministic error, no agent restarted
    starts = {w: (run / "logs" / f"worker-{w}.log").read_text(errors="replace").count('msg="child started"')
              for w in (0, 1)}
    assert starts == {0: 1, 1: 1}, starts
    assert rep["totals"]["incarnations"] == 2, [w.get("incarnations") for w in rep["workers"]]
    assert "agent died" not in text and "restart limit" not in reason
    # the summary: one failure line naming the path and the cause
    lines = [ln for ln in text.splitlines() if ln.startswith("run failed")]
    assert len(lines) == 1 and "training finished" in lines[0], lines
    # nothing partial left on the full disk: no ckpt-*.tmp, no shard file
    left = next((ln for ln in text.splitlines() if ln.startswith(LEFT_MARK)), None)
    assert left is not None, text[-3000:]
    assert left[len(LEFT_MARK):].split() == [], left
