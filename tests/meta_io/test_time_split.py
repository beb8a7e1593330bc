"""Held-out split by time (``split-holdout --by time``): the past trains, the future is held out.

Judged on the rows written: every input row lands on exactly one side, every train row is
before the cut and every holdout row at or after it, the cut holds out the requested share
of the latest rows, and the recorded cut reproduces the split. A refused split leaves nothing.
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from meta_io.holdout import TIME_CUT_FILE, split_by_time, time_cut
from meta_io.schema import load_schema
from meta_io.source import iter_source
from common.errors import DataError

REPO = Path(__file__).resolve().parents[2]


def _rows(path: Path, schema) -> list[tuple[int, int, int]]:
    out = []
    for sb in iter_source(path, schema):
        t = sb.table
        out.extend(zip(t.column(schema.timestamp).to_pylist(), t.column(schema.task_key).to_pylist(),
                       t.column("item_id").to_pylist()))
    return out


def test_the_past_trains_and_the_latest_rows_are_held_out(generated, generated_schema, tmp_path: Path) -> None:
    res = split_by_time(generated.out_dir, generated_schema, tmp_path / "split", fraction=0.2)
    split_schema = load_schema(res.schema_path)
    train, hold = _rows(res.train_dir, split_schema), _rows(res.holdout_dir, split_schema)
    everything = _rows(generated.out_dir, generated_schema)
    assert sorted(train + hold) == sorted(everything), "a row was lost, duplicated or changed"
    assert (res.train_rows, res.holdout_rows) == (len(train), len(hold))
    cut = res.time_cut
    assert cut is not None and max(r[0] for r in train) < cut <= min(r[0] for r in hold)
    # the cut is the latest-20% quantile: ties aside, exactly round(0.2 * rows) rows are at or after it
    ts = np.sort([r[0] for r in everything])
    want = round(0.2 * ts.size)
    assert ts[ts.size - want] == cut and len(hold) == int((ts >= cut).sum())
    assert len(hold) >= want and len(hold) - want <= int((ts == cut).sum())
    assert res.holdout_tasks == len({r[1] for r in hold})
    assert {r[1] for r in train} & {r[1] for r in hold}, "a time split keeps users on both sides (not a task split)"
    rec = json.loads((tmp_path / "split" / TIME_CUT_FILE).read_text())
    assert rec["cut"] == cut and rec["timestamp"] == generated_schema.timestamp
    assert (rec["train_rows"], rec["holdout_rows"]) == (res.train_rows, res.holdout_rows)
    # the recorded cut reproduces the split row for row
    again = split_by_time(generated.out_dir, generated_schema, tmp_path / "again", cut=rec["cut"])
    assert sorted(_rows(again.holdout_dir, split_schema)) == sorted(hold)
    assert sorted(_rows(again.train_dir, split_schema)) == sorted(train)


def test_time_cut_is_the_quantile_of_the_timestamps(generated, generated_schema) -> None:
    ts = np.sort([r[0] for r in _rows(generated.out_dir, generated_schema)])
    for f in (0.05, 0.1, 0.5, 0.9):
        assert time_cut(generated.out_dir, generated_schema, f) == ts[ts.size - round(f * ts.size)], f


def test_refusals_name_the_problem_and_leave_nothing(generated, generated_schema, tmp_path: Path) -> None:
    earliest = min(r[0] for r in _rows(generated.out_dir, generated_schema))
    with pytest.raises(DataError, match="leaves no train rows"):
        split_by_time(generated.out_dir, generated_schema, tmp_path / "s1", cut=earliest)
    assert not any((tmp_path / "s1").glob("*/*")), "a refused split left files behind"
    with pytest.raises(DataError, match="leaves no holdout rows"):
        split_by_time(generated.out_dir, generated_schema, tmp_path / "s2", cut=2**62)
    assert not any((tmp_path / "s2").glob("*/*"))
    for bad in (0.0, 1.0, -0.1):
        with pytest.raises(DataError, match=r"--fraction must be in \(0, 1\)"):
            split_by_time(generated.out_dir, generated_schema, tmp_path / "s3", fraction=bad)
    no_time = dataclasses.replace(generated_schema, timestamp="")
    with pytest.raises(DataError, match="needs a timestamp column"):
        split_by_time(generated.out_dir, no_time, tmp_path / "s4")


def test_the_cli_splits_by_time_and_refuses_task_options(generated, tmp_path: Path) -> None:
    base = [sys.executable, "-m", "metaps", "meta-io", "split-holdout", "--input", str(generated.out_dir),
            "--schema", str(generated.schema_path)]
    ok = subprocess.run([*base[:3], "--json", *base[3:], "--out", str(tmp_path / "t"), "--by", "time",
                         "--fraction", "0.25"], capture_output=True, text=True, cwd=REPO, timeout=120)
    assert ok.returncode == 0, ok.stderr
    out = json.loads(ok.stdout)
    assert out["by"] == "time" and out["time_cut"] == json.loads((tmp_path / "t" / TIME_CUT_FILE).read_text())["cut"]
    assert out["train_rows"] + out["holdout_rows"] == generated.rows
    for extra, msg in ((["--by", "time", "--keys", str(tmp_path / "k.txt")], "--keys names tasks"),
                       (["--cut", "5"], "--cut is a time")):
        bad = subprocess.run([*base, "--out", str(tmp_path / "x"), *extra], capture_output=True, text=True,
                             cwd=REPO, timeout=120)
        assert bad.returncode != 0 and msg in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
        assert len(bad.stderr.strip().splitlines()) == 1, bad.stderr
