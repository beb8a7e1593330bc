"""The run's final checkpoint is a committed cut: a finished run stays finished.

A PS restarted after the final checkpoint used to be restored to the newest *interval* cut,
and the rollback to it requeued every shard done since, after the workers had exited (the
launcher then said "succeeded" at 18% coverage). Now the leader reports the final checkpoint
with ``CheckpointDone(cut_id=0)`` and the controller records it as a committed cut of the
finished DDS, so the newest committed cut IS the final checkpoint and a rollback to it requeues
nothing. A final checkpoint reported while training still runs is refused and records nothing.
Real controller over gRPC on 127.0.0.1, real LMDB.
"""

from __future__ import annotations

import pytest

from controller.checkpoint import FINAL_CUT
from controller.client import ControllerError
from tests.controller.conftest import client, drain


def test_the_final_checkpoint_is_the_newest_committed_cut_and_a_rollback_to_it_requeues_nothing(controller) -> None:
    srv = controller()
    c = client(srv, 0)
    # an interval cut part-way through training
    assert c.get_shard("train") is not None  # leases one shard, reported below by drain's loop
    mid = srv.checkpoints.open_cut()
    srv.checkpoints.commit(mid, 3, "/ckpt/ckpt-3")
    with pytest.raises(ControllerError) as refused:  # training still runs: not a final checkpoint
        c.checkpoint_done(FINAL_CUT, 10, "/ckpt/ckpt-10")
    assert "not finished" in str(refused.value)
    assert [x["cut_id"] for x in srv.checkpoints.cuts()] == [mid]
    srv.dds.requeue_worker(0, "test")  # the lease above goes back (its holder never trained it)
    drain(c, "train")
    drain(c, "eval")
    assert srv.run_finished()
    c.checkpoint_done(FINAL_CUT, 14, "/ckpt/ckpt-14")
    c.checkpoint_done(FINAL_CUT, 14, "/ckpt/ckpt-14")  # a retried report: the same cut
    final = srv.checkpoints.latest_committed()
    assert final is not None and final["final"] and (final["step"], final["dir"]) == (14, "/ckpt/ckpt-14")
    assert [x["cut_id"] for x in srv.checkpoints.cuts()] == [mid, final["cut_id"]]
    # a PS restarted now is restored to the final checkpoint; the DDS rollback requeues nothing
    assert srv.checkpoints.rollback_to_latest() == []
    st = c.status()
    assert st["finished"] and st["coverage"]["complete"], st["coverage"]
    # (rolling back to the interval cut instead is what used to happen: shards come back)
    assert srv.checkpoints.rollback_to(mid)
