"""Tiny Meta-IO data and job files for tests that start real fleets (launch, multi-host).

Example::

    data = make_data(tmp / "data")                 # {"train": Path, "eval": Path}
    job = write_job_file(tmp / "job.toml", data, workers=2, ps=1)
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import time
from pathlib import Path
from typing import Any, Iterator

from meta_io.build import MetaIOBuildConfig, build
from meta_io.synth import GeneratorConfig, generate
from common.toml_writer import write

TOKEN = "launch-test-token"


def make_data(root: Path) -> dict[str, Path]:
    """800-row train and held-out eval sets (different users), meta layout, 64-slot batches (17 each)."""
    out = {}
    for name, seed in (("train", 3), ("eval", 4)):
        gen = generate(root / f"raw-{name}", GeneratorConfig(rows=800, users=80, items=100, seed=seed, n_files=1,
                                                             row_group_rows=800), progress=False)
        out[name] = build(gen.out_dir, gen.schema_path, root / name,
                          MetaIOBuildConfig(support=4, query=4, rows_per_batch=64)).out_dir
    return out


def job_mapping(data: dict[str, Path], run_root: Path, *, workers: int = 2, ps: int = 1,
                **sections: dict[str, Any]) -> dict[str, Any]:
    """A small meta-mode job: 8-dim tables, a tiny DNN, fast heartbeats, 4-batch shards."""
    job: dict[str, Any] = {
        "data": {"train": str(data["train"]), "eval": str(data.get("eval", ""))},
        "ps": {"shards": ps, "num_vshards": 16, "device": "cpu", "table_defaults": {"dim": 8, "capacity": 4096}},
        "model": {"kind": "dnn", "default_dim": 8, "hidden": [16, 8]},
        "meta": {"inner_steps": 1, "inner_lr": 0.1},
        "train": {"mode": "meta", "workers": workers, "overlap": False, "log_every": 2},
        "controller": {"heartbeat_timeout_s": 30.0, "tick_s": 0.2,
                       "dds": {"batches_per_shard": 4}, "monitor": {"window_s": 1.0},
                       "agent": {"heartbeat_s": 0.5, "restart_limit": 1, "backoff_s": 0.2, "stop_grace_s": 5.0}},
        "rpc": {"token": TOKEN, "timeout_s": 20.0},
        "delivery": {"out": str(run_root / "bundles")},
        # no PNGs (matplotlib, ~4 CPU-s a run): the tests that check plots turn them on
        "run": {"dir": str(run_root / "runs"), "name": "test", "plots": False},
    }
    for name, values in sections.items():
        job.setdefault(name, {}).update(values)
    return job


def write_job_file(path: Path, data: dict[str, Path], **kw: Any) -> Path:
    """:func:`job_mapping` written as TOML at ``path``."""
    return write(path, job_mapping(data, path.parent, **kw))


def fleet_pids(marker: str) -> list[int]:
    """Pids of live (non-zombie) processes whose command line contains ``marker`` (e.g. a run dir)."""
    out = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
            state = (d / "stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if marker in cmd and state != "Z":
            out.append(int(d.name))
    return out


def role_pid(marker: str, role: str, flag: str, index: int) -> int | None:
    """The pid of ``metaps ROLE ... FLAG INDEX`` whose command line holds ``marker`` (a run dir):
    the supervised process, not its agent (e.g. ``role_pid(run, "ps", "--shard", 0)``)."""
    for pid in fleet_pids(marker):
        try:
            argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
        except OSError:
            continue
        if "agent" not in argv and role in argv and flag in argv and argv[argv.index(flag) + 1] == str(index):
            return pid
    return None


def train_shards_done(state: Path) -> int:
    """Ledger ``done`` entries of the train dataset in a (live) controller's LMDB state dir."""
    from controller.state import StateStore  # noqa: PLC0415 (only the fleet tests that watch a ledger need it)

    if not (state / "data.mdb").exists():
        return 0
    store = StateStore(state)
    try:
        return sum(1 for _, e in store.items("ledger") if e["kind"] == "done" and e["dataset"] == "train")
    finally:
        store.close()


def kill_leftovers(marker: str) -> list[int]:
    """SIGKILL whatever :func:`fleet_pids` finds (test teardown); returns the pids it found."""
    pids = fleet_pids(marker)
    for pid in pids:
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if pids:
        time.sleep(0.2)
    return pids


@contextlib.contextmanager
def reaping(proc: subprocess.Popen[Any], run: Path) -> Iterator[None]:
    """Whatever the block does (or raises), the launcher ``proc`` and every fleet process of
    ``run`` are gone afterwards: a still-running launcher is SIGKILLed and waited for, then
    :func:`kill_leftovers` clears its fleet."""
    try:
        yield
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        kill_leftovers(str(run))


def wait_for(pred: Any, timeout_s: float, what: str, poll_s: float = 0.5) -> None:
    """Poll ``pred()`` until true; AssertionError naming ``what`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout_s:.0f}s waiting for {what}")
        time.sleep(poll_s)


def start_launch(args: list[str], log: Path, **popen: Any) -> subprocess.Popen[bytes]:
    """Start ``python -m metaps launch ARGS`` with its output (stdout and stderr) in ``log``.

    The output lives in a file, not a pipe, so a test that fails before the launcher ends
    still shows it (tests/conftest.py prints the log files under a failed test's tmp_path).

    Args:
        args: the command line after ``metaps launch``.
        log: the file for the launcher's output (overwritten).
        popen: extra :class:`subprocess.Popen` keyword arguments (``env``, ``cwd``).
    """
    import sys  # noqa: PLC0415 (only this helper needs it)

    popen.setdefault("cwd", Path(__file__).resolve().parents[2])
    with log.open("wb") as out:
        return subprocess.Popen([sys.executable, "-m", "metaps", "launch", *args], stdout=out,
                                stderr=subprocess.STDOUT, **popen)


def finish_launch(proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> str:
    """Wait up to ``timeout_s`` for a launcher of :func:`start_launch`; its output so far."""
    proc.wait(timeout=timeout_s)
    return log.read_text(errors="replace")
