"""Distributed training (1 worker, 1 and 2 PS shards, synchronous) equals train-local.

The meta case on 2 shards trains a model metaps does not ship: the two-tower of
docs/examples/two_tower.py (``[model] kind = "custom"``), whose declared ``item`` dim (16)
sizes that PS table, so the custom-model path is held to the same equality.

Equality alone would hold between two runs that never update anything, so every
compared row and dense parameter is also compared with its value before training
(the deterministic initial row of its id; the seeded initial model): most must
have moved, or the test fails. Multi-worker parity: tests/workers/test_parity_multi.py.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch

from ps.client import PsClient
from workers.local import local_store, train_local
from workers.row_source import RemoteRowSource
from workers.worker import Worker, build_model

from tests.workers.conftest import make_job


def _all_ids(worker: Worker, batches: int | None = None) -> dict[str, np.ndarray]:
    """Unique ids per table of the dataset (or of its first ``batches`` batches, in training order)."""
    ids: dict[str, list[np.ndarray]] = {}
    ds = worker.dataset  # training order: the worker's own ranges (train-local reads the DDS's shard shuffle)
    order = (b for r, _ in worker._ranges() for b in ds.read_range(r.file, r.start, r.stop))
    for i, batch in enumerate(ds.iter_all() if batches is None else order):
        if batches is not None and i >= batches:
            break
        for t, u in batch.unique_ids.items():
            ids.setdefault(t, []).append(u.numpy())
    return {t: np.unique(np.concatenate(v)) for t, v in ids.items()}


EXAMPLES = Path(__file__).resolve().parents[2] / "docs" / "examples"
TWO_TOWER = {"kind": "custom", "class": "two_tower:TwoTower", "class_dir": str(EXAMPLES), "hidden": [16]}


# the small-data knob on the PS side: the dnn meta case trains with AdamW weight decay, which the PS
# applies to the dense parameters in a fleet and the worker's local store in train-local (ps.dense_store)
DECAY = {"ps": {"dense_optimizer": {"kind": "adamw", "lr": 1e-3, "weight_decay": 0.5}}}


@pytest.mark.parametrize("mode,shards,model", [("meta", 1, "dnn"), ("meta", 2, "two_tower"), ("plain", 2, "dnn")])
def test_distributed_matches_local(worker_data, ps_servers, tmp_path: Path, mode: str, shards: int, model: str) -> None:
    custom = {"model": TWO_TOWER} if model == "two_tower" else DECAY if mode == "meta" else {}
    job = make_job(worker_data["meta"], tmp_path, mode=mode, shards=shards, train={"max_steps": 12}, **custom)
    if model == "two_tower":
        assert {t.name: t.dim for t in job.table_configs()}["item"] == 16  # the class's declared dim
    _, local = train_local(job, tmp_path / "local", checkpoint=False)

    addrs = ps_servers(job)
    client = PsClient(addrs, job.rpc, worker_id="worker-0", register=True)
    dist = Worker(job, 0, RemoteRowSource(client), run_dir=tmp_path / "dist", world=1)
    dist.train()
    assert dist.trainer.step_no == local.trainer.step_no == 12
    assert type(dist.model).__name__ == ("CustomModel" if model == "two_tower" else "WideDeep")

    for (name, a), (_, b) in zip(local.model.named_parameters(), dist.model.named_parameters()):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6, msg=f"dense param {name}")
    ids = _all_ids(local)
    local_rows = local.rows.pull(ids)
    dist_rows = dist.rows.pull(ids)
    for t in ids:
        np.testing.assert_allclose(local_rows[t], dist_rows[t], rtol=1e-5, atol=1e-6, err_msg=f"table {t}")
    trained = _all_ids(local, batches=12)
    assert_trained(job, trained, local.rows.pull(trained), local.model)
    client.close()


def assert_trained(job, ids: dict[str, np.ndarray], rows: dict[str, np.ndarray], model: torch.nn.Module) -> None:
    """Training moved the rows and the dense parameters away from their pre-training values.

    Args:
        ids: the ids of the batches trained on, per table.
        rows: their rows after training.

    Initial rows are a pure function of (table, id, seed): a fresh store returns them. In meta
    mode ids seen only in support sets may get no outer gradient, hence "most", not "all".
    """
    fresh = local_store(job)
    for t, v in ids.items():
        init = fresh.pull(t, v)
        changed = np.abs(rows[t] - init).max(axis=1) > 1e-7
        assert changed.mean() > 0.5, f"table {t}: only {int(changed.sum())}/{len(v)} rows differ from their initial values"
    init_model = build_model(job)
    for (name, a), (_, b) in zip(model.named_parameters(), init_model.named_parameters()):
        assert not torch.allclose(a, b, rtol=0, atol=1e-7), f"dense param {name} never moved"
