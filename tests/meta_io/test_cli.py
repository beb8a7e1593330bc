"""``metaps gen-data`` / ``metaps meta-io build|inspect`` end to end on tiny data."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from metaps.cli import main

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def gen_dir(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("cli") / "data"
    rc = main(["gen-data", "--out", str(out), "--rows", "3000", "--users", "300", "--items", "200",
               "--seed", "2", "--files", "2"])
    assert rc == 0
    return out


def test_gen_data_prints_what_it_wrote(gen_dir, capsys, tmp_path) -> None:
    assert (gen_dir / "schema.json").exists() and len(list(gen_dir.glob("*.parquet"))) == 2
    rc = main(["gen-data", "--out", str(tmp_path / "g"), "--rows", "600", "--users", "50", "--items", "40"])
    out = capsys.readouterr().out
    assert rc == 0
    assert "wrote 600 rows" in out and "schema.json" in out and "rows/s" in out and "oracle AUC  click=" in out


def test_gen_data_bad_arguments(capsys, tmp_path) -> None:
    rc = main(["gen-data", "--out", str(tmp_path / "g"), "--rows", "0"])
    assert rc == 1
    assert "rows must be >= 1" in capsys.readouterr().err


def test_gen_data_hidden_world_moves_only_the_labels(tmp_path) -> None:
    """``--world hidden`` adds per-user offsets no feature reveals (``--world taste``: per-user tastes over
    item groups): the same features, other labels; an explicit ``--hidden-user-effect-std`` overrides the
    world's."""
    import pyarrow.parquet as pq

    tables = {}
    for name, extra in (("default", []), ("hidden", ["--world", "hidden"]), ("taste", ["--world", "taste"]),
                        ("zero", ["--world", "hidden", "--hidden-user-effect-std", "0", "--hidden-user-cvr-effect-std", "0"])):
        out = tmp_path / name
        assert main(["gen-data", "--out", str(out), "--rows", "600", "--users", "50", "--items", "40",
                     "--seed", "3", "--files", "1", *extra]) == 0
        tables[name] = pq.read_table(next(out.glob("*.parquet")))
    labels = {"click", "conversion", "p_click", "p_conversion"}
    features = [c for c in tables["default"].column_names if c not in labels]
    assert labels <= set(tables["default"].column_names)
    for name in ("hidden", "taste", "zero"):
        assert tables[name].select(features).equals(tables["default"].select(features)), name
    for name in ("hidden", "taste"):
        assert not tables[name].column("p_click").equals(tables["default"].column("p_click")), name
    assert not tables["taste"].column("p_click").equals(tables["hidden"].column("p_click"))
    assert tables["zero"].column("p_click").equals(tables["default"].column("p_click"))


def test_gen_data_unknown_world_is_one_line(capsys, tmp_path) -> None:
    assert main(["gen-data", "--out", str(tmp_path / "g"), "--rows", "600", "--world", "nope"]) != 0
    err = capsys.readouterr().err
    assert "--world must be one of ['default', 'hidden', 'taste'], got 'nope'" in err
    assert not (tmp_path / "g").exists()


def test_build_then_inspect(gen_dir, capsys, tmp_path) -> None:
    out = tmp_path / "mio"
    args = ["meta-io", "build", "--input", str(gen_dir), "--schema", str(gen_dir / "schema.json"),
            "--out", str(out), "--support", "4", "--query", "2", "--rows-per-batch", "48", "--seed", "1"]
    assert main(args) == 0
    built = capsys.readouterr().out
    assert "3,000 rows" in built and "fill" in built

    assert main(["meta-io", "inspect", str(out)]) == 0
    text = capsys.readouterr().out
    for needle in ("layout          meta", "S=4 Q=2", "support", "leftover", "buckets", "fill ratio",
                   "scenario rows", "consistency     ok"):
        assert needle in text, needle

    assert main(["meta-io", "inspect", str(out), "--json"]) == 0
    summary = json.loads(capsys.readouterr().out)
    r = summary["rows"]
    assert r["support"] + r["query"] + r["leftover"] == r["input"] == 3000
    assert [b["capacity"] for b in summary["buckets"]] == [6, 3, 2]
    assert sum(summary["scenario_rows"].values()) == 3000

    # a second build into the same folder is refused with a clear message
    assert main(args) == 1
    assert "already holds a Meta-IO dataset" in capsys.readouterr().err
    assert main(args + ["--overwrite", "--layout", "plain"]) == 0
    capsys.readouterr()
    assert main(["meta-io", "inspect", str(out), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["layout"] == "plain"


def test_build_bad_arguments(gen_dir, capsys, tmp_path) -> None:
    base = ["meta-io", "build", "--input", str(gen_dir), "--schema", str(gen_dir / "schema.json"),
            "--out", str(tmp_path / "x")]
    assert main(base + ["--support", "0"]) == 1
    assert "support and query must be >= 1" in capsys.readouterr().err
    assert main(base + ["--task-key", "nope"]) == 1
    assert "task key 'nope' is not a column" in capsys.readouterr().err
    assert main(["meta-io", "build", "--input", str(tmp_path / "missing"), "--schema", str(gen_dir / "schema.json"),
                 "--out", str(tmp_path / "y")]) == 1
    assert "input not found" in capsys.readouterr().err
    assert main(["meta-io", "inspect", str(tmp_path)]) == 1
    assert "manifest not found" in capsys.readouterr().err


def test_real_process_entry_point(gen_dir, tmp_path) -> None:
    """The installed ``metaps`` command, as scripts call it (a real process)."""
    out = tmp_path / "mio"
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [sys.executable, "-m", "metaps", "meta-io", "build", "--input", str(gen_dir),
           "--schema", str(gen_dir / "schema.json"), "--out", str(out), "--json"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=120)
    assert res.returncode == 0, res.stderr
    totals = json.loads(res.stdout.strip().splitlines()[-1])
    assert totals["input_rows"] == 3000
    assert 'msg="pass 2: partition done"' in res.stderr  # progress is logged
    assert (out / "manifest.json").exists()
