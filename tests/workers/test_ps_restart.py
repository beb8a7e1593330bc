"""A PS shard SIGKILLed mid-training and restarted from a checkpoint: the worker reconnects and finishes.

Real processes: ``metaps ps`` (shard 0 of 1) and ``metaps worker`` (rank 0 of 1).
The test plays the operator: it takes a coordinated checkpoint while the worker
trains, SIGKILLs the PS, restarts it on the same port restoring that checkpoint,
and checks that the worker's PsClient rode out the outage (log lines on both
edges) and completed every step of its static share.
"""

from __future__ import annotations

import json
import re
import signal
import time
from pathlib import Path

from meta_io.reader import MetaIODataset
from ps.coordinator import checkpoint_all

from tests.ps.conftest import start_ps_process
from tests.workers.conftest import make_job
from tests.workers.procs import TOKEN, start_worker, wait_exit, wait_for_log, write_job


def test_worker_survives_ps_sigkill_and_restart(worker_data, tmp_path: Path, monkeypatch) -> None:
    # job.toml says token = "<redacted>": hand the PS its token as a launcher does (without one
    # a hand-started PS generates its own, and the worker's token would be refused)
    monkeypatch.setenv("METAPS_TOKEN", TOKEN)
    epochs = 3
    # Overlap on (the fleet default): the outage hits the background row lane as well as the step.
    job = make_job(worker_data["plain"], tmp_path, mode="plain",
                   train={"epochs": epochs, "log_every": 1, "overlap": True})
    config = write_job(job, tmp_path / "job.toml")
    ds = MetaIODataset(worker_data["plain"])
    expected_steps = epochs * sum(ds.num_batches(f) for f in range(ds.num_files))

    ps = start_ps_process(config, 0, tmp_path)
    log_path = tmp_path / "worker-0.log"
    worker = start_worker(config, 0, [ps.address], tmp_path / "run", log_path)
    try:
        m = wait_for_log(log_path, r'msg="step" rank=0 step=(\d+)', worker, timeout_s=120)
        # The operator's checkpoint (a controller would take it on a schedule), then the crash.
        ckpt = checkpoint_all([ps.address], tmp_path / "ckpt", int(m.group(1)), rpc_cfg=job.rpc)
        ps.proc.send_signal(signal.SIGKILL)
        ps.proc.wait(timeout=30)
        killed_at = max(int(s) for s in re.findall(r'msg="step" rank=0 step=(\d+)', log_path.read_text()))
        assert killed_at < expected_steps, "the worker finished before the PS was killed: nothing was tested"
        wait_for_log(log_path, r"ps shard unavailable; retrying", worker, timeout_s=60)
        time.sleep(0.5)
        ps = start_ps_process(config, 0, tmp_path, port=ps.port, restore=str(ckpt))
        assert wait_exit(worker, log_path, timeout_s=180) == 0, log_path.read_text()[-4000:]
    finally:
        if worker.poll() is None:
            worker.kill()
        if ps.proc.poll() is None:
            ps.proc.send_signal(signal.SIGTERM)
            ps.proc.wait(timeout=30)

    text = log_path.read_text()
    assert "ps shard unavailable; retrying with backoff" in text
    assert "ps shard reachable again; continuing" in text
    assert text.index("ps shard unavailable") < text.index("ps shard reachable again")
    assert "restored" in ps.log()
    report = json.loads((tmp_path / "run" / "workers" / "worker-0.json").read_text())
    assert report["steps"] == expected_steps  # every batch trained, none skipped by the outage
    assert report["samples"] > 0
    assert report["checkpoint"] and Path(report["checkpoint"]).is_dir()  # the final checkpoint reached the new PS
