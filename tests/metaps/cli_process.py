"""Run the real ``metaps`` command line in a subprocess and say whether it imported torch.

A refused command line should fail before the heavy imports (torch costs ~2.5 CPU-s):
:func:`run_metaps` runs ``metaps.cli.main`` as ``python -m metaps`` would, then appends
one marker line to stdout saying whether ``torch`` got imported; the marker is taken
off the returned stdout, so stderr and stdout read as they would without it.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

_MARK = "@@metaps-test torch imported: "
_PROG = f"""import sys
from metaps.cli import main
try:
    rc = main(sys.argv[1:])
finally:
    sys.stdout.flush()
    print({_MARK!r} + str('torch' in sys.modules))
sys.exit(rc)
"""


def run_metaps(args: list[str], cwd: Path, env: dict[str, str]) -> tuple[subprocess.CompletedProcess[str], bool]:
    """(the finished process with the marker taken off stdout, whether it imported torch).

    Args:
        args: the command line after ``metaps``.
        cwd: working directory.
        env: the process environment.
    """
    res = subprocess.run([sys.executable, "-c", _PROG, *args], cwd=cwd, env=env, capture_output=True, text=True,
                         timeout=300, check=False)
    head, sep, tail = res.stdout.rpartition(_MARK)
    assert sep, f"no torch marker on stdout (the process died?): {res.stderr[-2000:]}"
    res.stdout = head
    return res, tail.strip() == "True"
