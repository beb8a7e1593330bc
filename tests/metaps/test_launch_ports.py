"""Ports (issue 37, item 6): every server binds its own port (0, or the configured one) and
publishes what it got; a configured port is honoured or refused in one line; a port in use
is one line naming it, with nothing left behind.

* ``--set ps.base_port=P`` / ``controller.address=HOST:P`` with P in use: ``metaps launch``
  refuses in one line naming the port, before anything starts (it used to ignore both);
* a ``/metrics`` port in use: the controller (and an agent) exit 1 with one line naming the
  port and the role, and the controller leaves no ``address`` file (it used to print a
  25-line traceback after writing one);
* a PS shard restarted with the ready file of its earlier process binds that port again (the
  launcher's fleet knows that address), or refuses in one line when it is taken;
* the all-reduce port the launcher reserves is kept from every other process, yet rank 0's
  gloo ``TCPStore`` binds it, again after a restart.

The behavioural launch (ports the old launcher pre-picked taken between pick and bind, and a
``base_port`` honoured) shares the fleet of ``test_launch_max_steps.py``.

No test assumes it is alone on the machine: a port a test needs busy is one it listens on
itself; a port it needs free is one it holds reserved (:mod:`common.ports`).
"""

from __future__ import annotations

import contextlib
import datetime
import json
import os
import re
import socket
import subprocess
import sys
from pathlib import Path
from typing import Iterator

import pytest

from tests.metaps.fleet_data import make_data, wait_for, write_job_file

REPO = Path(__file__).resolve().parents[2]
_LOG_LINE = re.compile(r"^\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d (DEBUG|INFO|WARNING) ")


@contextlib.contextmanager
def _listening(host: str = "127.0.0.1") -> Iterator[int]:
    """A port this test holds busy: bound to ``host`` and listening, until the block ends."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        s.listen()
        yield int(s.getsockname()[1])


def _env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k not in ("METAPS_TOKEN", "METAPS_RUN_DIR", "METAPS_CONTROLLER")}
    return {**env, "PYTHONPATH": str(REPO)}


def _metaps(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "metaps", *args], cwd=REPO, env=_env(), capture_output=True,
                          text=True, timeout=timeout, check=False)


def _error_lines(res: subprocess.CompletedProcess[str]) -> list[str]:
    """stderr without the structured log lines (INFO/WARNING) a role writes before it fails."""
    return [line for line in res.stderr.strip().splitlines() if line.strip() and not _LOG_LINE.match(line)]


def _shown(res: subprocess.CompletedProcess[str]) -> str:
    return f"exit {res.returncode}\n--- stdout\n{res.stdout[-3000:]}\n--- stderr\n{res.stderr[-5000:]}"


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_data(tmp_path_factory.mktemp("ports-data"))


@pytest.mark.timeout(600)
@pytest.mark.parametrize("key", ["ps.base_port", "controller.address"])
def test_a_configured_port_in_use_is_refused_in_one_line(key: str, data: dict[str, Path], tmp_path: Path) -> None:
    cfg = write_job_file(tmp_path / "job.toml", data, workers=1, ps=2)
    run = tmp_path / "run"
    with _listening() as port:
        value = str(port - 1) if key == "ps.base_port" else f'"127.0.0.1:{port}"'  # base_port: shard 1's is busy
        # max_steps/timeout: a launch that ignored the port would still end, and the test fail, soon
        res = _metaps("launch", "--config", str(cfg), "--run-dir", str(run), "--no-progress", "--timeout", "240",
                      "--set", f"{key}={value}", "--set", "train.max_steps=2", timeout=400)
    assert res.returncode == 1, _shown(res)
    lines = _error_lines(res)
    assert len(lines) == 1 and "Traceback" not in res.stderr, _shown(res)
    assert lines[0].startswith("metaps launch: error: ") and f"127.0.0.1:{port}: the port is in use" in lines[0], lines
    assert ("PS shard 1" if key == "ps.base_port" else "[controller] address") in lines[0], lines
    assert not run.exists()  # refused before anything was created or started


@pytest.mark.timeout(300)
def test_a_metrics_port_in_use_is_one_line_naming_it_and_leaves_no_address_file(
        data: dict[str, Path], tmp_path: Path) -> None:
    cfg = write_job_file(tmp_path / "job.toml", data, workers=1, ps=1)
    state = tmp_path / "controller"
    with _listening() as port:
        ctl = _metaps("controller", "--config", str(cfg), "--address", "127.0.0.1:0", "--state-dir", str(state),
                      "--metrics-port", str(port))
        agent = _metaps("agent", "--config", str(cfg), "--role", "worker", "--index", "0",
                        "--controller", "127.0.0.1:1", "--metrics-port", str(port), "--", sys.executable, "-c", "0")
    for res, role in ((ctl, "metaps controller"), (agent, "metaps agent worker:0")):
        assert res.returncode == 1, (role, _shown(res))
        lines = _error_lines(res)
        assert len(lines) == 1 and "Traceback" not in res.stderr, (role, _shown(res))
        assert role in lines[0] and f"/metrics on 127.0.0.1:{port}: the port is in use" in lines[0], (role, lines)
    # nothing names a controller that never served
    assert not (state / "address").exists(), (state / "address").read_text()


@pytest.mark.timeout(300)
def test_a_restarted_shard_binds_the_port_its_earlier_process_published(tmp_path: Path) -> None:
    from tests.ps.conftest import write_job as write_ps_job

    job = write_ps_job(tmp_path, shards=1)
    ready = tmp_path / "ps-0.ready"
    cmd = ["ps", "--config", str(job), "--shard", "0", "--ready-file", str(ready), "--checkpoint-root", str(tmp_path)]
    # its earlier port is taken by now: one line naming it (before torch), exit 1
    with _listening() as busy:
        ready.write_text(json.dumps({"port": busy, "metrics_port": 0, "pid": 1}))
        res = _metaps(*cmd, timeout=60)
    assert res.returncode == 1, _shown(res)
    lines = _error_lines(res)
    assert len(lines) == 1 and f"127.0.0.1:{busy}" in lines[0] and str(ready) in lines[0], _shown(res)
    # free (held reserved here, so no other process takes it meanwhile): the shard serves on it again
    from common.ports import reserve_port

    with reserve_port() as held:
        ready.write_text(json.dumps({"port": held.port, "metrics_port": 0, "pid": 1}))
        log = tmp_path / "ps.log"
        with log.open("wb") as out:
            proc = subprocess.Popen([sys.executable, "-m", "metaps", *cmd], cwd=REPO, env=_env(), stdout=out,
                                    stderr=subprocess.STDOUT)
        try:
            def republished() -> bool:
                assert proc.poll() is None, f"the shard exited {proc.returncode}:\n{log.read_text()[-4000:]}"
                try:
                    return int(json.loads(ready.read_text())["pid"]) == proc.pid
                except (OSError, ValueError):
                    return False

            wait_for(republished, 120, "the shard's new ready file", poll_s=0.1)
            info = json.loads(ready.read_text())
            assert info["port"] == held.port, (info, log.read_text()[-3000:])
            with socket.create_connection(("127.0.0.1", held.port), timeout=5):
                pass  # it listens there
        finally:
            proc.terminate()
            proc.wait(60)


@pytest.mark.timeout(120)
def test_the_reserved_allreduce_port_is_kept_from_others_but_not_from_rank_0() -> None:
    import torch.distributed as dist

    from common.errors import BindError
    from common.ports import reserve_port

    with reserve_port() as r:
        # nobody else gets it: not a plain bind of it ...
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s, pytest.raises(OSError):
            s.bind(("127.0.0.1", r.port))
        # ... and not a server asking the kernel for any free port
        socks = [socket.socket(socket.AF_INET, socket.SOCK_STREAM) for _ in range(300)]
        try:
            for s in socks:
                s.bind(("127.0.0.1", 0))
            assert r.port not in {s.getsockname()[1] for s in socks}
        finally:
            for s in socks:
                s.close()
        # rank 0's rendezvous binds it and serves, and again after a restart, while the launcher holds it
        for attempt in range(2):
            store = dist.TCPStore("127.0.0.1", r.port, 1, True, timeout=datetime.timedelta(seconds=10))
            store.set("attempt", str(attempt))
            client = dist.TCPStore("127.0.0.1", r.port, 1, False, timeout=datetime.timedelta(seconds=10))
            assert client.get("attempt") == str(attempt).encode()
            del client, store
    assert not r.held
    with _listening() as busy, pytest.raises(BindError, match=f"cannot reserve 127.0.0.1:{busy}: "):
        reserve_port(port=busy)  # a port in use: one line naming it
