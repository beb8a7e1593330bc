"""The Python API (``metaps.api``): docs/api.md's notebook runs as written, and bad input is one line.

The notebook block is read from docs/api.md (not copied here), so an edit to the doc is
what is tested: it runs in a subprocess in an empty folder (generate tiny data, build
Meta-IO, train_local, evaluate, deliver, load the bundle, predict and adapt for one
user; its own ``assert`` lines check the results) and the test then checks what it left.

The error tests call the real functions with one bad argument each and check the error
is a ``MetapsError`` whose single line names the bad argument; none of them starts
training or leaves a run directory. ``api.launch``'s fleet runs in
tests/metaps/test_launch_max_steps.py (one fleet checks both the step limit and the API's result).
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from delivery.bundle import DeliveryError
from metaps import api
from common.errors import ConfigError, MetapsError

REPO = Path(__file__).resolve().parents[2]
DOC = REPO / "docs" / "api.md"
SECTION = "## A notebook, start to finish"


def notebook_block() -> str:
    """The first ```python block after :data:`SECTION` in docs/api.md."""
    text = DOC.read_text()
    m = re.search(r"```python\n(.*?)```", text[text.index(SECTION):], flags=re.S)
    assert m, f"no ```python block after {SECTION!r} in docs/api.md"
    return m.group(1)


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.setdefault("OMP_NUM_THREADS", "1")
    return env


def test_the_notebook_in_docs_runs_as_written(tmp_path: Path) -> None:
    script = tmp_path / "notebook.py"
    script.write_text(notebook_block())
    res = subprocess.run([sys.executable, str(script)], cwd=tmp_path, env=_env(), capture_output=True, text=True,
                         timeout=300, check=False)
    assert res.returncode == 0, f"docs/api.md's notebook failed:\n{res.stdout[-3000:]}\n{res.stderr[-5000:]}"
    out = res.stdout
    assert re.search(r"trained 8 steps -> .*/checkpoints/ckpt-8", out), out
    assert re.search(r"v000001: \d+ rows scored, auc \{'click'", out), out
    # the last step: a misspelt override is refused in one line that names it and the real key
    refused = [ln for ln in out.splitlines() if ln.startswith("refused:")]
    assert refused == ["refused: overrides: 'train.max_stepz=8': unknown job-file key 'train.max_stepz'; "
                       "did you mean 'train.max_steps'?"], out
    work = tmp_path / "work"
    assert (work / "bundles" / "LATEST").read_text().strip() == "v000001"
    [run_dir] = [p for p in (work / "runs").iterdir() if p.name.startswith("notebook-")]
    assert json.loads((run_dir / "report.json").read_text())["status"] == "succeeded"
    assert (run_dir / "tb").is_dir() and not (run_dir / "plots").exists()  # plots=False
    assert (work / "runs" / "latest").resolve() == run_dir.resolve()


# ---------------------------------------------------------------------------- bad input: one line each

def _one_line(exc: BaseException, *names: str) -> str:
    msg = str(exc)
    assert isinstance(exc, MetapsError), f"{type(exc).__name__} is not a MetapsError: {msg}"
    assert "\n" not in msg and msg.strip(), repr(msg)
    for name in names:
        assert name in msg, f"{name!r} not named in: {msg}"
    return msg


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A small generated dataset and its Meta-IO layout (no training)."""
    root = tmp_path_factory.mktemp("api")
    data = api.generate_data(root / "data", rows=600, users=60, items=50, seed=3)
    built = api.build_meta_io(data.out_dir, data.schema, root / "metaio", rows_per_batch=64)
    assert built.rows == 600 and built.tasks > 0 and built.out_dir == root / "metaio"
    return {"root": root, "data": data.out_dir, "schema": data.schema, "metaio": built.out_dir}


def test_a_missing_job_file_is_named(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        api.train_local(tmp_path / "nope.toml")
    _one_line(e.value, "nope.toml", "not found")


def test_a_misspelt_override_names_the_real_key(tiny: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        api.train_local({"data": {"train": str(tiny["metaio"])}}, overrides={"train.max_stepz": 3},
                        run_dir=tmp_path / "run")
    _one_line(e.value, "train.max_stepz", "did you mean 'train.max_steps'")
    assert not (tmp_path / "run").exists()


def test_a_bad_override_value_names_the_key(tiny: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        api.load_job({"data": {"train": str(tiny["metaio"])}}, overrides={"train.max_steps": "many"})
    _one_line(e.value, "max_steps")


def test_a_missing_dataset_is_refused_before_the_run_dir(tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        api.train_local({"data": {"train": str(tmp_path / "no-metaio")}}, run_dir=tmp_path / "run")
    _one_line(e.value, "no-metaio", "meta-io build")
    assert not (tmp_path / "run").exists()


def test_launch_refuses_a_bad_override_before_anything_starts(tiny: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        api.launch({"data": {"train": str(tiny["metaio"])}}, overrides={"ps.shardz": 2}, run_dir=tmp_path / "run")
    _one_line(e.value, "ps.shardz", "did you mean 'ps.shards'")
    with pytest.raises(ConfigError) as e:
        api.launch({"data": {"train": str(tiny["metaio"])}}, workers=0, run_dir=tmp_path / "run")
    _one_line(e.value, "workers", ">= 1")
    assert not (tmp_path / "run").exists()


def test_overrides_must_be_a_mapping_of_dotted_keys() -> None:
    with pytest.raises(api.ApiError) as e:
        api.load_job({}, overrides=["train.max_steps=3"])  # type: ignore[arg-type]
    _one_line(e.value, "overrides", "mapping")
    with pytest.raises(api.ApiError) as e:
        api.load_job({}, overrides={"train": {"max_steps": 3}})
    _one_line(e.value, "'train'", "dotted key")


def test_data_functions_name_a_missing_input(tiny: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(api.ApiError) as e:
        api.build_meta_io(tmp_path / "no-logs", tiny["schema"], tmp_path / "out")
    _one_line(e.value, "input", "no-logs", "no such file")
    with pytest.raises(api.ApiError) as e:
        api.split_holdout(tiny["data"], tmp_path / "no-schema.json", tmp_path / "split")
    _one_line(e.value, "schema", "no-schema.json")
    with pytest.raises(api.ApiError) as e:
        api.build_meta_io(tiny["data"], tiny["schema"], 42)  # type: ignore[arg-type]
    _one_line(e.value, "out", "expected a path", "int")
    assert not (tmp_path / "out").exists()


def test_data_functions_name_a_bad_size_or_option(tiny: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(ConfigError) as e:
        api.generate_data(tmp_path / "d", rows=-5, users=10, items=10)
    _one_line(e.value, "generate_data()", "rows")
    with pytest.raises(ConfigError) as e:
        api.build_meta_io(tiny["data"], tiny["schema"], tmp_path / "m", options={"suport": 3})
    _one_line(e.value, "build_meta_io()", "suport")
    with pytest.raises(MetapsError) as kept:  # an existing dataset is kept unless overwrite=True
        api.build_meta_io(tiny["data"], tiny["schema"], tiny["metaio"], rows_per_batch=64)
    _one_line(kept.value, "overwrite")


def test_evaluate_and_deliver_name_their_sources(tiny: dict[str, Path], tmp_path: Path) -> None:
    with pytest.raises(api.ApiError) as e:
        api.evaluate(tiny["metaio"])
    _one_line(e.value, "checkpoint=", "bundle=")
    with pytest.raises(api.ApiError) as e:
        api.evaluate(tiny["metaio"], checkpoint=tmp_path / "no-ckpt")
    _one_line(e.value, "checkpoint", "no-ckpt")
    with pytest.raises(api.ApiError) as e:
        api.deliver(tmp_path / "bundles", run=tmp_path)
    _one_line(e.value, "holdout=", "no_gate=True")
    with pytest.raises(MetapsError) as none:  # a run without a committed checkpoint
        api.deliver(tmp_path / "bundles", run=tmp_path, no_gate=True)
    _one_line(none.value, str(tmp_path))
    assert not (tmp_path / "bundles" / "LATEST").exists()


def test_load_bundle_names_what_is_not_a_bundle(tmp_path: Path) -> None:
    with pytest.raises(api.ApiError) as e:
        api.load_bundle(tmp_path / "no-bundles")
    _one_line(e.value, "no-bundles", "no such file")
    with pytest.raises(DeliveryError) as bad:
        api.load_bundle(tmp_path)
    _one_line(bad.value, str(tmp_path), "publish root")


def test_importing_the_api_stays_light() -> None:
    code = "import sys, metaps.api; print('torch' in sys.modules)"
    res = subprocess.run([sys.executable, "-c", code], env=_env(), capture_output=True, text=True, timeout=120,
                         check=True)
    assert res.stdout.strip() == "False"


def test_the_cli_keeps_the_deliver_gate_rule(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    """``metaps deliver`` goes through the extracted ``delivery_config``: no holdout, no --no-gate -> one line."""
    from metaps.cli import main

    assert main(["deliver", "--run", str(tmp_path), "--out", str(tmp_path / "out")]) == 1
    err = capsys.readouterr().err.strip()
    assert err.startswith("metaps deliver: error: no --holdout given") and "\n" not in err, err


def test_a_ps_tables_override_with_its_optional_keys_unset_trains(tiny: dict[str, Path], tmp_path: Path) -> None:
    """docs/configuration.md: a ``[[ps.tables]]`` override sets only what it names. train-local writes
    the effective job to ``RUN/job.toml``; the unset keys (None) are left out there and read back
    unset (it stopped with "ps.tables[0].dim: TOML has no null")."""
    from metaps.job import load_job

    job = {"data": {"train": str(tiny["metaio"])}, "model": {"default_dim": 8, "hidden": [8]},
           "ps": {"tables": [{"name": "item", "capacity": 999}]}, "run": {"plots": False}}
    res = api.train_local(job, max_steps=1, run_dir=tmp_path / "run", progress=False)
    assert res.status == "succeeded", res.reason
    back = load_job(tmp_path / "run" / "job.toml")
    assert [dataclasses.asdict(t) for t in back.ps.tables] == [dataclasses.asdict(t) for t in api.load_job(job).ps.tables]
    assert back.ps.tables[0].dim is None and back.ps.tables[0].capacity == 999
    item = {t.name: t for t in back.table_configs()}["item"]
    assert (item.capacity, item.dim) == (999, 8)


def test_a_none_override_is_refused_by_key() -> None:
    with pytest.raises(api.ApiError) as e:
        api.load_job({}, overrides={"train.max_steps": None})
    _one_line(e.value, "train.max_steps", "no null")
