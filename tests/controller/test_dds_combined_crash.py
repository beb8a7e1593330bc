"""The controller SIGKILLed after a combined report + lease committed and before it answered.

The controller runs as its own process (this module's ``__main__``, like proc_controller.py);
with ``crash`` set it dies (``os._exit(137)``, no shutdown path) right after its first
``report_and_get`` returns, i.e. after the LMDB commit and before the gRPC reply. The
worker's request retries UNAVAILABLE until the controller is back on the same state dir:
the report must already be recorded (``retry``), the lease granted with it must be the one
answered (no second, untrained lease), and the run must end with every shard done once.
"""

from __future__ import annotations

import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

from controller.client import ControllerClient, DoneReport, LeaseReply
from controller.types import GetStatus
from common.rpc import RpcConfig
from tests.ports import pick_port

ROOT = Path(__file__).resolve().parents[2]
TOKEN = "combined-crash-token"


def _start(state: Path, port: int, crash: bool) -> subprocess.Popen[str]:
    p = subprocess.Popen([sys.executable, "-m", "tests.controller.test_dds_combined_crash", str(state), str(port),
                          "1" if crash else "0"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def test_kill_between_commit_and_reply_loses_no_shard_and_counts_none_twice(tmp_path: Path) -> None:
    port = pick_port()
    addr = f"127.0.0.1:{port}"
    proc = _start(tmp_path / "state", port, crash=True)
    c = ControllerClient(addr, RpcConfig(token=TOKEN, timeout_s=5.0), index=0, retry_s=120)
    try:
        c.register()
        first = c.get_shard("train").lease
        assert first is not None
        out: dict[str, Any] = {}

        def combined() -> None:
            try:
                out["reply"] = c.lease("train", DoneReport(first, samples=first.batches, elapsed_s=0.01))
            except BaseException as exc:  # surfaced below
                out["error"] = exc

        t = threading.Thread(target=combined)
        t.start()
        assert proc.wait(120) == 137  # died after the commit, before answering
        proc.stdout.close()  # type: ignore[union-attr]
        proc = _start(tmp_path / "state", port, crash=False)
        t.join(120)
        assert "error" not in out, out.get("error")
        reply: LeaseReply = out["reply"]
        # the report was durable before the reply: the retried request finds it recorded
        assert reply.report is not None and reply.report.kind == "retry", reply.report
        second = reply.got.lease
        assert second is not None and second.shard_id != first.shard_id
        st = {d["dataset"]: d for d in c.status()["datasets"]}["train"]
        assert (st["shards_done"], st["shards_doing"]) == (1, 1), st  # no second lease nobody trains
        held = second
        while True:
            r = c.lease("train", DoneReport(held, samples=held.batches, elapsed_s=0.01))
            assert r.report is not None and r.report.kind == "done", r.report
            if r.got.status is GetStatus.DONE:
                break
            assert r.got.lease is not None, r.got  # one worker: never WAIT
            held = r.got.lease
        cov = c.status()["coverage"]
        assert cov["complete"], cov["problems"]
        assert (cov["done_entries"], cov["duplicate_entries"], cov["stale_entries"]) == (5, 0, 0), cov
        assert cov["samples"] == 10 and cov["duplicate_samples"] == 0, cov
    finally:
        c.close()
        proc.kill()
        proc.wait(30)
        if proc.stdout is not None:
            proc.stdout.close()


def _serve(state_dir: str, port: int, crash: bool) -> None:
    from controller.config import ControllerConfig, DdsConfig
    from controller.server import ControllerServer
    from controller.types import DatasetKind, DatasetSpec

    # a long lease: a second, untrained lease would stay DOING for the whole test
    cfg = ControllerConfig(tick_s=0.05, heartbeat_timeout_s=300.0, dds=DdsConfig(batches_per_shard=2, lease_s=300.0))
    srv = ControllerServer(cfg, state_dir, [DatasetSpec("train", (10,), DatasetKind.TRAIN)], RpcConfig(token=TOKEN))
    if crash:
        real = srv.dds.report_and_get

        def crash_after_commit(*args: Any, **kw: Any) -> Any:
            real(*args, **kw)
            os._exit(137)

        srv.dds.report_and_get = crash_after_commit  # type: ignore[method-assign]
    srv.start(f"127.0.0.1:{port}")
    print("ready", flush=True)
    srv.wait()
    srv.stop()


if __name__ == "__main__":
    _serve(sys.argv[1], int(sys.argv[2]), sys.argv[3] == "1")
