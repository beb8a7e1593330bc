"""`metaps deliver` / `metaps predict` end to end (in-process CLI, real files)."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pyarrow.parquet as pq
import torch

from delivery.loader import load_bundle
from metaps.cli import main
from tests.delivery.conftest import live_features, write_parquet


def test_predict_writes_the_bundles_scores(tmp_path, history, tiny, capsys):
    out = tmp_path / "bundles"
    assert main(["deliver", "--no-gate", "--checkpoint", str(history.ckpts[30]), "--out", str(out), "--dtype", "fp16"]) == 0
    fb = live_features(tiny, history.live[30], rows=50, seed=4)
    data = write_parquet(tmp_path / "day.parquet", tiny, fb, {h: np.zeros(50) for h in tiny.schema.labels})
    capsys.readouterr()
    assert main(["--json", "predict", "--bundle", str(out), "--data", str(data), "--out",
                 str(tmp_path / "s.parquet"), "--batch-rows", "16"]) == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1  # --json: exactly one object
    summary = json.loads(printed[0])
    assert summary.pop("eval")["labels"] == list(tiny.schema.labels)  # labelled data: evaluated in the same object
    assert summary == {"bundle": "v000001", "rows": 50, "out": str(tmp_path / "s.parquet"), "unknown_ids": 0,
                       "unknown_share": 0.0, "adapted": False, "recipe": "", "recipe_from": ""}
    assert main(["predict", "--bundle", str(out), "--data", str(data), "--out", str(tmp_path / "s2.parquet")]) == 0
    human = capsys.readouterr().out.strip().splitlines()  # no --json: one readable line
    assert human == [f"scored 50 rows with bundle v000001 -> {tmp_path / 's2.parquet'}; AUC "
                     + human[0].split("; AUC ")[1]] and "{" not in human[0]
    scores = pq.read_table(tmp_path / "s.parquet").to_pydict()
    want = load_bundle(out).predict(fb)
    assert scores["row"] == list(range(50))
    for h in tiny.schema.labels:
        np.testing.assert_allclose(scores[f"p_{h}"], want[h].numpy(), atol=1e-6)


def test_deliver_every_runs_the_loop(tmp_path, history, capsys):
    run = tmp_path / "run"
    shutil.copytree(history.ckpts[20], run / "checkpoints" / "ckpt-20")
    try:  # --threads sets torch's intra-op threads (default 1); 0 is one error line
        rc = main(["--json", "deliver", "--no-gate", "--run", str(run), "--out", str(tmp_path / "out"), "--every",
                   "10ms", "--max-ticks", "2", "--threads", "2"])
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(1)
    assert rc == 0
    printed = capsys.readouterr().out.strip().splitlines()
    assert len(printed) == 1  # --json: one object for the whole loop
    assert [x["status"] for x in json.loads(printed[0])["outcomes"]] == ["published", "up_to_date"]
    assert main(["deliver", "--no-gate", "--run", str(run), "--out", str(tmp_path / "out"), "--threads", "0"]) == 1
    assert "metaps deliver: error: --threads must be >= 1, got 0" in capsys.readouterr().err


def test_deliver_if_checkpoint_exits_0_before_the_runs_first_checkpoint(tmp_path, history, capsys):
    """The CronJob's schedule may start before the run's first checkpoint: not a failed Job."""
    run = tmp_path / "run"
    (run / "checkpoints").mkdir(parents=True)
    out = tmp_path / "out"
    assert main(["deliver", "--no-gate", "--run", str(run), "--out", str(out)]) == 1  # without the flag: an error
    assert "run has no committed checkpoint" in capsys.readouterr().err
    assert main(["--json", "deliver", "--no-gate", "--run", str(run), "--out", str(out), "--if-checkpoint"]) == 0
    cap = capsys.readouterr()
    assert json.loads(cap.out)["status"] == "no_checkpoint"
    assert main(["deliver", "--no-gate", "--run", str(run), "--out", str(out), "--if-checkpoint"]) == 0
    assert "no committed checkpoint yet" in capsys.readouterr().out
    assert not (out / "LATEST").exists()
    shutil.copytree(history.ckpts[20], run / "checkpoints" / "ckpt-20")  # once there is one, it delivers
    assert main(["--json", "deliver", "--no-gate", "--run", str(run), "--out", str(out), "--if-checkpoint"]) == 0
    assert json.loads(capsys.readouterr().out)["status"] == "published"


def test_bad_input_exits_nonzero_with_the_reason(tmp_path, capsys):
    assert main(["deliver", "--no-gate", "--checkpoint", str(tmp_path / "none"), "--out", str(tmp_path / "o")]) == 1
    assert "none: checkpoint directory not found" in capsys.readouterr().err
    assert main(["deliver", "--no-gate", "--run", str(tmp_path), "--out", str(tmp_path / "o"), "--keep", "0"]) == 1
    assert "keep must be >= 1, got 0" in capsys.readouterr().err
    assert main(["deliver", "--no-gate", "--run", str(tmp_path), "--out", str(tmp_path / "o"), "--every", "soon"]) == 1
    assert "bad interval 'soon'" in capsys.readouterr().err
    assert main(["predict", "--bundle", str(tmp_path / "nb"), "--data", "x.parquet", "--out", "y.parquet"]) == 1
    assert "nb: bundle path does not exist" in capsys.readouterr().err


def test_predict_on_meta_shaped_and_plain_batches(tmp_path, history, tiny):
    from meta_io.batch import PlainBatch

    main(["deliver", "--no-gate", "--checkpoint", str(history.ckpts[30]), "--out", str(tmp_path / "b")])
    served = load_bundle(tmp_path / "b")
    fb = live_features(tiny, history.live[30], rows=12, seed=9)
    flat = served.predict(PlainBatch(features=fb, unique_ids={}))
    meta = served.predict(fb.map(lambda t: t.reshape((3, 4) + tuple(t.shape[1:]))))
    for h in flat:
        assert meta[h].shape == (3, 4)
        torch.testing.assert_close(meta[h].reshape(-1), flat[h])


def test_deliver_without_holdout_needs_no_gate_and_the_manifest_says_so(tmp_path, history, tiny, capsys):
    out = tmp_path / "bundles"
    assert main(["deliver", "--checkpoint", str(history.ckpts[30]), "--out", str(out)]) == 1
    assert "--no-gate" in capsys.readouterr().err
    assert not (out / "LATEST").exists()
    assert main(["deliver", "--no-gate", "--checkpoint", str(history.ckpts[30]), "--out", str(out)]) == 0
    assert load_bundle(out).manifest.gate["gated"] is False
    fb = live_features(tiny, history.live[30], rows=60, seed=5)
    rng = np.random.default_rng(0)
    labels = {h: rng.integers(0, 2, 60).astype(np.float64) for h in tiny.schema.labels}
    hold = write_parquet(tmp_path / "hold.parquet", tiny, fb, labels)
    assert main(["deliver", "--checkpoint", str(history.ckpts[30]), "--out", str(out), "--force",
                 "--holdout", str(hold)]) == 0
    gate = load_bundle(out).manifest.gate
    assert gate["gated"] is True and gate["holdout"] == str(hold)
