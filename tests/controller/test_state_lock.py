"""One controller per state directory (issue 37 item 5): a second one is refused before it reads.

Judged on the live controller's state: after a refused intruder, the live one's checkpoint cut
ids run on without a gap and its shards are where it left them. The lock goes with its holder:
a SIGKILLed controller process leaves a directory the next controller opens.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from controller.server import ControllerServer
from controller.state import StateLocked
from metaps.cli import run_command

from .conftest import RPC, TRAIN, small_cfg

ROOT = Path(__file__).resolve().parents[2]


def test_a_second_controller_on_a_live_state_dir_is_refused_and_changes_nothing(tmp_path: Path) -> None:
    state = tmp_path / "state"
    live = ControllerServer(small_cfg(), state, [TRAIN], RPC)
    try:
        first = live.checkpoints.open_cut()
        with pytest.raises(StateLocked) as err:
            ControllerServer(small_cfg(), state, [TRAIN], RPC)
        msg = str(err.value)
        assert str(state) in msg and f"pid {os.getpid()}" in msg and "one controller per state directory" in msg, msg
        assert "\n" not in msg
        second = live.checkpoints.open_cut()
        assert second == first + 1  # the intruder opened no cut in the live state
    finally:
        live.stop(grace=0)
    back = ControllerServer(small_cfg(), state, [TRAIN], RPC)  # stopped: the directory is free again
    back.stop(grace=0)


def test_the_cli_refuses_in_one_line(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = tmp_path / "state"
    live = ControllerServer(small_cfg(), state, [TRAIN], RPC)
    try:
        capsys.readouterr()
        rc = run_command("controller", lambda a: ControllerServer(small_cfg(), state, [TRAIN], RPC) and 0, None)  # type: ignore[arg-type]
        lines = [ln for ln in capsys.readouterr().err.strip().splitlines()
                 if not re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d [A-Z]+ ", ln)]
        assert rc == 1 and len(lines) == 1 and "is in use by another controller" in lines[0], (rc, lines)
    finally:
        live.stop(grace=0)


def test_a_killed_controller_leaves_the_directory_free(tmp_path: Path) -> None:
    state = tmp_path / "state"
    code = textwrap.dedent(f"""
        import sys, time
        from controller.server import ControllerServer
        from tests.controller.conftest import RPC, TRAIN, small_cfg
        srv = ControllerServer(small_cfg(), {str(state)!r}, [TRAIN], RPC)
        print("holding", flush=True)
        time.sleep(120)
    """)
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True)
    try:
        line = proc.stdout.readline() if proc.stdout is not None else ""
        assert line.strip() == "holding", f"the holder did not start: {line!r}\n{proc.stderr.read() if proc.stderr else ''}"
        with pytest.raises(StateLocked, match=f"pid {proc.pid}"):
            ControllerServer(small_cfg(), state, [TRAIN], RPC)
        proc.send_signal(signal.SIGKILL)
        proc.wait(30)
        srv = ControllerServer(small_cfg(), state, [TRAIN], RPC)  # the kernel dropped the dead holder's lock
        srv.stop(grace=0)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)
