"""README.md's "Try the pieces" block runs as written, in order, on a fresh checkout.

The block is read from README.md (not copied here), so an edit to the README is what
is tested. It runs in a scratch folder that looks like a fresh clone with ``make
install`` done: ``configs/`` copied, ``.venv`` the project's. Sizes are the only change,
and only in ``gen-data`` (its ``--rows/--users/--items`` scaled down, see ``SMALLER``) so
the whole chain (data, train-local, a launched fleet, evaluate, deliver, predict) fits
the suite's time. Each command runs with ``set -e`` after an echoed marker, so a failure
names the README line that failed.

``make run`` / ``make test`` (the README's first block) are not run here: ``make test``
is this suite, and ``make run`` is ``scripts/main_job.sh``, whose launch and deliver
steps the block below exercises the same way.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Try the pieces one at a time"
SMALLER = {"--rows": "3000", "--users": "300", "--items": "200"}


def readme_block(section: str = SECTION) -> list[str]:
    """The command lines of the first ```bash block after ``section`` in README.md."""
    text = (ROOT / "README.md").read_text()
    start = text.index(section)
    m = re.search(r"```bash\n(.*?)```", text[start:], flags=re.S)
    assert m, f"no ```bash block after {section!r} in README.md"
    return [ln for ln in m.group(1).splitlines() if ln.strip() and not ln.lstrip().startswith("#")]


def shrink(line: str) -> str:
    """``gen-data`` at a test size; every other line verbatim."""
    words = shlex.split(line, comments=True)
    if words[:2] != ["metaps", "gen-data"]:
        return line
    out = list(words)
    for i, w in enumerate(words[:-1]):
        if w in SMALLER:
            out[i + 1] = SMALLER[w]
    return shlex.join(out)


def test_the_block_is_found_and_shrunk() -> None:
    lines = readme_block()
    assert lines[0] == ". .venv/bin/activate"
    gen = [ln for ln in lines if ln.startswith("metaps gen-data")]
    assert gen and "--rows 3000" in shrink(gen[0]) and shrink(lines[1 + lines.index(gen[0])]) == lines[1 + lines.index(gen[0])]


def test_try_the_pieces_runs_as_written_in_order(tmp_path: Path) -> None:
    # the venv running this suite (make test: the checkout's .venv)
    venv = Path(sys.prefix) if sys.prefix != sys.base_prefix else ROOT / ".venv"
    assert (venv / "bin" / "metaps").exists(), "run `make install` first (the README's set-up)"
    work = tmp_path / "clone"
    work.mkdir()
    shutil.copytree(ROOT / "configs", work / "configs")
    (work / ".venv").symlink_to(venv)
    lines = readme_block()
    script = ["set -euo pipefail"]
    for i, line in enumerate(lines):
        script += [f"echo '::readme {i}' >&2", shrink(line)]
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAPS_")}
    env["PYTHONPATH"] = str(ROOT)  # this checkout's code (the venv's editable install may point elsewhere)
    r = subprocess.run(["bash", "-c", "\n".join(script)], cwd=work, env=env, capture_output=True, text=True,
                       timeout=900)
    if r.returncode != 0:
        marks = re.findall(r"::readme (\d+)", r.stderr)
        failed = lines[int(marks[-1])] if marks else "(before the first command)"
        raise AssertionError(f"README line failed (exit {r.returncode}): {failed}\n--- stderr tail ---\n"
                             f"{r.stderr[-3000:]}\n--- stdout tail ---\n{r.stdout[-1500:]}")
    # what the block promises: a launched run behind `latest`, a published bundle, scores with the kept columns
    latest = work / "runs" / "local" / "runs" / "latest"
    assert (latest / "report.json").is_file()
    assert (work / "runs" / "local" / "bundles" / "LATEST").is_file()
    scores = pq.read_table(work / "runs" / "local" / "scores.parquet")
    assert {"user_id", "click"} <= set(scores.column_names) and scores.num_rows > 0
