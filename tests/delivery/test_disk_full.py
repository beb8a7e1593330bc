"""`metaps deliver` on a full disk (issue 27 item 3): one clear line, non-zero exit, nothing
partial left under the publish root, the previous LATEST untouched.

A real full disk: the publish root is on a small tmpfs in a private mount namespace
(``unshare -rm``; skipped where that is not allowed), filled up after a first delivery.
"""

from __future__ import annotations

import json
import os
import sys
import textwrap
from pathlib import Path

from tests.tmpfs import run_on_tmpfs


ROOT = Path(__file__).resolve().parents[2]

_SCRIPT = textwrap.dedent("""
    import json, os, sys
    from metaps.cli import main
    mnt, first, second = sys.argv[1:4]
    out = os.path.join(mnt, "bundles")
    rc1 = main(["deliver", "--no-gate", "--checkpoint", first, "--out", out])
    st = os.statvfs(mnt)
    with open(os.path.join(mnt, "filler"), "wb") as fh:  # leave 8 KiB: the lock file fits, a bundle does not
        fh.write(b"\\0" * max(0, st.f_bavail * st.f_frsize - 8192))
    rc2 = main(["deliver", "--no-gate", "--checkpoint", second, "--out", out])
    latest = open(os.path.join(out, "LATEST")).read().strip()
    print("RESULT " + json.dumps({"rc": [rc1, rc2], "left": sorted(os.listdir(out)), "latest": latest}))
""")


def test_deliver_on_a_full_disk_says_so_and_leaves_nothing(tmp_path: Path, history) -> None:
    mnt = tmp_path / "mnt"
    script = tmp_path / "deliver_full.py"
    script.write_text(_SCRIPT)
    r = run_on_tmpfs(mnt, "8m", [sys.executable, str(script), str(mnt), str(history.ckpts[20]), str(history.ckpts[30])],
                     cwd=ROOT, timeout=300, env={**os.environ, "PYTHONPATH": str(ROOT)})
    assert r.returncode == 0, (r.returncode, r.stderr[-3000:])
    res = json.loads(next(x for x in r.stdout.splitlines() if x.startswith("RESULT "))[7:])
    assert res["rc"] == [0, 1], (res, r.stderr[-3000:])
    assert "Traceback" not in r.stderr, r.stderr[-3000:]
    errors = [x for x in r.stderr.splitlines() if x.startswith("metaps deliver: error:")]
    assert len(errors) == 1 and "no space left on device" in errors[0], r.stderr[-3000:]
    assert "nothing was published, LATEST unchanged" in errors[0], errors[0]
    # nothing partial: no staging dir, no second version, no LATEST.tmp, no lock file
    assert res["left"] == ["LATEST", "v000001"], res
    assert res["latest"] == "v000001"
