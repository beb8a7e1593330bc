"""One-shot delivery killed mid-publish (a real forked process, SIGKILLed), and the periodic loop."""

from __future__ import annotations

import multiprocessing
import os
import shutil
import signal
import sys
from pathlib import Path

import pytest

from delivery.config import DeliveryConfig
from delivery.job import PeriodicDelivery, Status, deliver_once
from delivery.loader import load_bundle
from delivery.publish import Publisher


def _killed_delivery(point: str, ckpt: str, out: str) -> None:
    """Child process: `metaps deliver`, SIGKILLing itself at the chosen rename of the publish step."""
    real_rename = os.rename

    def rename(src, dst):  # os.rename, not a project part: the kill point
        name = Path(dst).name
        if (point == "version" and name.startswith("v")) or (point == "latest" and name == "LATEST"):
            os.kill(os.getpid(), signal.SIGKILL)
        return real_rename(src, dst)

    os.rename = rename
    from metaps.cli import main

    sys.exit(main(["deliver", "--no-gate", "--checkpoint", ckpt, "--out", out]))


@pytest.mark.parametrize("point", ["version", "latest"])
def test_delivery_killed_mid_publish_leaves_latest_valid(tmp_path, history, point):
    out = tmp_path / "out"
    deliver_once(DeliveryConfig(out=out), checkpoint=history.ckpts[10])
    # fork: a real process killed by a real SIGKILL, without paying the imports again.
    proc = multiprocessing.get_context("fork").Process(
        target=_killed_delivery, args=(point, str(history.ckpts[30]), str(out))
    )
    proc.start()
    proc.join(timeout=240)
    assert proc.exitcode == -signal.SIGKILL
    # A reader sees the old version, whole and verified.
    served = load_bundle(out)
    assert served.version == "v000001"
    assert served.manifest.source_step == 10
    leftovers = sorted(p.name for p in out.iterdir() if p.name.startswith(".v"))
    if point == "version":
        assert leftovers == [".v000002.tmp"] and not (out / "v000002").exists()
    else:
        assert (out / "v000002").is_dir() and (out / "LATEST").read_text() == "v000001\n"
    # The next delivery cleans up and publishes.
    o = deliver_once(DeliveryConfig(out=out), checkpoint=history.ckpts[30])
    assert o.status is Status.PUBLISHED and load_bundle(out).manifest.source_step == 30
    assert not any(p.name.endswith(".tmp") for p in out.iterdir())


def test_periodic_loop_delivers_only_when_a_newer_checkpoint_appears(tmp_path, history):
    run, out = tmp_path / "run", tmp_path / "out"
    run.mkdir()
    loop = PeriodicDelivery(DeliveryConfig(out=out, incremental=True, every="1s"), run)
    assert loop.tick() is None                                   # no checkpoint yet
    shutil.copytree(history.ckpts[10], run / "checkpoints" / "ckpt-10")
    first = loop.tick()
    assert first is not None and (first.status, first.version, first.kind) == (Status.PUBLISHED, "v000001", "full")
    assert loop.tick().status is Status.UP_TO_DATE
    shutil.copytree(history.ckpts[20], run / "checkpoints" / "ckpt-20")
    second = loop.tick()
    assert (second.status, second.version, second.kind) == (Status.PUBLISHED, "v000002", "delta")
    outcomes = loop.run(every_s=0.01, max_ticks=2)                # the loop itself: nothing new
    assert [o.status for o in outcomes] == [Status.UP_TO_DATE, Status.UP_TO_DATE]
    assert Publisher(out).versions() == ["v000001", "v000002"]
    assert load_bundle(out).version == "v000002"


def test_another_runs_checkpoint_is_due_whatever_its_step(tmp_path, history):
    """Steps compare within one run only: a new run's ckpt-10 after the last run's ckpt-30 is delivered
    (a rerun of `make run` was told "up to date" by a step number of another run), while within one
    run an older checkpoint stays "up to date"."""
    out = tmp_path / "out"
    assert deliver_once(DeliveryConfig(out=out), checkpoint=history.ckpts[30]).status is Status.PUBLISHED
    assert deliver_once(DeliveryConfig(out=out), checkpoint=history.ckpts[10]).status is Status.UP_TO_DATE
    other = tmp_path / "run-2" / "checkpoints"
    other.mkdir(parents=True)
    shutil.copytree(history.ckpts[10], other / "ckpt-10")
    o = deliver_once(DeliveryConfig(out=out), checkpoint=other / "ckpt-10")
    assert (o.status, o.version) == (Status.PUBLISHED, "v000002")
    assert load_bundle(out).version == "v000002"
