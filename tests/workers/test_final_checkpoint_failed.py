"""A final checkpoint that cannot be written (issue 37 item 7): the run ends once, loudly.

A real controller and PS shard in this process (gRPC on 127.0.0.1) and one ``metaps worker``
process under a real :class:`~controller.agent.Agent`, as ``metaps launch`` runs it. The PS's
shard file hits a full disk (``ps.checkpoint.write_fault``: ENOSPC at the write point, in this
process where the shard serves). The worker trains everything, its final checkpoint fails:
it must tell the controller (the run fails with a reason naming the checkpoint path and the
OS error, saying training finished) and exit 4, which its agent does not restart (before, it
exited 1 and was restarted ``restart_limit`` times on the same error); no ``ckpt-*.tmp`` is
left; its report says training finished and why the checkpoint was not written.
"""

from __future__ import annotations

import errno
import json
import os
import re
import shlex
import sys
import threading
from pathlib import Path

from controller.agent import Agent
from controller.config import AgentConfig
from controller.types import DatasetSpec
from common import exit_codes
from common.rpc import RpcConfig
from ps.checkpoint import write_fault

from tests.metaps.fleet_data import make_data
from tests.workers.conftest import TOKEN, make_job
from tests.workers.procs import REPO, serve_ps_and_controller, write_job


def _disk_full(path: Path, key: str, data: bytes) -> bytes:
    if path.name.startswith("shard-"):
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
    return data


def test_a_final_checkpoint_not_written_fails_the_run_once(tmp_path: Path) -> None:
    data = make_data(tmp_path / "data")
    job = make_job(data["train"], tmp_path, mode="meta", eval_path=data["eval"],
                   controller={"checkpoint_interval_s": 3600.0})
    config = write_job(job, tmp_path / "job.toml")
    specs = [DatasetSpec.from_meta_io("train", str(data["train"]), "train"),
             DatasetSpec.from_meta_io("eval", str(data["eval"]), "eval")]
    ps, addrs, srv = serve_ps_and_controller(job, tmp_path / "ctl", specs, batches_per_shard=4)
    run = tmp_path / "run"
    log = tmp_path / "worker-0.log"
    worker = [sys.executable, "-m", "metaps", "worker", "--config", str(config), "--rank", "0",
              "--ps", ",".join(addrs), "--run-dir", str(run)]
    child = ["sh", "-c", f"exec {shlex.join(worker)} >>{shlex.quote(str(log))} 2>&1"]
    agent = Agent(AgentConfig(heartbeat_s=0.2, restart_limit=3, backoff_s=0.1), "worker", 0, srv.address,
                  RpcConfig(token=TOKEN, timeout_s=5.0), child,
                  env={"PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1", "METAPS_TOKEN": TOKEN})
    rc: list[int] = []
    t = threading.Thread(target=lambda: rc.append(agent.run()), daemon=True)
    try:
        with write_fault(_disk_full):
            t.start()
            t.join(240)
        state, reason = srv.outcome.state()
        events = srv.events.list()
    finally:
        agent.stop()
        t.join(30)
        srv.stop(grace=0)
        ps.stop(0)
    text = log.read_text(errors="replace") if log.exists() else ""
    assert rc, f"the agent did not end:\n{text[-4000:]}"
    # one child, no restart: the error is deterministic
    assert (rc[0], agent.restarts, agent.crashes) == (exit_codes.RUN_FAILED, 0, 0), (rc, agent.restarts, text[-4000:])
    assert text.count("metaps worker: error:") == 1, text[-4000:]
    # the controller failed the run once, saying training finished, naming the path and the cause
    assert state.value == "failed", text[-4000:]
    assert re.match(r"training finished \(train (\d+)/\1 batches\); the final checkpoint failed: ", reason), reason
    assert re.search(r"/run/checkpoints/ckpt-\d+ not written: RESOURCE_EXHAUSTED: ", reason), reason
    assert "shard-0.lmdb: no space left on device" in reason and "ENOSPC" in reason, reason
    failed = [e for e in events if e.kind == "run_failed"]
    assert len(failed) == 1 and failed[0].evidence["cause"] == "final_checkpoint", failed
    assert failed[0].evidence["training_finished"] is True
    assert srv.outcome.leader() == -1  # nobody else takes the final checkpoint of a failed run
    # nothing partial left
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == []
    rep = json.loads((run / "workers" / "worker-0.json").read_text())
    assert rep["state"] == "finished" and not rep["final"] and rep["checkpoint"] == ""
    assert "no space left on device" in rep["checkpoint_error"], rep["checkpoint_error"]
