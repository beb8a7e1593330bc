"""scripts/launch_ps.sh and launch_workers.sh: the argument checks shared through _fleet_lib.sh.

Every bad argument is one ``SCRIPT: error: ...`` line on stderr, exit 2, and nothing
is started (no pid file, no log): an index list is checked whole before the first agent.
"""

from __future__ import annotations

import subprocess
from pathlib import Path

import pytest

SCRIPTS = Path(__file__).resolve().parents[2] / "scripts"


def run(script: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["bash", str(SCRIPTS / script), *args], capture_output=True, text=True, timeout=60)


@pytest.fixture
def job(tmp_path: Path) -> Path:
    cfg = tmp_path / "job.toml"
    cfg.write_text("# any file: the checks fail before it is read\n")
    return cfg


def common(job: Path, run_dir: Path) -> list[str]:
    return ["--config", str(job), "--controller", "127.0.0.1:1", "--run-dir", str(run_dir)]


@pytest.mark.parametrize(("script", "extra", "message"), [
    ("launch_ps.sh", ["--shards", "0,x"], "--shards: 'x' is not a shard index"),
    ("launch_ps.sh", ["--shards", ""], "--shards is required (e.g. 0,1)"),
    ("launch_ps.sh", ["--shards", "0", "--port-base", "50a"], "--port-base must be a non-negative integer, got '50a'"),
    ("launch_ps.sh", ["--shards", "0", "--metrics-port-base", "-1"],
     "--metrics-port-base must be a non-negative integer, got '-1'"),
    ("launch_workers.sh", ["--ps", "127.0.0.1:2", "--ranks", "0,1,r2"], "--ranks: 'r2' is not a worker rank"),
    ("launch_workers.sh", ["--ps", "127.0.0.1:2", "--ranks", "0", "--metrics-port-base", "x"],
     "--metrics-port-base must be a non-negative integer, got 'x'"),
    ("launch_workers.sh", ["--ranks", "0"], "--ps HOST:PORT,... is required (launch_ps.sh prints it)"),
])
def test_bad_argument_is_one_line_and_starts_nothing(tmp_path, job, script, extra, message):
    run_dir = tmp_path / "run"
    proc = run(script, *common(job, run_dir), *extra)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.splitlines() == [f"{script}: error: {message}"]
    assert not (run_dir / "pids").exists() or not any((run_dir / "pids").iterdir())


@pytest.mark.parametrize("script", ["launch_ps.sh", "launch_workers.sh"])
def test_job_args_are_checked(tmp_path, job, script):
    missing = tmp_path / "nope.toml"
    cases = [
        ([], "--run-dir is required"),
        (["--run-dir", str(tmp_path)], "--config is required"),
        (["--run-dir", str(tmp_path), "--config", str(missing)], f"--config {missing}: no such file"),
        (["--run-dir", str(tmp_path), "--config", str(job)], "--controller HOST:PORT is required"),
        (["--bogus"], "unknown argument '--bogus' (see --help)"),
    ]
    for args, message in cases:
        proc = run(script, *args)
        assert (proc.returncode, proc.stderr.splitlines()) == (2, [f"{script}: error: {message}"]), args


@pytest.mark.parametrize("script", ["launch_ps.sh", "launch_workers.sh"])
def test_help_prints_the_header_only(script):
    proc = run(script, "--help")
    assert proc.returncode == 0
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("Start the ") and f"scripts/{script} --stop --run-dir DIR" in proc.stdout
    assert lines[-1].startswith("Every process gets METAPS_T0")
    assert not any(line.startswith(("set -", "#")) for line in lines)
