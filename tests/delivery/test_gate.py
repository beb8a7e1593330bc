"""The validation gate: AUC against the published version, and bundle consistency."""

from __future__ import annotations

import json
import os

import lmdb
import numpy as np
import pytest

from delivery.bundle import EMBEDDINGS, checksum_files, encode_keys
from delivery.config import DeliveryConfig
from delivery.gate import check_consistency, run_gate
from delivery.job import deliver_once
from delivery.loader import load_bundle
from delivery.publish import Publisher
from metaps.cli import main
from tests.delivery.conftest import live_features, write_parquet


@pytest.fixture(scope="module")
def holdout(tmp_path_factory, history, tiny):
    """Labels = the ckpt-30 model's own ranking, so ckpt-30 scores AUC 1 and older checkpoints less."""
    d = tmp_path_factory.mktemp("holdout")
    deliver_once(DeliveryConfig(out=d / "ref"), checkpoint=history.ckpts[30])
    ref = load_bundle(d / "ref")
    fb = live_features(tiny, history.live[30], rows=400, seed=11)
    probs = ref.predict(fb)
    labels = {h: (p.numpy() > np.median(p.numpy())).astype(np.float32) for h, p in probs.items()}
    return write_parquet(d / "holdout.parquet", tiny, fb, labels)


def _deliver(ckpt, out, holdout, *extra):
    return main(["--json", "deliver", "--checkpoint", str(ckpt), "--out", str(out), "--holdout", str(holdout),
                 "--max-auc-drop", "0.01", *extra])


def test_gate_refuses_a_worse_model_and_accepts_better_or_equal(tmp_path, history, holdout, capsys):
    out = tmp_path / "out"
    assert _deliver(history.ckpts[10], out, holdout) == 0
    first = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert first["status"] == "published" and first["auc"]["click"] < 0.99
    assert _deliver(history.ckpts[30], out, holdout) == 0          # better
    second = json.loads(capsys.readouterr().out.strip().splitlines()[-1])
    assert second["version"] == "v000002" and second["auc"]["click"] == pytest.approx(1.0)
    gate = json.loads((out / "v000002" / "manifest.json").read_text())["gate"]
    assert gate["auc"]["click"] == pytest.approx(1.0) and gate["rows"] == 400

    assert _deliver(history.ckpts[10], out, holdout, "--force") == 3  # worse than the published
    err = capsys.readouterr().err
    assert "refused by the validation gate" in err
    assert "head 'click': holdout AUC" in err and "below the published v000002's 1.00000" in err
    assert Publisher(out).latest() == "v000002"
    assert not any(p.name.startswith(".v") for p in out.iterdir())

    assert _deliver(history.ckpts[30], out, holdout, "--force") == 0  # equal
    assert Publisher(out).latest() == "v000003"


def test_corrupted_bundle_is_refused_by_checksum(tmp_path, history):
    out = tmp_path / "out"
    deliver_once(DeliveryConfig(out=out), checkpoint=history.ckpts[10])
    bundle = out / "v000001"
    with open(bundle / "dense.pt", "r+b") as fh:
        fh.seek(os.path.getsize(bundle / "dense.pt") // 2)
        b = fh.read(1)
        fh.seek(-1, 1)
        fh.write(bytes([b[0] ^ 0xFF]))
    report = run_gate(bundle)
    assert not report.ok and "dense.pt: checksum mismatch" in report.reasons[0]
    with pytest.raises(Exception, match=r"dense.pt: checksum mismatch"):
        load_bundle(out)


def _rewrite_manifest(bundle, fn):
    path = bundle / "manifest.json"
    m = json.loads(path.read_text())
    fn(m)
    path.write_text(json.dumps(m))


def test_missing_table_and_dim_mismatch_are_inconsistent(tmp_path, history):
    out = tmp_path / "out"
    deliver_once(DeliveryConfig(out=out), checkpoint=history.ckpts[10])
    bundle = out / "v000001"
    assert check_consistency(bundle) == []
    _rewrite_manifest(bundle, lambda m: m["tables"]["tag"].update(dim=12))
    assert any("table 'tag': manifest dim 12, model config dim 8" in p for p in check_consistency(bundle))
    _rewrite_manifest(bundle, lambda m: m["tables"].pop("tag"))
    problems = check_consistency(bundle)
    assert any("tables ['tag'] of the schema are missing from the bundle" in p for p in problems)


def test_nan_rows_are_inconsistent(tmp_path, history, tiny):
    out = tmp_path / "out"
    deliver_once(DeliveryConfig(out=out), checkpoint=history.ckpts[10])
    bundle = out / "v000001"
    victim = int(history.live[10]["user"][3])
    env = lmdb.open(str(bundle / EMBEDDINGS), subdir=False, lock=False)
    with env.begin(write=True) as txn:
        txn.put(encode_keys("user", np.array([victim]))[0], np.full(tiny.dims["user"], np.nan, np.float32).tobytes())
    env.close()
    _rewrite_manifest(bundle, lambda m: m.update(files=checksum_files(bundle)))  # checksums "fine"
    problems = check_consistency(bundle)
    assert any(f"table 'user': 1 rows with NaN/inf, first id {victim}" in p for p in problems)
