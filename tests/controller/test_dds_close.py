"""A step limit cuts a lease (a partial done the worker says it was not asked for), and a
train dataset closed on request: what the DDS records, through a real controller."""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.client import ControllerError
from controller.types import GetStatus
from tests.controller.conftest import TRAIN, client


def test_a_lease_cut_by_the_step_limit_records_what_was_trained(controller) -> None:  # type: ignore[no-untyped-def]
    srv = controller(datasets=(TRAIN,))
    w = client(srv, 0)
    lease = w.get_shard("train").lease
    assert lease is not None and lease.stop - lease.start >= 2
    with pytest.raises(ControllerError, match="never asked to stop early"):  # a cut it does not explain
        w.report_shard(lease, "done", samples=10, stop=lease.start + 1)
    r = w.report_shard(lease, "done", samples=10, stop=lease.start + 1, step_limit=True)
    assert r.accepted and r.kind == "done"
    prog = {d["dataset"]: d for d in srv.dds.progress()}["train"]
    assert prog["batches_done"] == 1
    nxt = w.get_shard("train").lease  # the rest of the lease is next in TODO
    assert nxt is not None and (nxt.file, nxt.start, nxt.stop) == (lease.file, lease.start + 1, lease.stop)


def test_a_dataset_closed_on_request_is_done_partial_and_durable(controller, tmp_path: Path) -> None:  # type: ignore[no-untyped-def]
    srv = controller(datasets=(TRAIN,), state_dir=tmp_path / "s")
    w = client(srv, 0)
    lease = w.get_shard("train").lease
    w.report_shard(lease, "done", samples=4)
    n = lease.stop - lease.start
    assert srv.dds.close("train", "every worker stopped training early: max_steps")
    assert not srv.dds.close("train", "again")
    assert w.get_shard("train").status is GetStatus.DONE and srv.dds.finished()
    cov = srv.dds.coverage().to_status()
    assert (cov["state"], cov["complete"], cov["problems"]) == ("partial_by_request", False, [])
    assert cov["closed"] == {"train": "every worker stopped training early: max_steps"}
    assert cov["by_dataset"]["train"][0] == n
    srv.stop(grace=0)
    back = controller(datasets=(TRAIN,), state_dir=tmp_path / "s")
    assert back.dds.finished() and back.dds.coverage().closed == {"train": "every worker stopped training early: max_steps"}
