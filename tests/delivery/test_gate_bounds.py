"""The quality gate's bound is exactly ``max_auc_drop``: a drop just over it is refused, one
just under it (or equal) is published.

The published version's AUC is the one its manifest recorded on the same holdout (the
gate trusts the record when holdout and row count match), so each case sets the published
AUC to the staged bundle's own measured AUC plus a chosen drop: the bound is checked to
the last digit, not against whatever two checkpoints happen to score.
"""

from __future__ import annotations

import json
import logging
import math
import shutil
from pathlib import Path

import numpy as np
import pytest

from delivery.config import DeliveryConfig
from delivery.gate import GateReport, run_gate
from delivery.job import deliver_once
from delivery.loader import load_bundle
from tests.delivery.conftest import live_features, write_parquet


class _Setup:
    def __init__(self, root: Path, history, tiny) -> None:
        deliver_once(DeliveryConfig(out=root / "ref"), checkpoint=history.ckpts[30])
        ref = load_bundle(root / "ref")
        fb = live_features(tiny, history.live[30], rows=300, seed=5)
        probs = ref.predict(fb)
        ref.close()
        # labels: ckpt-30's own ranking; the staged ckpt-10 bundle ranks them less well
        labels = {h: (p.numpy() > np.median(p.numpy())).astype(np.float32) for h, p in probs.items()}
        self.holdout = write_parquet(root / "holdout.parquet", tiny, fb, labels)
        self.one_class = write_parquet(root / "one_class.parquet", tiny, fb,
                                       {h: np.zeros_like(v) for h, v in labels.items()})
        deliver_once(DeliveryConfig(out=root / "staged"), checkpoint=history.ckpts[10])
        self.staged = root / "staged" / "v000001"
        deliver_once(DeliveryConfig(out=root / "published"), checkpoint=history.ckpts[30])
        self.published = root / "published" / "v000001"
        alone = run_gate(self.staged, holdout=str(self.holdout))
        assert alone.ok and alone.published_auc == {} and alone.rows == 300
        self.auc = alone.auc
        self.rows = alone.rows
        assert self.auc and all(0.5 < a < 0.99 for a in self.auc.values()), self.auc

    def record(self, auc: dict[str, float], holdout: str | None = None, rows: int | None = None) -> None:
        """Make the published manifest say it scored ``auc`` on the holdout."""
        path = self.published / "manifest.json"
        m = json.loads(path.read_text())
        m["gate"] = {"gated": True, "holdout": str(self.holdout) if holdout is None else holdout,
                     "rows": self.rows if rows is None else rows, "auc": auc, "published_auc": {}}
        path.write_text(json.dumps(m))

    def gate(self, max_auc_drop: float, holdout: Path | None = None) -> GateReport:
        return run_gate(self.staged, published=self.published, holdout=str(holdout or self.holdout),
                        max_auc_drop=max_auc_drop)


@pytest.fixture(scope="module")
def setup(tmp_path_factory, history, tiny) -> _Setup:
    return _Setup(tmp_path_factory.mktemp("gate_bounds"), history, tiny)


def _exactly_at(a: float, drop: float) -> float:
    """A published AUC ``b`` with ``b - drop == a`` in floating point (the drop is exactly the bound)."""
    b = a + drop
    for _ in range(64):
        if b - drop == a:
            return b
        b = float(np.nextafter(b, np.inf if b - drop < a else -np.inf))
    raise AssertionError(f"no float b with b - {drop} == {a}: the exact-bound case cannot be built")


@pytest.mark.parametrize("max_drop", [0.01, 0.002, 0.05])
def test_a_drop_just_over_the_bound_is_refused(setup: _Setup, max_drop: float) -> None:
    published = {h: a + max_drop * 1.1 for h, a in setup.auc.items()}
    setup.record(published)
    report = setup.gate(max_drop)
    assert not report.ok
    assert report.auc == setup.auc and report.published_auc == published and report.rows == setup.rows
    assert report.reasons == [
        f"head '{h}': holdout AUC {a:.5f} is {published[h] - a:.5f} below the published v000001's "
        f"{published[h]:.5f} (allowed drop {max_drop})" for h, a in setup.auc.items()
    ]


@pytest.mark.parametrize("max_drop", [0.01, 0.002, 0.05])
def test_a_drop_just_under_the_bound_is_published(setup: _Setup, max_drop: float) -> None:
    setup.record({h: a + max_drop * 0.9 for h, a in setup.auc.items()})
    report = setup.gate(max_drop)
    assert report.ok and report.reasons == []


def test_a_drop_equal_to_the_bound_is_published(setup: _Setup) -> None:
    drop = 0.0078125  # 2**-7
    setup.record({h: _exactly_at(a, drop) for h, a in setup.auc.items()})
    assert setup.gate(drop).ok


def test_no_drop_allowed_refuses_any_drop_and_accepts_equal(setup: _Setup) -> None:
    setup.record({h: float(np.nextafter(a, 1.0)) for h, a in setup.auc.items()})
    assert not setup.gate(0.0).ok
    setup.record(dict(setup.auc))
    assert setup.gate(0.0).ok


def test_a_record_of_another_holdout_or_row_count_is_not_trusted(setup: _Setup) -> None:
    """The published bundle (ckpt-30, AUC 1 on this holdout) is measured again, not read from a
    record taken on other rows: the staged bundle is refused."""
    for stale in ({"holdout": "elsewhere.parquet"}, {"rows": setup.rows + 1}):
        setup.record({h: 0.0 for h in setup.auc}, **stale)
        report = setup.gate(0.01)
        assert not report.ok
        assert all(v == pytest.approx(1.0) for v in report.published_auc.values()), report.published_auc
    setup.record({})  # a record without AUCs: measured too
    assert not setup.gate(0.01).ok
    report = setup.gate(1.0)
    assert report.ok and all(v == pytest.approx(1.0) for v in report.published_auc.values())


def test_an_undefined_published_auc_or_head_is_not_compared(setup: _Setup) -> None:
    setup.record({h: float("nan") for h in setup.auc})
    report = setup.gate(0.0)
    assert report.ok and all(math.isnan(v) for v in report.published_auc.values())
    setup.record({"some_other_head": 1.0})
    assert setup.gate(0.0).ok


def test_a_holdout_with_one_class_is_refused(setup: _Setup) -> None:
    """No head has a defined AUC: nothing was checked, so nothing is published."""
    report = setup.gate(1.0, holdout=setup.one_class)
    assert not report.ok and all(math.isnan(a) for a in report.auc.values())
    assert report.reasons[-1] == f"{setup.one_class}: no head has a defined AUC (a label has only one class)"


def test_the_record_written_into_the_manifest(setup: _Setup) -> None:
    published = {h: a + 0.001 for h, a in setup.auc.items()}
    setup.record(published)
    report = setup.gate(0.01)
    assert report.ok
    assert report.record(str(setup.holdout)) == {"gated": True, "holdout": str(setup.holdout), "rows": setup.rows,
                                                 "auc": setup.auc, "published_auc": published, "adapt": report.adapt}
    assert report.adapt["selected"] is False  # no timestamp in this schema: no first-k episodes, the configured recipe ships


def test_defaults_are_consistency_only_and_a_drop_of_one_hundredth(setup: _Setup) -> None:
    report = run_gate(setup.staged)  # no holdout: consistency checks only
    assert report.ok is True and report.reasons == [] and report.auc == {} and report.rows == 0
    setup.record({h: a + 0.011 for h, a in setup.auc.items()})
    report = run_gate(setup.staged, published=setup.published, holdout=str(setup.holdout))
    assert report.ok is False and "(allowed drop 0.01)" in report.reasons[0]
    setup.record({h: a + 0.009 for h, a in setup.auc.items()})
    assert run_gate(setup.staged, published=setup.published, holdout=str(setup.holdout)).ok is True


def test_verdicts_are_logged_with_their_fields(setup: _Setup, tmp_path: Path, caplog) -> None:
    caplog.set_level(logging.INFO, logger="delivery.gate")
    published = {h: a + 0.02 for h, a in setup.auc.items()}
    setup.record(published)
    report = setup.gate(0.01)
    (rec,) = [r for r in caplog.records if r.name == "delivery.gate"]
    assert (rec.levelno, rec.getMessage()) == (logging.INFO, "gate")
    assert rec.kv == {"bundle": setup.staged, "ok": False, "auc": report.auc, "published_auc": published,
                      "rows": setup.rows}

    bad = tmp_path / "v000009"
    shutil.copytree(setup.staged, bad)
    with open(bad / "dense.pt", "r+b") as fh:
        b = fh.read(1)
        fh.seek(0)
        fh.write(bytes([b[0] ^ 0xFF]))
    caplog.clear()
    report = run_gate(bad, published=setup.published, holdout=str(setup.holdout))
    assert report.ok is False and len(report.reasons) == 1 and "dense.pt: checksum mismatch" in report.reasons[0]
    (rec,) = [r for r in caplog.records if r.name == "delivery.gate"]
    assert (rec.levelno, rec.getMessage()) == (logging.WARNING, "gate refused an inconsistent bundle")
    assert rec.kv == {"bundle": bad, "problems": 1}


def test_holdout_rows_caps_what_is_evaluated(setup: _Setup) -> None:
    setup.record({})  # no usable record: the published bundle is measured on the same capped rows
    report = run_gate(setup.staged, published=setup.published, holdout=str(setup.holdout), max_auc_drop=1.0,
                      holdout_rows=100)
    assert report.ok and report.rows == 100
    full = run_gate(setup.staged, holdout=str(setup.holdout))
    assert full.rows == 300 and report.auc != full.auc
    # a published version with no record is measured on the same capped rows: itself scores the same
    same = run_gate(setup.staged, published=setup.staged, holdout=str(setup.holdout), holdout_rows=100)
    assert same.ok and same.rows == 100 and same.published_auc == same.auc == report.auc
