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

docs/operations.md's quick paths run next, in the same clone, on what the README chain
built (issue 14): every fenced block of that file is either in :data:`OPS_RUN` (its
commands run in order; a command identical to a README line already ran and is not
repeated) or in :data:`OPS_SKIPPED_BY_DESIGN` with the reason it cannot run here, and
:func:`test_every_operations_block_is_run_or_skipped_by_design` fails on a block that is
neither.
"""

from __future__ import annotations

import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import json
from typing import Any

import pyarrow.parquet as pq
import pytest

ROOT = Path(__file__).resolve().parents[1]
SECTION = "## Try the pieces one at a time"
SMALLER = {"--rows": "3000", "--users": "300", "--items": "200"}
OPERATIONS = ROOT / "docs" / "operations.md"
OPS_RUN = ("One machine: `metaps launch`", "Evaluate, deliver, predict")
"""Sections of docs/operations.md whose command blocks run, in document order."""
OPS_SKIPPED_BY_DESIGN = {
    "The run directory": "a directory tree, not commands",
    "Across hosts: the scripts": "several hosts (10.0.0.x addresses, a shared run directory); "
                                 "tests/scripts/test_multi_host.py runs this recipe, one network namespace per role",
    "GPU install": "a GPU machine and a fresh venv with the CUDA install set (bench/gpu_check.sh runs there)",
}
"""Sections whose blocks cannot run here, and why."""


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


def doc_blocks(path: Path = OPERATIONS) -> list[tuple[str, list[str]]]:
    """Every fenced block of a markdown file: (its ``## `` section, its commands).

    A command joins its ``\\``-continued lines; blank and comment-only lines are dropped.
    """
    out: list[tuple[str, list[str]]] = []
    section = ""
    lines = path.read_text().splitlines()
    i = 0
    while i < len(lines):
        ln = lines[i]
        if ln.startswith("## "):
            section = ln[3:].strip()
        if ln.startswith("```"):
            body: list[str] = []
            i += 1
            while i < len(lines) and not lines[i].startswith("```"):
                body.append(lines[i])
                i += 1
            cmds: list[str] = []
            cur = ""
            for b in body:
                cur = f"{cur}\n{b}" if cur else b
                if b.rstrip().endswith("\\"):
                    continue
                if cur.strip() and not cur.lstrip().startswith("#"):
                    cmds.append(cur)
                cur = ""
            out.append((section, cmds))
        i += 1
    return out


def _words(cmd: str) -> list[str]:
    return shlex.split(cmd.replace("\\\n", " "), comments=True)


def _run(work: Path, cmds: list[str], tag: str) -> subprocess.CompletedProcess[str]:
    """``cmds`` in order in ``work`` under ``set -e``; a failure names the command that failed."""
    script = ["set -euo pipefail"]
    for i, cmd in enumerate(cmds):
        script += [f"echo '::{tag} {i}' >&2", cmd]
    env = {k: v for k, v in os.environ.items() if not k.startswith("METAPS_")}
    env["PYTHONPATH"] = str(ROOT)  # this checkout's code (the venv's editable install may point elsewhere)
    r = subprocess.run(["bash", "-c", "\n".join(script)], cwd=work, env=env, capture_output=True, text=True,
                       timeout=900)
    if r.returncode != 0:
        marks = re.findall(rf"::{tag} (\d+)", r.stderr)
        failed = cmds[int(marks[-1])] if marks else "(before the first command)"
        raise AssertionError(f"{tag} command failed (exit {r.returncode}): {failed}\n--- stderr tail ---\n"
                             f"{r.stderr[-3000:]}\n--- stdout tail ---\n{r.stdout[-1500:]}")
    return r


@pytest.fixture(scope="module")
def readme_clone(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh-clone look-alike where README.md's "Try the pieces" block ran, as written, in order."""
    # the venv running this suite (make test: the checkout's .venv)
    venv = Path(sys.prefix) if sys.prefix != sys.base_prefix else ROOT / ".venv"
    assert (venv / "bin" / "metaps").exists(), "run `make install` first (the README's set-up)"
    work = tmp_path_factory.mktemp("readme") / "clone"
    work.mkdir()
    shutil.copytree(ROOT / "configs", work / "configs")
    shutil.copytree(ROOT / "scripts", work / "scripts")
    (work / ".venv").symlink_to(venv)
    _run(work, [shrink(line) for line in readme_block()], "README")
    return work


@pytest.mark.timeout(900)
def test_try_the_pieces_runs_as_written_in_order(readme_clone: Path) -> None:
    work = readme_clone
    # what the block promises: a launched run behind `latest`, a published bundle, scores with the kept columns
    latest = work / "runs" / "local" / "runs" / "latest"
    assert (latest / "report.json").is_file()
    assert (work / "runs" / "local" / "bundles" / "LATEST").is_file()
    scores = pq.read_table(work / "runs" / "local" / "scores.parquet")
    assert {"user_id", "click"} <= set(scores.column_names) and scores.num_rows > 0


def test_every_operations_block_is_run_or_skipped_by_design() -> None:
    blocks = doc_blocks()
    sections = [sec for sec, _ in blocks]
    unknown = sorted({sec for sec in sections if sec not in OPS_RUN and sec not in OPS_SKIPPED_BY_DESIGN})
    assert not unknown, f"docs/operations.md blocks neither run nor skipped by design (add them): {unknown}"
    assert set(OPS_RUN) <= set(sections) and set(OPS_SKIPPED_BY_DESIGN) <= set(sections)
    runnable = [c for sec, cmds in blocks if sec in OPS_RUN for c in cmds]
    assert len(runnable) >= 8 and all(c.split()[0] in ("metaps", "scripts/launch_local.sh") for c in runnable), runnable


@pytest.mark.timeout(900)
def test_operations_quick_paths_run_as_written_after_the_readme(readme_clone: Path) -> None:
    work = readme_clone
    done = [_words(shrink(line)) for line in readme_block()]
    cmds: list[str] = []
    repeated: list[str] = []
    for sec, block in doc_blocks():
        if sec in OPS_RUN:
            for c in block:
                (repeated if _words(c) in done else cmds).append(c)
    # the plain launch and the gated deliver are the README's own lines: they already ran in this clone
    assert [" ".join(_words(c)) for c in repeated] == [
        "metaps launch --config configs/local.toml",
        "metaps deliver --run runs/local/runs/latest --out runs/local/bundles --holdout runs/local/metaio-holdout",
    ], repeated
    # the reader's shell has the venv active (README's set-up, the chain's first line); this is a new shell
    _run(work, [". .venv/bin/activate", *cmds], "operations")
    local = work / "runs" / "local"
    small = json.loads((local / "try1" / "report.json").read_text())  # the smaller warm-started fleet
    assert small["status"] == "succeeded" and small["counts"] == {"ps": 1, "workers": 1}, small.get("reason")
    assert small["resumed_from"] and small["checkpoint"]
    first_k: dict[str, Any] = json.loads((local / "first-k.json").read_text())
    assert first_k.get("adapted") and first_k.get("base")
    assert (local / "bundles-ungated" / "LATEST").is_file()
    scores = pq.read_table(local / "scores-adapted.parquet")
    assert {"user_id", "click"} <= set(scores.column_names) and scores.num_rows > 0
    # the time split: the past trained, early stopping validated on the later rows (every epoch recorded)
    cut = json.loads((local / "time2" / "time_cut.json").read_text())["cut"]
    assert cut < json.loads((local / "time1" / "time_cut.json").read_text())["cut"]
    timed = json.loads((local / "time-run" / "report.json").read_text())
    assert timed["status"] == "succeeded" and timed["validation"]["losses"], timed.get("validation")
