"""Progress of ``metaps deliver``: the stages ``deliver_once`` tells its hook (real checkpoints of a
real 2-shard PS fleet, real bundles), and what the CLI makes of them (a bar on a terminal;
``msg="progress"`` lines with pct/eta_s off one; stdout still exactly one JSON object with ``--json``)."""

from __future__ import annotations

import io
import json
import shutil
from pathlib import Path

import pytest
from rich.console import Console

from delivery.config import DeliveryConfig
from delivery.export import DeliverStage
from delivery.job import Status, deliver_once
from metaps.cli import main
from metaps.progress import StageProgress, parse_kv_line
from tests.delivery.conftest import Fleet, History, TinyModel
from tests.delivery.test_incremental_delta import delta_checkpoint
from tests.progress_hooks import Recorder, check_stage

ALL = [DeliverStage.VERIFY, DeliverStage.EXPORT, DeliverStage.DENSE, DeliverStage.GATE, DeliverStage.PUBLISH]


def _ckpt_rows(ckpt: Path) -> int:
    from ps.checkpoint import read_manifest

    return sum(int(t["rows"]) for t in read_manifest(ckpt)["tables"].values())


def test_a_delivery_tells_each_stage_in_order_and_export_rows_end_at_the_checkpoints_total(
        tmp_path: Path, history: History, tiny: TinyModel) -> None:
    out = tmp_path / "out"
    cfg = DeliveryConfig(out=out, incremental=True)
    for step, kind in ((10, "full"), (20, "delta")):  # a full bundle, then a delta on it (every row read)
        rec = Recorder()
        o = deliver_once(cfg, checkpoint=history.ckpts[step], progress=rec)
        assert o.status is Status.PUBLISHED and o.kind == kind
        assert rec.stages() == ALL
        rows = _ckpt_rows(history.ckpts[step])
        assert rows > 0 and sum(t.rows for t in _manifest(out, o.version).tables.values()) == rows
        export = rec.of(DeliverStage.EXPORT)
        check_stage(export, rows)
        assert len({d for d, _t in export}) == 1 + len(tiny.dims), export  # 0, then after each table
        for one in (DeliverStage.VERIFY, DeliverStage.DENSE, DeliverStage.GATE, DeliverStage.PUBLISH):
            assert rec.of(one) == [(0, 1), (1, 1)], (one, rec.calls)
    rec = Recorder()
    assert deliver_once(cfg, checkpoint=history.ckpts[20], progress=rec).status is Status.UP_TO_DATE
    assert rec.stages() == [DeliverStage.VERIFY]  # nothing newer: it stops after the check


def _manifest(out: Path, version: str | None):
    from delivery.bundle import read_manifest

    assert version is not None
    return read_manifest(out / version)


def test_a_delta_checkpoint_export_counts_only_its_changed_rows(tmp_path: Path, tiny: TinyModel) -> None:
    fleet = Fleet(tiny, capacity=200)
    fleet.train(seed=10, fraction=1.0)
    base = delta_checkpoint(fleet, tmp_path / "ck", 10)
    cfg = DeliveryConfig(out=tmp_path / "out", incremental=True)
    deliver_once(cfg, checkpoint=base)
    fleet.train(seed=20, fraction=0.1, new_ids=40)
    delta = delta_checkpoint(fleet, tmp_path / "ck", 20)
    rec = Recorder()
    o = deliver_once(cfg, checkpoint=delta, progress=rec)
    m = _manifest(cfg.out, o.version)
    assert m.source["read"] == "changes"
    from ps.checkpoint import read_changes

    changed = sum(int(read_changes(delta, t)[0].ids.size) for t in tiny.dims)  # the delta's own rows
    assert 0 < changed < _ckpt_rows(delta)
    assert sum(t.written for t in m.tables.values()) <= changed
    check_stage(rec.of(DeliverStage.EXPORT), changed)


def test_a_terminal_gets_a_bar_per_stage(tmp_path: Path, history: History) -> None:
    buf = io.StringIO()
    with StageProgress(Console(file=buf, force_terminal=True, width=120)) as hook:
        deliver_once(DeliveryConfig(out=tmp_path / "out"), checkpoint=history.ckpts[10], progress=hook)
    text = buf.getvalue()
    rows = _ckpt_rows(history.ckpts[10])
    for stage in ALL:
        assert stage.value in text
    assert f"{rows:,}/{rows:,}" in text and "100%" in text and "ETA" in text


def _progress_lines(stderr: str) -> list[dict]:
    return [rec for line in stderr.splitlines()
            if 'msg="progress"' in line and (rec := parse_kv_line(line)) is not None]


def test_cli_off_a_terminal_logs_each_stage_and_json_stays_one_object(
        tmp_path: Path, history: History, capsys: pytest.CaptureFixture[str]) -> None:
    rows = _ckpt_rows(history.ckpts[10])
    for i, extra in enumerate(([], ["--no-progress"])):
        capsys.readouterr()
        assert main(["--json", "deliver", "--no-gate", "--checkpoint", str(history.ckpts[10]),
                     "--out", str(tmp_path / f"out{i}"), *extra]) == 0
        cap = capsys.readouterr()
        lines = cap.out.strip().splitlines()
        assert len(lines) == 1 and json.loads(lines[0])["status"] == "published", cap.out  # exactly the result
        recs = _progress_lines(cap.err)
        assert [r["what"] for r in recs] == [s.value for s in ALL], cap.err  # each stage leaves a line at its end
        assert all(r["pct"] == 100.0 and r["eta_s"] == 0 for r in recs), recs
        assert recs[1]["done"] == recs[1]["total"] == rows  # export: the checkpoint's rows
        assert "\x1b[" not in cap.err  # no bar drawn off a terminal


def test_cli_loop_logs_each_ticks_stages_and_prints_one_object(tmp_path: Path, history: History,
                                                               capsys: pytest.CaptureFixture[str]) -> None:
    run = tmp_path / "run"
    shutil.copytree(history.ckpts[10], run / "checkpoints" / "ckpt-10")
    capsys.readouterr()
    assert main(["--json", "deliver", "--no-gate", "--run", str(run), "--out", str(tmp_path / "out"),
                 "--every", "10ms", "--max-ticks", "2"]) == 0
    cap = capsys.readouterr()
    lines = cap.out.strip().splitlines()
    assert len(lines) == 1
    assert [x["status"] for x in json.loads(lines[0])["outcomes"]] == ["published", "up_to_date"]
    # tick 1: every stage; tick 2 (nothing newer): the check only
    assert [r["what"] for r in _progress_lines(cap.err)] == [s.value for s in ALL] + ["verify"], cap.err
