"""``metaps status``: the run's outcome from the controller in one command (a real process
against a real controller), and the exit code a script can branch on."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from controller.client import ControllerClient
from controller.types import NODE_FINISHED
from common.toml_writer import write
from tests.controller.conftest import RPC, TOKEN, TRAIN, client, drain

REPO = Path(__file__).resolve().parents[2]


def _status(tmp: Path, addr: str, *extra: str) -> subprocess.CompletedProcess[str]:
    token = tmp / "token"
    token.write_text(TOKEN)
    os.chmod(token, 0o600)
    job = write(tmp / "job.toml", {"data": {"train": "unused"}})
    return subprocess.run([sys.executable, "-m", "metaps", *extra, "status", "--config", str(job), "--controller",
                           addr, "--token-file", str(token)], capture_output=True, text=True, timeout=120, cwd=REPO)


def test_status_of_a_running_then_complete_run(controller, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    srv = controller(datasets=(TRAIN,))
    w = client(srv, 0)
    r = _status(tmp_path, srv.address)
    assert r.returncode == 0, r.stderr
    assert r.stdout.splitlines()[0] == "run         running"
    assert "coverage    in progress: 0%" in r.stdout and "worker 1 alive" in r.stdout
    drain(w, "train")
    w.node_down("worker", 0, NODE_FINISHED, 0)
    r = _status(tmp_path, srv.address, "--json")
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert (out["run"], out["coverage"], out["nodes"]) == ("complete", "complete", {"worker": {"done": 1}})
    assert out["datasets"][0]["shards_done"] == out["datasets"][0]["shards_total"] > 0


def test_status_of_a_failed_run_exits_4_with_the_reason(controller, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    srv = controller(ps_fleet=None)
    srv.recovery.settle_s = 0.0
    ControllerClient(srv.address, RPC, role="ps", index=0).register(incarnation="a")
    ControllerClient(srv.address, RPC, role="ps", index=0).register(incarnation="b")
    srv.recovery.join(timeout=30)
    r = _status(tmp_path, srv.address)
    assert r.returncode == 4, (r.returncode, r.stdout, r.stderr)
    assert r.stdout.startswith("run         failed: PS recovery after the restart of ps:0 failed")


def test_status_with_a_wrong_token_says_so_in_one_line(controller, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    srv = controller()
    bad = tmp_path / "bad"
    bad.mkdir()
    token = bad / "token"
    token.write_text("wrong")
    os.chmod(token, 0o600)
    job = write(bad / "job.toml", {"data": {"train": "unused"}})
    r = subprocess.run([sys.executable, "-m", "metaps", "status", "--config", str(job), "--controller", srv.address,
                        "--token-file", str(token)], capture_output=True, text=True, timeout=120, cwd=REPO)
    assert r.returncode == 1 and "wrong auth token" in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr


def test_cut_requests_a_checkpoint_cut_and_waits_for_its_commit(controller, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    import threading
    import time

    srv = controller(datasets=(TRAIN,))
    client(srv, 0)
    r = _status(tmp_path, srv.address, "--json")  # writes the token and job files
    job, token = tmp_path / "job.toml", tmp_path / "token"

    def cut(*extra: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "metaps", "--json", "cut", "--config", str(job), "--controller",
                               srv.address, "--token-file", str(token), "--reason", "preStop: test", *extra],
                              capture_output=True, text=True, timeout=120, cwd=REPO)

    r = cut("--wait", "1")  # no leader writes it: still pending when the wait is over
    assert r.returncode == 1 and json.loads(r.stdout)["state"] == "pending", r.stdout + r.stderr
    first = json.loads(r.stdout)["cut_id"]
    ev = [e for e in srv.events.list() if e.kind == "checkpoint"][-1]
    assert ev.evidence["reason"] == "preStop: test" and ev.evidence["cut_id"] == first

    def commit_when_opened() -> None:  # the leader's part: write the checkpoint, report it done
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:
            pending = [c for c in srv.checkpoints.cuts() if c["state"] == "pending" and c["cut_id"] > first]
            if pending:
                srv.checkpoints.commit(pending[0]["cut_id"], 5, str(tmp_path / "ckpt-5"))
                return
            time.sleep(0.05)

    t = threading.Thread(target=commit_when_opened)
    t.start()
    r = cut("--wait", "30")
    t.join()
    assert r.returncode == 0 and json.loads(r.stdout)["state"] == "committed", r.stdout + r.stderr
