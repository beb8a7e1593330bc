"""``metaps evaluate --checkpoint RUN_DIR`` on a Meta-SGD model (issue 29: the inner loop read the unresolved path).

A Meta-SGD model (``[meta] learn_inner_lr = "element"``) keeps its learned inner rates with
the dense parameters of the checkpoint; the evaluation's inner loop reads them from the
checkpoint directory. Given a run directory, every reader must use its newest committed
checkpoint: the report must equal the one given ``RUN_DIR/checkpoints/ckpt-N`` itself.
A real tiny train-local run (800 generated rows), real checkpoint files, the real CLI.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from delivery.bundle import DeliveryError
from metaps.cli import main
from metaps.evaluate import evaluate_report
from metaps.job import job_from_mapping
from workers.local import train_local

from tests.metaps.fleet_data import job_mapping, make_data


@pytest.fixture(scope="module")
def meta_sgd_run(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """A train-local run of a Meta-SGD model: {"run", "ckpt", "eval"}."""
    root = tmp_path_factory.mktemp("evaluate-run-dir")
    data = make_data(root / "data")
    job = job_from_mapping(job_mapping(data, root, workers=1, meta={"learn_inner_lr": "element"},
                                       train={"max_steps": 4}), where="<test job>")
    rep, _ = train_local(job, root / "run")
    return {"run": root / "run", "ckpt": Path(rep["checkpoint"]), "eval": data["eval"]}


def _cli(capsys: pytest.CaptureFixture[str], *args: str) -> dict:
    from metaps.progress import parse_kv_line

    capsys.readouterr()
    assert main(["evaluate", *args]) == 0
    cap = capsys.readouterr()
    # progress on stderr off a terminal: batches scored, the last line at the dataset's batch count
    told = [r for line in cap.err.splitlines() if 'msg="progress"' in line and (r := parse_kv_line(line))]
    assert told and told[-1]["what"] == "evaluate" and told[-1]["done"] == told[-1]["total"] > 0, cap.err
    return json.loads(cap.out.strip().splitlines()[-1])


def test_run_dir_evaluates_as_its_newest_checkpoint(meta_sgd_run, capsys) -> None:
    ckpt = meta_sgd_run["ckpt"]
    assert ckpt.parent == meta_sgd_run["run"] / "checkpoints"
    common = ["--data", str(meta_sgd_run["eval"]), "--protocol", "episodes"]
    want = _cli(capsys, "--checkpoint", str(ckpt), *common)
    assert "adapted" in want and want["meta"]["learn_inner_lr"] == "element"
    for given in (meta_sgd_run["run"], meta_sgd_run["run"] / "checkpoints"):
        got = _cli(capsys, "--checkpoint", str(given), *common)
        assert got["source"]["checkpoint"] == str(ckpt), given
        for kind in ("base", "adapted"):
            for head, m in want[kind].items():
                assert got[kind][head]["auc"] == m["auc"], (given, kind, head)
                assert got[kind][head]["logloss"] == m["logloss"], (given, kind, head)


def test_a_dir_without_a_committed_checkpoint_is_one_line(meta_sgd_run, tmp_path: Path) -> None:
    (tmp_path / "checkpoints").mkdir()
    for given in (tmp_path, tmp_path / "checkpoints"):
        with pytest.raises(DeliveryError, match=rf"^{given}: .*no committed checkpoint") as err:
            evaluate_report(meta_sgd_run["eval"], checkpoint=given)
        assert "\n" not in str(err.value)
