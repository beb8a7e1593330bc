"""Loss per head: the model steps report each head's loss, the worker's gauge exports it.

``plain_step`` fills ``loss/<head>`` and ``meta_step`` ``query_loss/<head>``
(each equals the head's own loss, and they sum to the step's loss); a worker's
:class:`~workers.telemetry.Telemetry` turns them into ``metaps_worker_loss{head,kind}``
beside ``head="all"``. The live worker test (test_telemetry.py) scrapes the same
series from a real process.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from prometheus_client import REGISTRY

from models import ModelConfig, build_model, loss
from models.meta import MetaConfig, meta_step, plain_step
from models.testing import random_meta_batch, random_plain_batch, random_rows, synthetic_schema
from workers.telemetry import Telemetry, loss_labels

TINY = dict(hidden=[8], expert_hidden=[8], n_experts=2, default_dim=4, cross_layers=1)


def _schema():  # type: ignore[no-untyped-def]
    return synthetic_schema(n_sparse=2, n_multi_hot=1, n_text=1, n_dense=2, vector_dim=4, max_len=3)


@pytest.mark.parametrize("kind", ["dnn", "esmm"])
def test_plain_step_reports_each_heads_loss(kind: str) -> None:
    g = torch.Generator().manual_seed(5)
    schema = _schema()
    model = build_model(schema, ModelConfig(kind=kind, **TINY))
    pb = random_plain_batch(schema, 12, generator=g)
    rows = random_rows(pb.unique_ids, model.dims, g)
    metrics: dict[str, float] = {}
    total, _, _ = plain_step(model, pb, rows, metrics)
    _, want = loss(model(pb.features, rows, pb.unique_ids), pb.features, model.heads)
    assert set(metrics) == {f"loss/{h.name}" for h in model.heads} and len(metrics) >= 2
    for head, value in want.items():
        assert metrics[f"loss/{head}"] == pytest.approx(float(value.detach()), rel=1e-5), head
    assert sum(metrics.values()) == pytest.approx(float(total), rel=1e-5)


@pytest.mark.parametrize("vectorize", [True, False])
def test_meta_step_reports_each_heads_query_loss(vectorize: bool) -> None:
    g = torch.Generator().manual_seed(7)
    schema = _schema()
    model = build_model(schema, ModelConfig(kind="dnn", **TINY))
    mb = random_meta_batch(schema, tasks=4, support=5, query=4, vocab=8, generator=g, pad_tasks=1)
    mb.query.mask[1] = False  # a task with no query rows weighs 0 in the per-head means too
    rows = random_rows(mb.unique_ids, model.dims, g, scale=0.5)
    res = meta_step(model, mb, rows, MetaConfig(inner_steps=1, inner_lr=0.1, vectorize=vectorize))
    heads = {k: v for k, v in res.metrics.items() if k.startswith("query_loss/")}
    assert set(heads) == {f"query_loss/{h.name}" for h in model.heads}
    assert all(v > 0 for v in heads.values())
    assert sum(heads.values()) == pytest.approx(res.metrics["query_loss"], rel=1e-5)
    assert res.metrics["query_loss"] == pytest.approx(float(res.outer_loss), rel=1e-5)


def test_loss_labels() -> None:
    assert loss_labels("loss/click") == ("click", "total")
    assert loss_labels("query_loss") == ("all", "query")
    assert loss_labels("query_loss/conversion") == ("conversion", "query")
    assert loss_labels("support_loss_before") == ("all", "support_before")
    assert loss_labels("tasks") is None and loss_labels("loss") is None


def test_telemetry_exports_loss_per_head(tmp_path: Path) -> None:
    tel = Telemetry(tmp_path / "run", rank=41, every=0)
    parts = {"loss/click": 0.25, "loss/conversion": 0.5, "query_loss": 0.75, "query_loss/click": 0.25,
             "query_loss/conversion": 0.5, "tasks": 3.0}
    tel.on_step(1, 16, 0.75, {"total": 0.01}, parts)

    def gauge(head: str, kind: str) -> float | None:
        return REGISTRY.get_sample_value("metaps_worker_loss", {"rank": "41", "head": head, "kind": kind})

    assert gauge("all", "total") == 0.75 and gauge("all", "query") == 0.75
    assert gauge("click", "total") == 0.25 and gauge("conversion", "total") == 0.5
    assert gauge("click", "query") == 0.25 and gauge("conversion", "query") == 0.5
    assert gauge("tasks", "total") is None
