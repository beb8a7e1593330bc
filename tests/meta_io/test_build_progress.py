"""Progress of ``meta-io build``: the pipeline's hook (real builds of tiny generated data) and
what the CLI makes of it (a bar on a terminal; ``msg="progress"`` lines with pct/eta_s off one;
stdout still the one result)."""

from __future__ import annotations

import io
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from rich.console import Console

from meta_io.build import MetaIOBuildConfig, build
from meta_io.build.pipeline import BuildStage
from meta_io.layout import Layout
from meta_io.synth import GeneratedData
from metaps.cli import main
from metaps.progress import StageProgress, parse_kv_line
from tests.progress_hooks import Recorder, check_stage

REPO = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("layout", ["meta", "plain"])
def test_build_reports_monotone_progress_ending_at_the_input_rows(generated: GeneratedData, tmp_path: Path,
                                                                  layout: str) -> None:
    rec = Recorder()
    cfg = MetaIOBuildConfig(layout=Layout(layout), support=4, query=2, partitions=3, source_batch_rows=400)
    res = build(generated.out_dir, generated.schema_path, tmp_path / "mio", cfg, progress=rec)
    rows = res.manifest["totals"]["input_rows"]
    assert rows == generated.rows == 3000
    assert rec.stages() == [BuildStage.READ, BuildStage.PACK]  # pass 1 then pass 2, each once
    read, pack = rec.of(BuildStage.READ), rec.of(BuildStage.PACK)
    check_stage(read, rows)
    check_stage(pack, rows)
    # pass 1 tells each source batch (3000 rows in 1000-row groups, 400-row batches: >= 8), pass 2 each partition
    assert len({d for d, _t in read}) >= 8, read
    assert len(pack) == 1 + 3 and len({d for d, _t in pack}) == 4, pack


def test_a_terminal_gets_a_bar_per_pass(generated: GeneratedData, tmp_path: Path) -> None:
    buf = io.StringIO()
    with StageProgress(Console(file=buf, force_terminal=True, width=120)) as hook:
        build(generated.out_dir, generated.schema_path, tmp_path / "mio", MetaIOBuildConfig(partitions=2),
              progress=hook)
    out = buf.getvalue()
    for stage in ("pass1", "pass2"):
        assert stage in out
    assert "100%" in out and "3,000/3,000" in out and "ETA" in out


def test_log_lines_carry_pct_and_eta_as_the_build_goes(generated: GeneratedData, tmp_path: Path,
                                                       caplog: pytest.LogCaptureFixture) -> None:
    import logging

    with caplog.at_level(logging.INFO, logger="metaps.progress"):
        with StageProgress(None, log_every_s=0.0) as hook:  # every reading logged
            build(generated.out_dir, generated.schema_path, tmp_path / "mio",
                  MetaIOBuildConfig(partitions=3, source_batch_rows=400), progress=hook)
    recs = [r.kv for r in caplog.records if r.getMessage() == "progress"]  # type: ignore[attr-defined]
    for stage in ("pass1", "pass2"):
        mine = [r for r in recs if r["what"] == stage]
        assert len(mine) >= 3, recs
        pct = [r["pct"] for r in mine]
        assert pct == sorted(pct) and pct[-1] == 100.0 and any(0 < p < 100 for p in pct), pct
        assert all(r["total"] == 3000 and "eta_s" in r for r in mine)
        assert mine[-1]["eta_s"] == 0
        between = [r for r in mine if 0 < r["pct"] < 100]
        assert between and all(isinstance(r["eta_s"], int) and r["eta_s"] >= 0 for r in between), mine


def _progress_lines(stderr: str) -> list[dict]:
    return [rec for line in stderr.splitlines()
            if 'msg="progress"' in line and (rec := parse_kv_line(line)) is not None]


def test_cli_off_a_terminal_logs_each_pass_and_json_stays_one_object(generated: GeneratedData, tmp_path: Path,
                                                                     capsys: pytest.CaptureFixture[str]) -> None:
    args = ["meta-io", "build", "--input", str(generated.out_dir), "--schema", str(generated.schema_path),
            "--partitions", "2"]
    for extra in ([], ["--no-progress"]):
        capsys.readouterr()
        assert main(["--json", *args, "--out", str(tmp_path / f"mio{len(extra)}"), *extra]) == 0
        cap = capsys.readouterr()
        lines = cap.out.strip().splitlines()
        assert len(lines) == 1 and json.loads(lines[0])["input_rows"] == 3000  # stdout: exactly the result
        got = {r["what"]: r for r in _progress_lines(cap.err)}
        assert set(got) == {"pass1", "pass2"}, cap.err  # each pass leaves a line when it ends
        for r in got.values():
            assert (r["done"], r["total"], r["pct"], r["eta_s"]) == (3000, 3000, 100.0, 0), r
            assert "\x1b[" not in cap.err  # no bar drawn off a terminal


def test_real_process_logs_progress_on_stderr_only(generated: GeneratedData, tmp_path: Path) -> None:
    """``python -m metaps`` as a script runs it (stderr a pipe): progress lines on stderr, one JSON object on stdout."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "metaps", "--json", "meta-io", "build", "--input", str(generated.out_dir),
           "--schema", str(generated.schema_path), "--out", str(tmp_path / "mio"), "--partitions", "2"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    assert len(res.stdout.strip().splitlines()) == 1 and json.loads(res.stdout)["input_rows"] == 3000
    recs = _progress_lines(res.stderr)
    assert [r["what"] for r in recs] == ["pass1", "pass2"], res.stderr
    assert all(r["pct"] == 100.0 and r["eta_s"] == 0.0 for r in recs), recs
