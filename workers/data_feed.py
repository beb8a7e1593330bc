"""Which record-batch ranges a worker trains on.

A *data shard* is a range ``[start, stop)`` of record batches of one Meta-IO
file. Without a controller, worker ``r`` of ``w`` takes a static contiguous
slice of every file; with one, the controller's DDS leases shards one at a
time (fast workers simply come back for more).

    file 0: |b0 b1 b2 b3 b4 b5 b6 b7|    static, 2 workers:
             ^-- worker 0 --^^-- 1 --^   worker 0: [0,4), worker 1: [4,8) of every file
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class BatchRange:
    file: int
    start: int
    stop: int

    @property
    def batches(self) -> int:
        return self.stop - self.start


def static_ranges(dataset: Any, rank: int, world: int) -> list[BatchRange]:
    """Worker ``rank``'s fixed share: a contiguous slice of each file.

    Args:
        dataset: a ``meta_io.reader.MetaIODataset`` (``num_files``, ``num_batches(f)``).
        rank: this worker, ``0 <= rank < world``.
        world: the number of workers.
    """
    if not 0 <= rank < world:
        raise ValueError(f"rank must be in [0, {world}), got {rank}")
    out = []
    for f in range(dataset.num_files):
        n = dataset.num_batches(f)
        start, stop = n * rank // world, n * (rank + 1) // world
        if stop > start:
            out.append(BatchRange(f, start, stop))
    return out
