"""One CLI voice (issue 14 point 4): ``--json``, global flags anywhere, flag help with
defaults, ``--set`` with did-you-mean, comment-keeping ``config-write``, one error line,
and ``launch``/``train-local`` refusing a missing dataset before anything starts.

Real commands throughout: ``metaps.cli.main`` in-process where the command leaves the
process as it was, the real ``python -m metaps`` in a subprocess where it does not
(``launch`` and ``worker`` set the umask).
"""

from __future__ import annotations

import argparse
import json
import os
import stat
import subprocess
import sys
import tomllib
from pathlib import Path

import pytest

from metaps.cli import build_parser, error_line, main, walk_parsers
from common.errors import ConfigError
from common.toml_writer import write
from metaps.job import load_job
from tests.metaps.cli_process import run_metaps

REPO = Path(__file__).resolve().parents[2]

COMMENTED = """\
# A job file a person wrote: comments and layout must survive config-write.
[data]
train = "{train}"   # the Meta-IO dataset
eval = ""

# ---- parameter server
[ps]
shards = 1          # one shard is plenty here
device = "cpu"

[ps.table_defaults]
dim = 8

[model]
kind = "dnn"
default_dim = 8
hidden = [16, 8]

[train]
mode = "meta"
workers = 1
# the end
"""


def _env() -> dict[str, str]:
    """This checkout's code, and no fleet addresses inherited from the shell."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    env.pop("METAPS_PS", None)
    env.pop("METAPS_CONTROLLER", None)
    return env


def _metaps(*args: str, cwd: Path = REPO) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "metaps", *args], cwd=cwd, env=_env(), capture_output=True,
                          text=True, timeout=300, check=False)


def _refused(*args: str) -> subprocess.CompletedProcess[str]:
    """``_metaps`` for a command line that must be refused: it fails fast, before importing torch."""
    res, torch_imported = run_metaps(list(args), REPO, _env())
    assert res.returncode == 1, res.stdout + res.stderr
    assert not torch_imported, f"refused after importing torch: {res.stderr[-2000:]}"
    return res


def _job(tmp: Path, train: Path, **extra: dict) -> Path:
    data = tomllib.loads(COMMENTED.format(train=train))
    data["run"] = {"dir": str(tmp / "runs"), "name": "t"}
    data["rpc"] = {"token": "cli-test-token"}  # no "NO AUTH TOKEN" warning line on stderr
    for k, v in extra.items():
        data.setdefault(k, {}).update(v)
    return write(tmp / "job.toml", data)


# ------------------------------------------------------------------ --json, global flags, help
def test_json_prints_exactly_one_object_and_flags_go_before_or_after(tmp_path: Path,
                                                                      capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--out", str(tmp_path / "a"), "--rows", "300", "--users", "30", "--items", "20", "--files", "1"]
    assert main(["gen-data", *args, "--json", "--log-level", "WARNING"]) == 0  # after the subcommand
    out = capsys.readouterr().out
    obj = json.loads(out)  # the whole of stdout is one JSON object
    assert obj["rows"] == 300 and obj["schema"].endswith("schema.json") and set(obj["oracle_auc"]) >= {"click"}

    assert main(["--json", "meta-io", "build", "--input", str(tmp_path / "a"), "--schema",  # before it
                 str(tmp_path / "a" / "schema.json"), "--out", str(tmp_path / "m"), "--rows-per-batch", "32"]) == 0
    assert json.loads(capsys.readouterr().out)["input_rows"] == 300

    # without --json: the human summary, once (the library's "generated" log line is its twin, dropped)
    assert main(["gen-data", "--out", str(tmp_path / "b"), "--rows", "300", "--users", "30", "--items", "20"]) == 0
    cap = capsys.readouterr()
    assert cap.out.count("wrote 300 rows") == 1 and 'msg="generated"' not in cap.err
    with pytest.raises(json.JSONDecodeError):
        json.loads(cap.out)


def test_global_flags_parse_on_every_subcommand() -> None:
    parser = build_parser()
    for path, p in walk_parsers(parser):
        flags = {o: a for a in p._actions for o in a.option_strings}
        assert "--log-level" in flags and "--json" in flags, f"metaps {path}: no global flags"
        # below the top they must not reset a value given before the subcommand
        assert flags["--log-level"].default is argparse.SUPPRESS and flags["--json"].default is argparse.SUPPRESS
    cmd = ["config-write", "--config", "a.toml", "--out", "b.toml"]
    for argv in (["--log-level", "DEBUG", "--json", *cmd], [*cmd, "--log-level", "DEBUG", "--json"],
                 ["--json", *cmd, "--log-level", "DEBUG"]):
        ns = parser.parse_args(argv)
        assert (ns.log_level, ns.json) == ("DEBUG", True), argv
    ns = parser.parse_args(["meta-io", "inspect", "x", "--log-level", "ERROR"])
    assert (ns.log_level, ns.json) == ("ERROR", False)
    ns = parser.parse_args(cmd)
    assert (ns.log_level, ns.json) == ("INFO", False)


def test_every_flag_has_help_that_names_its_default() -> None:
    parser = build_parser()
    missing = []
    for path, p in walk_parsers(parser):
        fmt = p._get_formatter()
        for a in p._actions:
            if not a.option_strings or isinstance(a, (argparse._HelpAction, argparse._VersionAction)):
                continue
            if a.help == argparse.SUPPRESS:
                continue  # hidden test knobs
            text = fmt._expand_help(a) if a.help else ""
            if not text or (a.nargs != 0 and not a.required and "default" not in text.lower()):
                missing.append(f"metaps {path} {a.option_strings[0]}: {text!r}")
    assert not missing, "\n".join(missing)


# ------------------------------------------------------------------ errors
def test_error_line_is_not_prefixed_twice() -> None:
    assert error_line("worker", ConfigError("metaps worker: no PS addresses")) == \
        "metaps worker: error: no PS addresses"
    assert error_line("launch", ConfigError("metaps launch: error: x")) == "metaps launch: error: x"
    assert error_line("ps", ConfigError("metaps worker: y")) == "metaps ps: error: metaps worker: y"


def test_worker_without_ps_addresses_is_one_line(tmp_path: Path) -> None:
    job = _job(tmp_path, tmp_path / "no-data")
    res = _refused("worker", "--config", str(job), "--rank", "0")
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("metaps worker: error: no PS addresses"), res.stderr
    assert lines[0].count("metaps worker") == 1 and "Traceback" not in res.stderr


# ------------------------------------------------------------------ --set and config-write
def test_config_write_keeps_comments_and_types_overrides(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "job.toml"
    src.write_text(COMMENTED.format(train=tmp_path / "d"))
    out = tmp_path / "host" / "job.toml"
    assert main(["config-write", "--config", str(src), "--set", "ps.shards=2", "--set", "run.name=2024",
                 "--set", "ps.host=127.0.0.9", "--set", "controller.dds.lease_s=2.5", "--out", str(out)]) == 0
    assert "wrote" in capsys.readouterr().out
    text = out.read_text()
    # every comment and untouched line is still there, in order; only the set keys changed or were added
    for line in COMMENTED.format(train=tmp_path / "d").splitlines():
        if not line.startswith("shards"):
            assert line in text, line
    assert "shards = 2          # one shard is plenty here" in text
    assert text.index("# ---- parameter server") < text.index("host = ") < text.index("[ps.table_defaults]")
    job = load_job(out)
    assert job.ps.shards == 2 and job.ps.host == "127.0.0.9" and job.controller.dds.lease_s == 2.5
    assert job.run.name == "2024"  # a bare number for a text field stays text (typed by the dataclass)


def test_bad_set_key_says_did_you_mean_and_writes_nothing(tmp_path: Path,
                                                          capsys: pytest.CaptureFixture[str]) -> None:
    src = tmp_path / "job.toml"
    src.write_text(COMMENTED.format(train=tmp_path / "d"))
    out = tmp_path / "out.toml"
    assert main(["config-write", "--config", str(src), "--set", "train.max_step=3", "--out", str(out)]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "unknown job-file key 'train.max_step'" in err, err
    assert "did you mean 'train.max_steps'" in err and str(out) not in err
    assert main(["config-write", "--config", str(src), "--set", "train.workers=0", "--out", str(out)]) == 1
    err = capsys.readouterr().err
    assert "workers must be >= 1" in err and str(src) in err and str(out) not in err  # blames the source
    assert not out.exists()


@pytest.mark.parametrize("command", ["launch", "train-local"])
def test_bad_set_key_checked_before_anything(command: str, tmp_path: Path) -> None:
    job = _job(tmp_path, tmp_path / "no-data")
    res = _metaps(command, "--config", str(job), "--set", "trian.workers=2")
    assert res.returncode == 1
    assert "did you mean 'train.workers'" in res.stderr and res.stderr.strip().count("\n") == 0, res.stderr
    assert not (tmp_path / "runs").exists()


# ------------------------------------------------------------------ missing inputs
@pytest.mark.parametrize("command", ["launch", "train-local"])
def test_missing_dataset_is_refused_before_anything_starts(command: str, tmp_path: Path) -> None:
    missing = tmp_path / "metaio"
    job = _job(tmp_path, missing)
    res = _refused(command, "--config", str(job), "--set", "train.max_steps=2")
    lines = res.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith(f"metaps {command}: error: "), res.stderr
    assert f"data.train = {missing}: no such directory" in lines[0]
    assert f"metaps meta-io build --input LOGS --schema SCHEMA.json --out {missing}" in lines[0]
    assert not (tmp_path / "runs").exists()  # no run dir: no process started, no latest link, no state


def test_launch_refuses_an_unwritable_run_root(tmp_path: Path) -> None:
    from tests.metaps.fleet_data import make_data

    data = make_data(tmp_path / "data")
    (tmp_path / "ro").mkdir()
    (tmp_path / "ro" / "runs").write_text("a file where the run root should be")
    job = _job(tmp_path, data["train"], run={"dir": str(tmp_path / "ro" / "runs" / "x")})
    res = _metaps("launch", "--config", str(job), "--no-progress")  # after the full preflight: it builds the model
    assert res.returncode == 1, res.stdout + res.stderr
    assert "is not a directory" in res.stderr and res.stderr.strip().count("\n") == 0, res.stderr


# ------------------------------------------------------------------ train-local's run directory
def test_train_local_makes_a_run_dir_like_launch(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """... of a model metaps does not ship (docs/examples/two_tower.py next to the job file), which is
    then delivered and scored by ``metaps predict`` and ``api.load_bundle`` with the user's code gone."""
    import shutil

    from tests.metaps.fleet_data import job_mapping, make_data

    data = make_data(tmp_path / "data")
    shutil.copy(REPO / "docs" / "examples" / "two_tower.py", tmp_path / "two_tower.py")
    job = write(tmp_path / "job.toml", job_mapping(data, tmp_path, workers=1, ps=1, run={"plots": True},
                                                   model={"kind": "custom", "class": "two_tower:TwoTower",
                                                          "hidden": [8]}))
    res = _metaps("train-local", "--config", str(job), "--set", "train.max_steps=3", "--set", "train.log_every=1",
                  "--json")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    out = json.loads(res.stdout)  # one object, nothing else on stdout
    # off a terminal, the step lines carry the run's percent and time left (3 steps planned)
    steps = [ln for ln in res.stderr.splitlines() if 'msg="step"' in ln]
    assert " pct=33.3 " in steps[0] + " " and "eta_s=" in steps[0], steps
    assert "pct=100.0" in steps[-1] and "eta_s=0" in steps[-1], steps
    run = Path(out["run_dir"])
    assert run.parent == tmp_path / "runs" and run.name.startswith("test-")  # [run] dir/<name>-<time>
    assert (tmp_path / "runs" / "latest").resolve() == run.resolve()
    rep = json.loads((run / "report.json").read_text())
    assert rep["status"] == "succeeded" and rep["totals"]["steps"] == out["steps"] == 3
    assert load_job(run / "job.toml").train.max_steps == 3  # the effective job, overrides applied
    assert Path(out["checkpoint"]).parent == run / "checkpoints"
    assert list((run / "plots").glob("*.png")) and (run / "tb").is_dir()
    # the run is the group's to read (a serving system or a backup in the run's group reads the
    # checkpoint): folders 0750, files 0640; nothing open to others or writable by the group
    modes = {p: stat.S_IMODE(p.lstat().st_mode) for p in [run, *run.rglob("*")] if not p.is_symlink()}
    ckpt = Path(out["checkpoint"])
    assert (modes[run], modes[ckpt], modes[ckpt / "manifest.json"], modes[run / "report.json"]) == \
        (0o750, 0o750, 0o640, 0o640)
    assert not [f"{p} {m:04o}" for p, m in modes.items() if m & 0o027 or not m & 0o040], modes
    assert load_job(run / "job.toml").model.class_dir == str(tmp_path.resolve())  # the job file's folder
    _deliver_and_score_without_the_users_code(Path(out["checkpoint"]), data["eval"].parent / "raw-eval", tmp_path,
                                              monkeypatch)


def _deliver_and_score_without_the_users_code(ckpt: Path, raw_dir: Path, tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """Deliver a custom model's checkpoint (its class imported from the run's class_dir) and adapt the
    bundle per user, then remove the class and score: the bundle's dense network is self-contained
    TorchScript; only adaptation, which rebuilds the eager model, needs the class, and says so in one line."""
    import numpy as np
    import pyarrow.parquet as pq

    from metaps import api
    from models.custom_import import import_model_class

    bundles = tmp_path / "bundles"
    assert main(["deliver", "--no-gate", "--checkpoint", str(ckpt), "--out", str(bundles)]) == 0
    raw = tmp_path / "rows.parquet"  # 160 held-out rows are enough to score and adapt (the suite's time)
    pq.write_table(pq.read_table(sorted(raw_dir.glob("*.parquet"))[0]).slice(0, 160), raw)
    adapted = api.load_bundle(bundles).adapt(raw).predict(raw)  # the class importable: the inner loop runs
    assert adapted.adapted and set(adapted.probs) == {"click", "conversion"}
    (tmp_path / "two_tower.py").unlink()  # the user's code is gone, from this process too (another test may
    monkeypatch.delitem(sys.modules, "two_tower", raising=False)  # have imported docs/examples' copy)
    monkeypatch.setattr(sys, "path", [p for p in sys.path if not (Path(p or ".") / "two_tower.py").exists()])
    import_model_class.cache_clear()
    assert main(["predict", "--bundle", str(bundles), "--data", str(raw), "--out", str(tmp_path / "s.parquet")]) == 0
    got = api.load_bundle(bundles).predict(raw)
    scores = pq.read_table(tmp_path / "s.parquet").to_pydict()
    assert got.rows == len(scores["row"]) > 0 and set(got.probs) == {"click", "conversion"}
    for h in got.probs:
        np.testing.assert_allclose(scores[f"p_{h}"], got.probs[h], atol=1e-6)
        assert 0.0 < float(got.probs[h].min()) and float(got.probs[h].max()) < 1.0
    with pytest.raises(ConfigError) as exc:  # adapting rebuilds the eager model: the class is needed
        api.load_bundle(bundles).adapt(raw).predict(raw)
    assert "\n" not in str(exc.value) and "model.class = 'two_tower:TwoTower': module 'two_tower' not found" in str(
        exc.value), str(exc.value)
