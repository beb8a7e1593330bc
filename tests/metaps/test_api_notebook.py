"""The Python API in a notebook (issue 38 item 2): the trained model in memory, callbacks that
can stop a run, progress that can be turned off.

Two real ``api.train_local`` runs on test_api.py's tiny data (600 rows, 64-row batches), same
job: A (6 steps asked, ``on_step`` returns STOP at step 3, progress off) and B (3 steps,
progress as lines, a STOP only from its final evaluation and checkpoint, after training). The judge of a stop is the state it leaves: A's final checkpoint is at
step 3 with exactly B's rows and dense parameters (a stop ignored would train on to step 6),
and its report says ``stopped``, by which callback, not "succeeded". B's model and tables in
memory are compared with its checkpoint as read by ``ps.checkpoint`` and with the bundle
delivered from it (``predict`` scores alike). ``api.launch``'s callbacks are driven by the
launcher's polls; :class:`metaps.api._FleetWatch` is checked here on a controller-status
mapping and B's real checkpoints (the fleet itself runs in test_launch_max_steps.py).
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import torch

from metaps import api
from common.errors import MetapsError
from ps.checkpoint import checkpoint_step, read_manifest, read_rows


def _job(root: Path) -> dict[str, Any]:
    metaio = str(root / "metaio")
    return {"data": {"train": metaio, "eval": metaio},
            "ps": {"table_defaults": {"dim": 8, "capacity": 4096}},
            "model": {"kind": "dnn", "default_dim": 8, "hidden": [16]},
            "meta": {"inner_steps": 1, "inner_lr": 0.1, "first_order": True},
            "train": {"mode": "meta", "threads": 1, "eval_every_steps": 2, "eval_max_rows": 64},
            "run": {"dir": str(root / "runs"), "plots": False}}


def _quiet(fn: Any) -> tuple[Any, str, str]:
    """(fn(), what it wrote to stdout, to stderr), log records left out (a CLI test earlier in this
    process may have pointed logging at stderr: logs are the logging config's, not progress)."""
    from metaps.progress import parse_kv_line

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        res = fn()
    def printed(s: io.StringIO) -> str:
        return "".join(ln for ln in s.getvalue().splitlines(keepends=True) if parse_kv_line(ln) is None)

    return res, printed(out), printed(err)


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    root = tmp_path_factory.mktemp("api-notebook")
    data = api.generate_data(root / "data", rows=600, users=60, items=50, seed=3)
    api.build_meta_io(data.out_dir, data.schema, root / "metaio", rows_per_batch=64)
    job = _job(root)
    ev: dict[str, list[Any]] = {"step": [], "eval": [], "checkpoint": []}

    def on_step(e: api.StepEvent) -> object:
        ev["step"].append(e)
        return api.STOP if e.step == 3 else None

    a, a_out, a_err = _quiet(lambda: api.train_local(
        job, max_steps=6, run_dir=root / "a", on_step=on_step, on_eval=ev["eval"].append,
        on_checkpoint=ev["checkpoint"].append, progress=False))
    # B's stops come after training (the final evaluation, the final checkpoint): they change nothing
    b, b_out, b_err = _quiet(lambda: api.train_local(
        job, max_steps=3, run_dir=root / "b", progress="lines", on_eval=lambda e: api.STOP if e.final else None,
        on_checkpoint=lambda e: api.STOP))
    rows = pa.concat_tables([pq.read_table(f) for f in data.files])
    return {"root": root, "a": a, "b": b, "events": ev, "rows": rows, "out": {"a": (a_out, a_err), "b": (b_out, b_err)}}


def test_on_step_stop_ends_the_run_at_that_step(runs: dict[str, Any]) -> None:
    a, b = runs["a"], runs["b"]
    assert (a.status, a.steps, a.stopped) == ("stopped", 3, True), (a.status, a.steps, a.reason)
    assert a.reason == "on_step returned STOP at step 3"
    rep = json.loads((a.run_dir / "report.json").read_text())
    assert rep["status"] == "stopped" and rep["reason"] == a.reason
    assert rep["coverage_summary"] == "3/6 steps (stopped: on_step returned STOP at step 3)"
    assert (b.status, b.steps, b.stopped, b.reason) == ("succeeded", 3, False, "")
    # the state it left: its final checkpoint is step 3's, the same rows and dense values as a 3-step run
    assert a.checkpoint is not None and b.checkpoint is not None
    assert checkpoint_step(a.checkpoint) == checkpoint_step(b.checkpoint) == 3
    assert sorted(p.name for p in (a.run_dir / "checkpoints").glob("ckpt-*")) == ["ckpt-3"]
    assert read_manifest(a.checkpoint)["info"]["step"] == 3
    assert set(a.tables) == set(b.tables)
    for t in a.tables:
        assert np.array_equal(a.tables[t].ids(), b.tables[t].ids()), t
        assert torch.equal(a.tables[t].lookup(a.tables[t].ids()), b.tables[t].lookup(b.tables[t].ids())), t
    for (n, p), (m, q) in zip(a.model.named_parameters(), b.model.named_parameters()):
        assert n == m and torch.equal(p, q), n


def test_callbacks_see_each_step_eval_and_checkpoint(runs: dict[str, Any]) -> None:
    ev, a = runs["events"], runs["a"]
    assert [e.step for e in ev["step"]] == [1, 2, 3]  # nothing after the stop
    assert all(e.total_steps == 6 and e.fraction == pytest.approx(e.step / 6) for e in ev["step"])
    assert all(math.isfinite(e.loss) for e in ev["step"])
    assert [e.samples for e in ev["step"]] == sorted({e.samples for e in ev["step"]}) and ev["step"][-1].samples == a.samples
    # the periodic evaluation at step 2, then the final one at the stop
    assert [(e.step, e.final) for e in ev["eval"]] == [(2, False), (3, True)]
    assert 0.0 < ev["eval"][1].metrics["base/click/auc"] < 1.0
    assert ev["eval"][1].metrics["base/click/auc"] == pytest.approx(a.auc["base/click/auc"])
    assert [(e.step, e.path) for e in ev["checkpoint"]] == [(3, a.checkpoint)]


def test_tables_are_the_checkpoint_rows(runs: dict[str, Any]) -> None:
    b = runs["b"]
    assert isinstance(b.model, torch.nn.Module) and not b.model.training
    for t in ("user", "item", "mh_item_tags"):
        parts = list(read_rows(b.checkpoint, t))
        ids = np.concatenate([p.ids for p in parts])
        w = np.concatenate([p.weights for p in parts]).reshape(ids.size, -1)
        table = b.tables[t]
        assert len(table) == table.rows == ids.size > 0 and table.dim == w.shape[1]
        assert np.array_equal(table.ids(), np.sort(ids))
        got = table.lookup(torch.from_numpy(ids[::-1].copy()))  # any order, a tensor
        assert got.dtype == torch.float32 and torch.equal(got, torch.from_numpy(w[::-1].copy()))
        assert table.contains(ids).all()
    unseen = int(b.tables["user"].ids().max()) + 12345
    assert not b.tables["user"].contains([unseen]).any()
    with pytest.raises(api.ApiError) as e:
        b.tables["user"].lookup(["seven"])
    assert "'user'" in str(e.value) and "\n" not in str(e.value)


def test_the_model_in_memory_scores_like_its_bundle(runs: dict[str, Any]) -> None:
    b, rows, root = runs["b"], runs["rows"], runs["root"]
    mine = b.predict(rows, keep_columns=["user_id", "click"])
    assert mine.rows == rows.num_rows and set(mine.probs) == {"click", "conversion"}
    assert np.array_equal(mine.columns["user_id"], rows.column("user_id").to_numpy())
    out = api.deliver(root / "bundles", run=b.run_dir, no_gate=True)
    assert out.published
    bundle = api.load_bundle(root / "bundles")
    served = bundle.predict(rows)
    for h in ("click", "conversion"):
        assert np.allclose(mine.probs[h], served.probs[h], atol=1e-6), h
        assert mine.auc[h] == pytest.approx(served.auc[h])
    # the bundle's model and tables: the dense network, and the rows it serves
    assert isinstance(bundle.model, torch.nn.Module)
    t = bundle.tables["user"]
    assert t.rows == b.tables["user"].rows and np.array_equal(t.ids(), b.tables["user"].ids())
    unseen = [int(t.ids().max()) + 12345]
    ids = np.concatenate([t.ids(), unseen])
    assert torch.equal(t.lookup(ids), b.tables["user"].lookup(ids))  # an unseen id: the same initial row
    assert bundle.predict(rows.slice(0, 10)).rows == 10  # scoring again after lookups (one LMDB open per process)
    # one batch, in memory: the model and the bundle score it alike
    from delivery.predict import _batches

    src = root / "rows.parquet"
    pq.write_table(rows.slice(0, 50), src)
    batches, _ = _batches(src, b.trained.schema, 50)
    fb, _ = next(batches)
    got, want = b.trained.score_batch(fb), bundle.score_batch(fb)
    assert set(got) == set(want) and all(torch.allclose(got[h], want[h], atol=1e-6) for h in got)
    assert torch.allclose(got["click"], torch.tensor(served.probs["click"][:50]), atol=1e-6)


def test_progress_lines_or_nothing(runs: dict[str, Any]) -> None:
    a_out, a_err = runs["out"]["a"]
    assert (a_out, a_err) == ("", "")  # progress=False: nothing printed
    b_out, b_err = runs["out"]["b"]
    assert b_out == ""  # stdout stays the caller's
    lines = b_err.splitlines()
    assert lines[0].startswith("train-local: 1/3 steps (33%) loss "), b_err
    assert lines[-1].startswith("train-local succeeded: 3 steps in "), b_err
    assert lines[-1].endswith(f"checkpoint {runs['b'].checkpoint}") and "base/click/auc" in lines[-1]


def test_progress_bar_draws_and_bad_settings_are_refused(runs: dict[str, Any]) -> None:
    from metaps.progress import RunProgress, progress_mode

    assert progress_mode(False) == "off" and progress_mode("lines") == "lines"
    assert progress_mode("auto") == ("bar" if sys.stderr.isatty() else "lines")  # not Jupyter

    def draw() -> None:
        p = RunProgress("train-local", "bar", "steps")
        p.update(2, 4, "loss 0.5")
        p.close("done")

    _, out, err = _quiet(draw)
    assert out == "" and "train-local" in err and "2/4 steps" in err and err.rstrip().endswith("done")
    root = runs["root"]
    for kw, name in (({"progress": "sometimes"}, "progress"), ({"on_step": 5}, "on_step")):
        with pytest.raises(api.ApiError) as e:
            api.train_local(_job(root), max_steps=1, run_dir=root / "refused", **kw)
        assert isinstance(e.value, MetapsError) and name in str(e.value) and "\n" not in str(e.value)
    assert not (root / "refused").exists()


def test_launch_callbacks_follow_the_controllers_polls(runs: dict[str, Any]) -> None:
    """api.launch's watch: on_step when the furthest step advanced, on_checkpoint per new
    committed checkpoint, a stop reason back to the launcher; fed a status mapping."""
    steps: list[api.StepEvent] = []
    ckpts: list[api.CheckpointEvent] = []

    def on_step(e: api.StepEvent) -> object:
        steps.append(e)
        return api.STOP if e.step >= 7 else None

    def on_checkpoint(e: api.CheckpointEvent) -> object:
        ckpts.append(e)
        raise api.StopTraining("a checkpoint is enough")

    calls = api._Callbacks(on_step, None, on_checkpoint, api._progress(False, "launch", "batches"))
    b = runs["b"]
    watch = api._FleetWatch(calls, b.run_dir / "checkpoints", total_steps=0)
    status = {"coverage": {"done_batches": 10, "total_batches": 40}}
    workers = {0: {"step": 4, "loss": 0.5, "samples": 100}, 1: {"step": 3, "loss": 0.7, "samples": 80}}
    why = watch(status, workers)
    assert why == "on_checkpoint raised StopTraining at step 3: a checkpoint is enough"
    assert [(e.step, e.path) for e in ckpts] == [(3, b.checkpoint)]
    assert [(e.step, e.samples, e.fraction) for e in steps] == [(4, 180, 0.25)]
    assert steps[0].loss == pytest.approx(0.6)
    assert watch(status, workers) == ""  # no new step, no new checkpoint: nothing fires
    assert len(steps) == 1 and len(ckpts) == 1
    workers[1]["step"] = 7
    assert watch({"coverage": {"done_batches": 20, "total_batches": 40}}, workers) == "on_step returned STOP at step 7"
    assert calls.reason.startswith("on_checkpoint raised StopTraining")  # the first stop asked for is kept

    def broken(e: api.StepEvent) -> object:
        raise ValueError("bad\nthing")

    bad = api._FleetWatch(api._Callbacks(broken, None, None, api._progress(False, "launch", "batches")),
                          b.run_dir / "checkpoints", total_steps=0)
    with pytest.raises(api.CallbackError) as e:
        bad(status, workers)
    assert str(e.value) == "on_step raised ValueError at step 7: bad thing"
