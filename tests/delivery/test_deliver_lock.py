"""`.deliver.lock`: removed after every delivery (failed ones too); a dead holder's lock is taken over."""

from __future__ import annotations

import logging
import multiprocessing
import signal
import subprocess
import sys

import pytest

from delivery.bundle import DeliveryError
from delivery.config import DeliveryConfig
from delivery.job import Status, deliver_once
from delivery.publish import LOCK, Publisher
from metaps.cli import main
from tests.delivery.test_job import _killed_delivery


def test_failed_deliveries_leave_no_lock(tmp_path, history, capsys):
    out = tmp_path / "out"
    # the gate fails inside the lock (holdout missing): exit 1, no lock, no staging
    assert main(["deliver", "--no-gate", "--checkpoint", str(history.ckpts[10]), "--out", str(out),
                 "--holdout", str(tmp_path / "no-holdout.parquet")]) == 1
    assert "no-holdout.parquet: holdout not found" in capsys.readouterr().err
    assert sorted(p.name for p in out.iterdir()) == []
    # LATEST naming a missing version: refused inside the lock, lock removed
    (out / "LATEST").write_text("v000009\n")
    with pytest.raises(DeliveryError, match="not a published version"):
        deliver_once(DeliveryConfig(out=out), checkpoint=history.ckpts[10])
    assert not (out / LOCK).exists()
    (out / "LATEST").unlink()
    # and a good one
    assert deliver_once(DeliveryConfig(out=out), checkpoint=history.ckpts[10]).status is Status.PUBLISHED
    assert not (out / LOCK).exists()


def test_a_live_holder_is_respected(tmp_path, history):
    out = tmp_path / "out"
    Publisher(out)
    holder = subprocess.Popen(
        [sys.executable, "-c",
         "import fcntl, json, os, sys, time\n"
         f"f = open({str(out / LOCK)!r}, 'a+'); fcntl.flock(f, fcntl.LOCK_EX)\n"
         "f.write(json.dumps({'pid': os.getpid(), 'host': 'x'})); f.flush()\n"
         "print('held', flush=True); sys.stdin.read()"],
        stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(DeliveryError, match=rf"another delivery holds .*\(pid {holder.pid} on x\)"):
            deliver_once(DeliveryConfig(out=out), checkpoint=history.ckpts[10])
        assert (out / LOCK).exists()  # the refused delivery does not remove the holder's lock
    finally:
        holder.stdin.close()
        holder.wait(timeout=60)
    assert deliver_once(DeliveryConfig(out=out), checkpoint=history.ckpts[10]).status is Status.PUBLISHED
    assert not (out / LOCK).exists()


def test_a_dead_holders_lock_is_cleared_with_a_warning(tmp_path, history, caplog):
    out = tmp_path / "out"
    deliver_once(DeliveryConfig(out=out), checkpoint=history.ckpts[10])
    # a real delivery process SIGKILLed while holding the lock (mid-publish)
    proc = multiprocessing.get_context("fork").Process(
        target=_killed_delivery, args=("version", str(history.ckpts[30]), str(out)))
    proc.start()
    proc.join(timeout=240)
    assert proc.exitcode == -signal.SIGKILL
    assert str(proc.pid) in (out / LOCK).read_text()  # the dead process's lock file is left behind
    with caplog.at_level(logging.WARNING, logger="delivery.publish"):
        o = deliver_once(DeliveryConfig(out=out), checkpoint=history.ckpts[30])
    assert o.status is Status.PUBLISHED
    warned = [r for r in caplog.records if "stale delivery lock cleared" in r.getMessage()]
    assert len(warned) == 1 and warned[0].kv["pid"] == proc.pid and warned[0].kv["pid_alive"] == "no"
    assert not (out / LOCK).exists()
