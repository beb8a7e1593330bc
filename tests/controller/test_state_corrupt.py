"""A corrupted controller state file: the controller refuses to start, in one line naming
the file (``StateCorrupt``, a MetapsError: ``metaps controller`` exits 1), and never
serves a call it then fails (UNKNOWN / INVALID_ARGUMENT on every status, issue 27).

The state is real LMDB written by a real controller; the damage is 16 flipped bytes
(a record's value, a page's node pointers) or a file that is not LMDB at all.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from controller.client import ControllerClient
from controller.server import ControllerServer
from controller.state import StateCorrupt
from metaps.cli import run_command

from .conftest import RPC, TRAIN, small_cfg

ROOT = Path(__file__).resolve().parents[2]
PAGE = 4096


def _state(tmp_path: Path) -> Path:
    """A state dir a controller wrote: a registered worker, done shards, a committed cut."""
    state = tmp_path / "state"
    srv = ControllerServer(small_cfg(), state, [TRAIN], RPC)
    srv.start("127.0.0.1:0")
    try:
        c = ControllerClient(srv.address, RPC, role="worker", index=0)
        c.register(incarnation="w0")
        for i, lease in enumerate(c.shards("train", poll_s=0.01)):
            assert c.report_shard(lease, "done", samples=1).kind == "done"
            if i == 3:
                break
        cut = srv.checkpoints.open_cut()
        srv.checkpoints.commit(cut, 1, str(tmp_path / "ckpt-1"))
        c.close()
    finally:
        srv.stop(0)
    (state / "lock.mdb").unlink()
    return state


def _flip(state: Path, offset: int, n: int = 16) -> None:
    p = state / "data.mdb"
    b = bytearray(p.read_bytes())
    for i in range(offset, offset + n):
        b[i] ^= 0x5A
    p.write_bytes(bytes(b))


def _offset(state: Path, needle: bytes) -> int:
    at = (state / "data.mdb").read_bytes().find(needle)
    assert at > 0, needle
    return at


def _refused(state: Path) -> str:
    with pytest.raises(StateCorrupt) as err:
        ControllerServer(small_cfg(), state, [TRAIN], RPC)
    msg = str(err.value)
    assert str(state / "data.mdb") in msg and "\n" not in msg, msg
    return msg


def test_a_corrupt_record_is_refused_at_start_not_served(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    state = _state(tmp_path)
    _flip(state, _offset(state, b'"state":"committed"'))  # inside the committed cut's record
    assert "no JSON record" in _refused(state) or "unreadable" in _refused(state)
    state = _state(tmp_path / "2")
    _flip(state, (_offset(state, b'"state":"committed"') // PAGE) * PAGE + 16)  # that page's node offsets
    _refused(state)
    # `metaps controller` reports it in one line and exits 1 (common/exit_codes.py FAILED); log
    # records on stderr (when an earlier test of this worker installed the CLI's log handler) are not
    # the command's output
    capsys.readouterr()
    rc = run_command("controller", lambda a: ControllerServer(small_cfg(), state, [TRAIN], RPC) and 0, None)  # type: ignore[arg-type]
    lines = [ln for ln in capsys.readouterr().err.strip().splitlines()
             if not re.match(r"\d{4}-\d\d-\d\dT\d\d:\d\d:\d\d [A-Z]+ ", ln)]
    assert rc == 1 and len(lines) == 1 and str(state / "data.mdb") in lines[0], (rc, lines)


def test_a_file_that_is_not_lmdb_is_refused(tmp_path: Path) -> None:
    state = _state(tmp_path)
    _flip(state, 0, PAGE)  # the meta page
    assert "unreadable" in _refused(state) or "cannot be opened" in _refused(state)


def test_a_damaged_page_is_refused_even_where_reading_it_kills_the_process(tmp_path: Path) -> None:
    """The node offsets of the page holding the dataset cursor: reading it ends the reader with
    SIGBUS, which no except catches; the controller (here its own process) must still refuse
    in one line, not die."""
    state = _state(tmp_path)
    at = _offset(state, b'order_head')  # the page holding the dataset's cursor (meta database)
    _flip(state, (at // PAGE) * PAGE + 16)  # right after the page header: the node offsets
    code = textwrap.dedent(f"""
        import json, sys
        from controller.server import ControllerServer
        from controller.state import StateCorrupt
        from tests.controller.conftest import RPC, TRAIN, small_cfg
        try:
            srv = ControllerServer(small_cfg(), {str(state)!r}, [TRAIN], RPC)
        except StateCorrupt as exc:
            print(json.dumps({{"refused": str(exc)}}))
            sys.exit(0)
        srv.start("127.0.0.1:0")
        from controller.client import ControllerClient
        c = ControllerClient(srv.address, RPC, role="worker", index=0, retry_s=1)
        c.register(incarnation="w1"); c.status(); c.get_shard("train")
        print(json.dumps({{"served": True}}))
    """)
    r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    out = r.stdout.strip().splitlines()
    assert r.returncode == 0 and out, f"rc={r.returncode}\n{r.stdout}\n{r.stderr[-5000:]}"
    got = json.loads(out[-1])
    assert "refused" in got and str(state / "data.mdb") in got["refused"] and "\n" not in got["refused"], got
