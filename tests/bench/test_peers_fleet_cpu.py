"""bench.peers's fleet accounting: a process tree's CPU by role, and the steady window's CPU per batch."""

from __future__ import annotations

import subprocess
import sys
import time

import pytest

from bench.peers import TreeSampler, process_role, steady
from bench.procstat import stat_cpu_s, tree_cpu_s

BURN = "import time\nt = time.process_time()\nwhile time.process_time() - t < {s}: pass\n"


def test_steady_window_cpu_per_batch() -> None:
    # two workers: records at 10 s (step 1) .. 20 s; one starts later (12 s) and ends later (22 s)
    w0 = {"history": [{"time": 10.0 + i, "step": 1 + 2 * i, "samples": 256 * (1 + 2 * i)} for i in range(11)]}
    w1 = {"history": [{"time": 12.0 + i, "step": 1 + i, "samples": 256 * (1 + i)} for i in range(11)]}
    # the tree uses 0.5 CPU-s per second in "ps" and 1.0 in "worker", linearly
    samples = [(5.0 + 0.5 * k, {"ps": 0.25 * k, "worker": 0.5 * k}) for k in range(40)]
    got = steady([w0, w1], samples)
    assert got["window_s"] == pytest.approx(8.0)  # 12 .. 20
    assert got["batches"] == pytest.approx(8 * 2 + 8 * 1)
    assert got["cpu_per_batch_ms"] == pytest.approx(1000 * 8 * 1.5 / 24)
    assert got["by_role_ms"]["ps"] == pytest.approx(1000 * 8 * 0.5 / 24)
    assert got["samples_per_s"] == pytest.approx(256 * 24 / 8)


def test_steady_needs_a_window() -> None:
    with pytest.raises(RuntimeError, match="history records"):
        steady([{"history": [{"time": 1.0, "step": 1, "samples": 1}]}], [(0.0, {}), (2.0, {})])


def test_tree_cpu_counts_children_and_reaped_grandchildren() -> None:
    # parent burns 0.3 s, starts a child that burns 0.3 s and is reaped, then sleeps (stays alive)
    code = ("import subprocess, sys, time\n" + BURN.format(s=0.3)
            + f"subprocess.run([sys.executable, '-c', {BURN.format(s=0.3)!r}])\n"
            + "print('done', flush=True)\ntime.sleep(30)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "done"
        total = sum(tree_cpu_s(proc.pid).values())
        own = stat_cpu_s(f"/proc/{proc.pid}/stat")
        assert total >= 0.55 and own >= 0.25 and total - own >= 0.25  # the reaped child counts
        assert process_role(proc.pid) == "other"
        sampler = TreeSampler(proc.pid, period=0.01, rescan=1)
        sampler.start()
        time.sleep(0.1)
        sampler.stop()
        assert sampler.samples and sampler.by_role()[-1][1]["other"] == pytest.approx(total, abs=0.05)
    finally:
        proc.kill()
        proc.wait()


@pytest.mark.parametrize("args, role", [(["--log-level", "INFO", "ps", "--shard", "0"], "ps"),
                                        (["agent", "--role", "worker"], "agent"),
                                        (["train-local", "--config", "x"], "train-local"),
                                        (["meta-io", "build"], "other")])
def test_process_role_reads_the_metaps_subcommand(args: list[str], role: str) -> None:
    proc = subprocess.Popen([sys.executable, "-c", "import time; print(1, flush=True); time.sleep(30)", "-m",
                             "metaps", *args], stdout=subprocess.PIPE, text=True)
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "1"
        assert process_role(proc.pid) == role
    finally:
        proc.kill()
        proc.wait()
