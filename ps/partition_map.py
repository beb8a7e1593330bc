"""The versioned partition map: which PS shard owns each virtual shard.

Ids route in two steps, both fixed-cost and vectorized::

    id --mix64(id) % V--> vshard --owners[vshard]--> shard
                                       |
     owners: int32 [V]   e.g. V=8, 3 shards, version 0:  [0 1 2 0 1 2 0 1]
     after moving vshard 3 to shard 2, version 1:        [0 1 2 2 1 2 0 1]

``V`` (``num_vshards``) is fixed for a job; moving load means reassigning
vshards, and every change bumps ``version``. A shard refuses data requests
routed with another version (``wrong_owner``), so a client with an old map
never writes to a shard that gave the rows away.

Example::

    pmap = PartitionMap.initial(num_shards=3, num_vshards=256)
    shard_of_each_id = pmap.shard_of(ids)
    moved = pmap.moved({3: 2})            # version + 1
"""

from __future__ import annotations

import zlib
from typing import Any
from dataclasses import dataclass, field

import numpy as np

from common.hashing import vshard_of
from protos import ps_pb2


@dataclass(frozen=True)
class PartitionMap:
    """Immutable vshard -> shard assignment with a version.

    Args:
        version: bumped by every change; data requests must carry it.
        num_shards: number of PS shards (shard ids are 0..num_shards-1).
        owners: int32 [num_vshards], owners[v] is the shard that owns vshard v.
    """

    version: int
    num_shards: int
    owners: np.ndarray = field(repr=False)

    def __post_init__(self) -> None:
        owners = np.asarray(self.owners, dtype=np.int32)
        owners.setflags(write=False)
        object.__setattr__(self, "owners", owners)
        self.validate()
        first = int(owners[0])
        # derived once (the map is immutable): the data plane's no-hashing fast paths read it
        object.__setattr__(self, "_sole_owner", first if bool((owners == first).all()) else None)

    @property
    def sole_owner(self) -> int | None:
        """The shard that owns every vshard (e.g. a 1-shard PS), or None when they are spread."""
        owner: int | None = self.__dict__["_sole_owner"]
        return owner

    def validate(self) -> None:
        if self.version < 0:
            raise ValueError(f"partition map version must be >= 0, got {self.version}")
        if self.num_shards < 1:
            raise ValueError(f"partition map needs >= 1 shard, got {self.num_shards}")
        if self.owners.ndim != 1 or self.owners.size < 1:
            raise ValueError(f"partition map owners must be a non-empty 1-D array, got shape {self.owners.shape}")
        if self.owners.size < self.num_shards:
            raise ValueError(f"num_vshards ({self.owners.size}) must be >= num_shards ({self.num_shards})")
        bad = np.nonzero((self.owners < 0) | (self.owners >= self.num_shards))[0]
        if bad.size:
            v = int(bad[0])
            raise ValueError(
                f"partition map: vshard {v} owned by shard {int(self.owners[v])}, expected 0..{self.num_shards - 1}"
            )

    @property
    def num_vshards(self) -> int:
        return int(self.owners.size)

    @classmethod
    def initial(cls, num_shards: int, num_vshards: int) -> "PartitionMap":
        """Version 0: vshard v belongs to shard ``v % num_shards``."""
        return cls(0, num_shards, np.arange(num_vshards, dtype=np.int32) % num_shards)

    def vshards_of(self, shard: int) -> np.ndarray:
        """The vshards that ``shard`` owns (int64, sorted)."""
        return np.nonzero(self.owners == shard)[0].astype(np.int64)

    def shard_of(self, ids: np.ndarray) -> np.ndarray:
        """Owning shard of each int64 id (int32 [n])."""
        shards: np.ndarray = self.owners[vshard_of(ids, self.num_vshards)]
        return shards

    def owned_mask(self, shard: int) -> np.ndarray:
        """bool [V]: which vshards ``shard`` owns."""
        mask: np.ndarray = self.owners == shard
        return mask

    def moved(self, moves: dict[int, int]) -> "PartitionMap":
        """A new map (version + 1) with ``moves`` (vshard -> new shard) applied."""
        owners = self.owners.copy()
        for v, s in moves.items():
            if not 0 <= v < self.num_vshards:
                raise ValueError(f"vshard {v} out of range 0..{self.num_vshards - 1}")
            owners[v] = s
        return PartitionMap(self.version + 1, self.num_shards, owners)

    def same_assignment(self, other: "PartitionMap") -> bool:
        return self.num_shards == other.num_shards and np.array_equal(self.owners, other.owners)

    # -- wire ---------------------------------------------------------------------
    def to_proto(self) -> ps_pb2.PartitionMap:
        return ps_pb2.PartitionMap(
            version=self.version, num_vshards=self.num_vshards, num_shards=self.num_shards, owners=self.owners.tolist()
        )

    @classmethod
    def from_proto(cls, msg: ps_pb2.PartitionMap) -> "PartitionMap":
        owners = np.asarray(msg.owners, dtype=np.int32)
        if owners.size != msg.num_vshards:
            raise ValueError(f"partition map has {owners.size} owners, expected num_vshards={msg.num_vshards}")
        return cls(int(msg.version), int(msg.num_shards), owners)

    def to_dict(self) -> dict[str, Any]:
        return {"version": self.version, "num_shards": self.num_shards, "owners": self.owners.tolist()}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "PartitionMap":
        return cls(int(d["version"]), int(d["num_shards"]), np.asarray(d["owners"], dtype=np.int32))


def dense_owner(name: str, num_shards: int) -> int:
    """The shard that holds dense parameter ``name``: a stable hash of the name.

    Dense parameters do not move with vshards; after a restore onto another
    shard count each shard loads the names it owns under the new count.
    """
    return zlib.crc32(name.encode()) % num_shards
