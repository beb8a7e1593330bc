"""train-local trains on a one-worker fleet's batch order (issue 29: fleet vs local parity).

The fleet's DDS leases shuffled shards (:func:`common.shard_order.shard_order`);
train-local (a Worker without a controller, world 1) reads the same shards in the same
order. Judged on the batches themselves: the task keys of every batch train-local's
training loop reads, over two epochs, equal those of every shard a real DDS (LMDB state,
``[controller.dds]`` of the same job) leases to its only worker, in lease order. File
order is checked to differ, so the equality is not that of two unshuffled reads.
"""

from __future__ import annotations

from pathlib import Path

import torch

from controller.dds import DynamicDataSharding
from controller.state import StateStore
from controller.types import DatasetKind, DatasetSpec, GetStatus
from meta_io.batch import MetaBatch
from workers.local import local_store
from workers.row_source import LocalRowSource
from workers.worker import Worker

from tests.workers.conftest import make_job


def _keys(worker: Worker, ranges: list[tuple[int, int, int]]) -> torch.Tensor:
    """The task keys of every batch of ``ranges``, in order (a meta dataset: every batch has them)."""
    batches = [b for f, a, z in ranges for b in worker.dataset.read_range(f, a, z)]
    assert all(isinstance(b, MetaBatch) for b in batches)
    return torch.cat([b.task_keys for b in batches if isinstance(b, MetaBatch)])


def test_train_local_reads_a_one_worker_fleets_lease_order(worker_data, tmp_path: Path) -> None:
    job = make_job(worker_data["meta"], tmp_path, train={"epochs": 2},
                   controller={"dds": {"batches_per_shard": 3, "seed": 7}})
    local = Worker(job, 0, LocalRowSource(local_store(job)), controller=None, run_dir=tmp_path / "local", world=1)
    local_ranges = [(r.file, r.start, r.stop) for r, _ in local._ranges()]  # what Worker.train iterates

    dds = DynamicDataSharding(StateStore(tmp_path / "state"), job.controller.dds,
                              [DatasetSpec.from_meta_io("train", job.data.train, DatasetKind.TRAIN, epochs=2)])
    leased = []
    while (got := dds.get_shard(0, "train")).status is GetStatus.SHARD:
        assert got.lease is not None
        leased.append((got.lease.file, got.lease.start, got.lease.stop))
        dds.report(0, got.lease.shard_id, got.lease.attempt, "done", samples=1)
    assert got.status is GetStatus.DONE

    ds = local.dataset
    file_order = [(f, 0, ds.num_batches(f)) for f in range(ds.num_files)] * 2
    assert torch.equal(_keys(local, local_ranges), _keys(local, leased))
    assert not torch.equal(_keys(local, local_ranges), _keys(local, file_order))


def test_validation_training_reads_the_fleet_order_without_the_held_batches(worker_data, tmp_path: Path) -> None:
    """train-local with ``val_fraction``: each epoch trains the DDS's one-worker order, the held-out batches removed."""
    from workers.hygiene import training_plan, validation_split

    job = make_job(worker_data["meta"], tmp_path, train={"epochs": 2, "val_fraction": 0.2},
                   controller={"dds": {"batches_per_shard": 3, "seed": 7}})
    local = Worker(job, 0, LocalRowSource(local_store(job)), controller=None, run_dir=tmp_path / "local", world=1)
    ds = local.dataset
    files = {i: int(ds.num_batches(i)) for i in range(ds.num_files)}
    held = validation_split(ds, 0.2, job.train.seed)
    assert sum(h.size for h in held.values()) > 0
    dds = DynamicDataSharding(StateStore(tmp_path / "state"), job.controller.dds,
                              [DatasetSpec.from_meta_io("train", job.data.train, DatasetKind.TRAIN, epochs=2)])
    leased: dict[int, list[tuple[int, int]]] = {0: [], 1: []}
    while (got := dds.get_shard(0, "train")).status is GetStatus.SHARD:
        assert got.lease is not None
        leased[got.lease.epoch].extend((got.lease.file, b) for b in range(got.lease.start, got.lease.stop))
        dds.report(0, got.lease.shard_id, got.lease.attempt, "done", samples=1)
    for epoch in range(2):
        want = [(f, b) for f, b in leased[epoch] if b not in set(held[f].tolist())]
        plan = training_plan(files, held, job.controller.dds, epoch)
        assert [(f, b) for f, a, z in plan for b in range(a, z)] == want, epoch
