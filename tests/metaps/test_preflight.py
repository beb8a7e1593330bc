"""Preflight of ``metaps launch``: deterministic errors are found before any process starts.

Each case runs the real ``metaps launch`` command line in a subprocess: exit 1,
one error line on stderr, no traceback, no run directory (so nothing started and
no ``latest`` link), no fleet process.
"""

from __future__ import annotations

import logging
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from meta_io import layout as L
from metaps.cli import main
from metaps.job import load_job
from metaps.preflight import PreflightError, preflight
from common.toml_writer import write
from tests.metaps.fleet_data import fleet_pids, job_mapping, kill_leftovers, make_data

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    return make_data(tmp_path_factory.mktemp("preflight-data"))


def flip(path: Path, offset: int) -> None:
    b = bytearray(path.read_bytes())
    b[offset] ^= 0xFF
    path.write_bytes(bytes(b))


def make_checkpoint(job_path: Path, root: Path) -> Path:
    """A real committed checkpoint of the job's tables (one shard, empty rows)."""
    from ps.checkpoint import checkpoint_tmp_dir, commit_checkpoint, save_shard
    from ps.shard_store import ShardStore

    job = load_job(job_path)
    store = ShardStore(job.table_configs(), shard_id=0, num_vshards=job.ps.num_vshards, seed=0, device="cpu")
    tmp = checkpoint_tmp_dir(root, 5)
    save_shard(store, tmp, 0)
    return commit_checkpoint(tmp, {"step": 5})


def case_job(case: str, data: dict[str, Path], tmp: Path) -> tuple[Path, list[str], str]:
    """(job file, extra launch args, expected message fragment) for one bad input."""
    d = dict(data)
    sections: dict = {}
    args: list[str] = []
    if case == "unknown table":
        sections["ps"] = {"tables": [{"name": "itme", "dim": 8}]}
        want = "[[ps.tables]] overrides unknown table(s) ['itme']"
    elif case == "truncated dataset":
        d["train"] = tmp / "train"
        shutil.copytree(data["train"], d["train"])
        part = d["train"] / "part-00000.arrow"
        part.write_bytes(part.read_bytes()[:-100])
        want = "part-00000.arrow: truncated or modified"
    elif case == "bad resume checksum":
        good = tmp / "good.toml"
        write(good, job_mapping(data, tmp))
        ckpt = make_checkpoint(good, tmp / "ckpts")
        flip(ckpt / "shard-0.lmdb", (ckpt / "shard-0.lmdb").stat().st_size // 3)
        args = ["--resume-from", str(ckpt)]
        want = "shard-0.lmdb: sha256 mismatch"
    elif case == "dd without allreduce":
        sections["controller"] = {"policy": "dd"}  # [train] dense_sync stays "ps"
        want = "[controller] policy = 'dd' needs [train] dense_sync = 'allreduce'"
    elif case == "missing data.train":
        d["train"] = tmp / "no-such-dataset"
        want = f"data.train = {d['train']}: no such directory"
    else:  # "empty data.train"
        d["train"] = ""
        want = "data.train (a Meta-IO dataset directory) is required"
    job = tmp / "job.toml"
    mapping = job_mapping(d, tmp)
    for name, values in sections.items():  # (job_mapping's `ps` keyword is the shard count)
        mapping[name].update(values)
    if case in ("missing data.train", "empty data.train"):
        mapping["data"]["schema"] = str(Path(data["train"]).parent / "raw-train" / "schema.json")
    write(job, mapping)
    return job, args, want


CASES = ["unknown table", "truncated dataset", "bad resume checksum", "dd without allreduce", "missing data.train",
         "empty data.train"]


@pytest.mark.parametrize("case", CASES)
def test_launch_fails_fast_in_one_line(case: str, data: dict[str, Path], tmp_path: Path, capsys) -> None:
    """The ``metaps launch`` command line in this process (a subprocess per case costs a torch import)."""
    job, args, want = case_job(case, data, tmp_path)
    run = tmp_path / "run"
    capsys.readouterr()
    level = logging.getLogger().level
    try:  # (log lines would go to the stderr of whichever test configured logging first)
        rc = main(["--log-level", "ERROR", "launch", "--config", str(job), "--run-dir", str(run), "--no-progress",
                   *args])
        left = fleet_pids(str(run))
    finally:
        logging.getLogger().setLevel(level)
        kill_leftovers(str(run))
    err = capsys.readouterr().err
    assert rc == 1, err[-2000:]
    errors = [ln for ln in err.splitlines() if "error" in ln.lower()]
    assert len(errors) == 1 and errors[0].startswith("metaps launch: error: "), err[-2000:]
    assert want in errors[0], errors[0]
    assert " problems: " not in errors[0]  # one cause, one problem (no follow-on noise)
    assert not run.exists() and left == []
    assert not (tmp_path / "runs").exists()  # [run] dir: no auto-named run, no `latest`


def test_real_launch_process_fails_fast_in_one_line(data: dict[str, Path], tmp_path: Path) -> None:
    """The real process: exit 1, one line on stderr, no traceback, nothing started."""
    job, args, want = case_job("bad resume checksum", data, tmp_path)
    run = tmp_path / "run"
    try:
        proc = subprocess.run([sys.executable, "-m", "metaps", "launch", "--config", str(job), "--run-dir", str(run),
                               "--no-progress", *args],
                              cwd=REPO, check=False, capture_output=True, text=True, timeout=300)
        left = fleet_pids(str(run))
    finally:
        kill_leftovers(str(run))
    assert proc.returncode == 1, proc.stderr[-2000:]
    errors = proc.stderr.strip().splitlines()  # stderr holds the report and nothing else
    assert len(errors) == 1 and errors[0].startswith("metaps launch: error: preflight: "), proc.stderr[-2000:]
    assert want in errors[0], errors[0]
    assert not run.exists() and left == []


def test_every_problem_is_reported_together_in_one_line(data: dict[str, Path], tmp_path: Path) -> None:
    ev = tmp_path / "eval"
    shutil.copytree(data["eval"], ev)
    flip(ev / L.INDEX_NAME, 100)
    job = tmp_path / "job.toml"
    mapping = job_mapping({"train": data["train"], "eval": ev}, tmp_path, model={"table_dims": {"nada": 8}})
    mapping["ps"]["tables"] = [{"name": "nope", "dim": 8}]
    write(job, mapping)
    with pytest.raises(PreflightError) as err:
        preflight(load_job(job))
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith("preflight: 3 problems: ")
    assert "index.arrow: corrupt index file" in msg and "['nope']" in msg and "['nada']" in msg


def test_a_good_job_passes(data: dict[str, Path], tmp_path: Path) -> None:
    job = tmp_path / "job.toml"
    write(job, job_mapping(data, tmp_path))
    ckpt = make_checkpoint(job, tmp_path / "ckpts")
    preflight(load_job(job), resume=ckpt)


@pytest.mark.parametrize("size", [8, 4])
def test_sum_per_support_needs_the_layouts_support_size(size: int, data: dict[str, Path], tmp_path: Path) -> None:
    # the fixture's layout has 4 support rows per task: [meta] inner_support_size must say 4
    job = tmp_path / "job.toml"
    mapping = job_mapping(data, tmp_path)
    mapping["meta"].update(inner_loss_reduction="sum_per_support", inner_support_size=size)
    write(job, mapping)
    if size == 4:
        preflight(load_job(job), build_model=False)
        return
    with pytest.raises(PreflightError) as err:
        preflight(load_job(job), build_model=False)
    msg = str(err.value)
    assert "\n" not in msg and msg.startswith(
        f"preflight: [meta] inner_support_size = 8 but data.train = {data['train']} has 4 support rows per task")


@pytest.mark.parametrize("dense_sync", ["ps", "allreduce"])
def test_dd_policy_needs_allreduce_workers(dense_sync: str, data: dict[str, Path], tmp_path: Path) -> None:
    # PS-mode workers run no DD loop: they would drop every batch-size command the DD policy sends
    job = tmp_path / "job.toml"
    mapping = job_mapping(data, tmp_path, train={"dense_sync": dense_sync})
    mapping["controller"]["policy"] = "dd"
    write(job, mapping)
    if dense_sync == "allreduce":
        preflight(load_job(job), build_model=False)
        return
    with pytest.raises(PreflightError) as err:
        preflight(load_job(job), build_model=False)
    assert str(err.value) == (f"preflight: {job}: [controller] policy = 'dd' needs [train] dense_sync = 'allreduce' "
                              "(DD sets the batch sizes of all-reduce workers), got dense_sync = 'ps'")
