"""The data order of an epoch: which record-batch ranges, in which order.

The controller's DDS (:mod:`controller.dds`) cuts each file of a dataset into shards of
``batches_per_shard`` record batches and shuffles the shard list once per epoch, seeded by
the DDS seed, the epoch and the dataset's name::

    files [10, 7], batches_per_shard 4:
        shards  (0,0,4) (0,4,8) (0,8,10) (1,0,4) (1,4,7)
        epoch e: random.Random(seed * 1_000_003 + e * 7919 + crc32(name)).shuffle(shards)

A single worker leases the shuffled list head first, so this list *is* a one-worker
fleet's data order. ``train-local`` (one process, no controller) reads the same list, so
the two train on the same batches in the same order and any quality gap between them is
the fleet's own, not a different shuffle.

This lives on the ground floor because both the controller (the DDS, which must keep its
order) and the workers (train-local) need it, and neither may import the other. It is pure
Python over a handful of tuples per epoch (one per shard, not per row).

Example::

    shard_order([10, 7], 4, seed=0, epoch=0)   # [(1, 4, 7), (0, 0, 4), ...]
"""

from __future__ import annotations

import random
import zlib
from typing import Sequence

from common.errors import ConfigError


def shard_order(batches_per_file: Sequence[int], batches_per_shard: int, seed: int, epoch: int,
                dataset: str = "train") -> list[tuple[int, int, int]]:
    """The DDS's shards of one epoch, ``(file, start, stop)``, in the order they are leased.

    Args:
        batches_per_file: record batches of each file of the dataset (its index order).
        batches_per_shard: shard size in record batches (``[controller.dds] batches_per_shard``).
        seed: the DDS seed (``[controller.dds] seed``).
        epoch: the epoch, 0-based (each epoch has its own shuffle).
        dataset: the DDS dataset name (the fleet's training set is ``"train"``); it seeds the
            shuffle too, so two datasets of one job are not shuffled alike.

    Returns:
        ``(file, start, stop)`` per shard: every batch of every file exactly once.

    Raises:
        ConfigError: ``batches_per_shard < 1`` or a negative batch count (one line).
    """
    if batches_per_shard < 1:
        raise ConfigError(f"controller.dds.batches_per_shard: expected >= 1, got {batches_per_shard}")
    if any(n < 0 for n in batches_per_file):
        raise ConfigError(f"shard_order: batches per file must be >= 0, got {list(batches_per_file)}")
    bps = batches_per_shard
    shards = [(f, s, min(s + bps, n)) for f, n in enumerate(batches_per_file) for s in range(0, n, bps)]
    random.Random(seed * 1_000_003 + epoch * 7919 + zlib.crc32(dataset.encode())).shuffle(shards)
    return shards
