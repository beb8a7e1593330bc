"""The shard order train-local reads is the one a one-worker fleet is leased.

:func:`common.shard_order.shard_order` is the DDS's epoch shuffle, moved to the ground
floor so train-local can read the same order without importing the controller. A real DDS
(LMDB state in a temp dir) is drained by one worker, epoch after epoch; its lease sequence
must equal ``shard_order`` for each epoch, concatenated. The order must also be a real
shuffle (not file order, different per epoch), so an identity "order" cannot pass.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from controller.config import DdsConfig
from controller.dds import DynamicDataSharding
from controller.state import StateStore
from controller.types import DatasetKind, DatasetSpec, GetStatus
from common.errors import ConfigError, MetapsError
from common.shard_order import shard_order

FILES = (10, 7, 3)
BPS, SEED, EPOCHS = 3, 5, 3


def _leases(tmp: Path) -> list[tuple[int, int, int, int]]:
    """(epoch, file, start, stop) of every lease a lone worker 0 gets, in order, until DONE."""
    dds = DynamicDataSharding(StateStore(tmp / "state"), DdsConfig(batches_per_shard=BPS, seed=SEED),
                              [DatasetSpec("train", FILES, DatasetKind.TRAIN, epochs=EPOCHS)])
    out: list[tuple[int, int, int, int]] = []
    for _ in range(1000):
        got = dds.get_shard(0, "train")
        if got.status is GetStatus.DONE:
            return out
        assert got.status is GetStatus.SHARD and got.lease is not None, got
        lease = got.lease
        out.append((lease.epoch, lease.file, lease.start, lease.stop))
        dds.report(0, lease.shard_id, lease.attempt, "done", samples=1)
    raise AssertionError("the DDS never answered DONE")


def test_one_worker_fleet_is_leased_in_shard_order(tmp_path: Path) -> None:
    leased = _leases(tmp_path)
    want = [(e, *s) for e in range(EPOCHS) for s in shard_order(FILES, BPS, SEED, e, "train")]
    assert leased == want
    # a real shuffle: every batch once per epoch, not file order, not the same order twice
    per_epoch = [[s[1:] for s in leased if s[0] == e] for e in range(EPOCHS)]
    for order in per_epoch:
        assert sorted((f, b) for f, a, z in order for b in range(a, z)) == [
            (f, b) for f, n in enumerate(FILES) for b in range(n)]
        assert order != sorted(order)
    assert per_epoch[0] != per_epoch[1] != per_epoch[2]


def test_shard_order_depends_on_seed_and_dataset_only_as_documented() -> None:
    a = shard_order(FILES, BPS, SEED, 0)
    assert a == shard_order(list(FILES), BPS, SEED, 0, "train")  # the default dataset is the fleet's "train"
    assert a != shard_order(FILES, BPS, SEED + 1, 0)
    assert a != shard_order(FILES, BPS, SEED, 0, "eval")
    assert shard_order((), BPS, SEED, 0) == []


@pytest.mark.parametrize("files,bps", [((4,), 0), ((4, -1), 2)])
def test_bad_sizes_are_one_line_config_errors(files: tuple[int, ...], bps: int) -> None:
    with pytest.raises(ConfigError) as e:
        shard_order(files, bps, 0, 0)
    assert isinstance(e.value, MetapsError) and "\n" not in str(e.value)
