"""A PS process linked to a controller exits cleanly on SIGTERM.

``metaps ps --controller`` runs a :class:`metaps.roles.ps_link.ControllerLink`
thread; on SIGTERM the process stops the link, then drains its gRPC server
(``--grace``) and exits 0. The link once named its stop flag ``_stop``, which
shadows ``threading.Thread._stop`` (called by ``join`` when the thread ends):
every linked PS then died on shutdown with ``TypeError: 'Event' object is not
callable``, exit 1, its server never drained.
"""

from __future__ import annotations

import signal
import time
from pathlib import Path
from typing import Any

import pytest

from tests.ps.conftest import start_ps_process, write_job


def test_linked_ps_exits_cleanly_on_sigterm(controller: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    srv = controller()
    monkeypatch.setenv("METAPS_CONTROLLER", srv.address)  # what `metaps agent` gives its child
    proc = start_ps_process(write_job(tmp_path, shards=1), 0, tmp_path)
    try:
        deadline = time.monotonic() + 60
        while srv.ps_addresses() != [proc.address]:  # registered by the PS process's link
            assert time.monotonic() < deadline and proc.proc.poll() is None, proc.log()
            time.sleep(0.05)
        proc.proc.send_signal(signal.SIGTERM)
        assert proc.proc.wait(60) == 0, proc.log()[-3000:]
        assert "ps exited cleanly" in proc.log() and "Traceback" not in proc.log(), proc.log()[-3000:]
    finally:
        if proc.proc.poll() is None:
            proc.proc.kill()
            proc.proc.wait(30)
