"""The controller's vocabulary: the values clients, DDS, ledger, servicer and workers exchange.

Only value types and their validation live here -- no engine: no LMDB, no ledger, no
state store, no gRPC. A worker or a client imports this module, not ``controller.dds``
(the engine), so it pulls in nothing it does not use::

    DatasetSpec, DatasetKind                       what a dataset is (dds, ledger, cli)
    ShardLease, GetResult/GetStatus                what GetShard hands out (dds -> servicer -> client -> worker)
    ReportResult/ReportStatus                      what a shard report does
    DdsCut                                         the DDS position at a checkpoint cut
    Command                                        what a heartbeat reply carries to a node
    DdsError (UnknownDataset, UnknownShard, StateMismatch), UnknownNode, BadNode
                                                   deliberate errors; ``code`` maps to a gRPC status

Example::

    spec = DatasetSpec("train", (10, 7), DatasetKind.TRAIN, epochs=2)
    spec.validate()
    parse_shard_id("train:0:1:4-8")   # ("train", 0, 1, 4, 8)
"""

from __future__ import annotations

import enum
import re
from dataclasses import dataclass
from typing import Any

from common.errors import MetapsError

_NAME_RE = re.compile(r"^[A-Za-z0-9_.\-]+$")
_ID_RE = re.compile(r"^(?P<ds>[A-Za-z0-9_.\-]+):(?P<epoch>\d+):(?P<file>\d+):(?P<start>\d+)-(?P<stop>\d+)$")

ROLES = ("worker", "ps")
NODE_FINISHED = "finished"
"""``NodeDown`` reason (exit code 0) of a worker process that finished its part of the run."""
FINAL_CUT = 0
"""``CheckpointDone`` cut id of the run's final checkpoint (cut ids the controller opens start at 1):
the controller records it as a committed cut of the finished run (controller/checkpoint.py)."""

NODE_CHECKPOINT_FAILED = "final_checkpoint_failed"
"""``NodeDown`` reason prefix (``final_checkpoint_failed: <why>``, exit code 4) of the checkpoint
leader whose final checkpoint could not be written (a full disk, an I/O error): training
finished, the run fails once (``RunOutcome.final_checkpoint_failed``), nothing restarts it."""
SOURCES = ("process", "agent")


class DdsError(MetapsError):
    """A DDS request is invalid. ``code`` maps to a gRPC status in the servicer."""

    code = "invalid_argument"


class UnknownDataset(DdsError):
    code = "not_found"


class UnknownShard(DdsError):
    code = "not_found"


class StateMismatch(DdsError):
    """The state directory was written for different datasets than the job's."""

    code = "failed_precondition"


class DatasetKind(str, enum.Enum):
    TRAIN = "train"
    EVAL = "eval"



class GetStatus(str, enum.Enum):
    SHARD = "shard"
    WAIT = "wait"
    DONE = "done"


class ReportStatus(str, enum.Enum):
    DONE = "done"
    FAILED = "failed"


@dataclass(frozen=True)
class DatasetSpec:
    """What the DDS needs to know about a dataset.

    Args:
        name: unique name (letters, digits, ``_.-``).
        batches_per_file: record batches in each file, by file index.
        kind: ``train`` or ``eval``.
        epochs: passes over the dataset.

    Example::

        DatasetSpec("train", [128, 128, 64], DatasetKind.TRAIN, epochs=2)
    """

    name: str
    batches_per_file: tuple[int, ...]
    kind: DatasetKind = DatasetKind.TRAIN
    epochs: int = 1

    def __post_init__(self) -> None:
        object.__setattr__(self, "batches_per_file", tuple(int(b) for b in self.batches_per_file))
        object.__setattr__(self, "kind", DatasetKind(self.kind))

    def validate(self) -> None:
        if not _NAME_RE.match(self.name):
            raise ValueError(f"dataset name must match [A-Za-z0-9_.-]+, got {self.name!r}")
        if not self.batches_per_file:
            raise ValueError(f"dataset {self.name}: no files")
        bad = [(i, b) for i, b in enumerate(self.batches_per_file) if b < 0]
        if bad:
            raise ValueError(f"dataset {self.name}: file {bad[0][0]} has {bad[0][1]} batches (must be >= 0)")
        if self.total_batches == 0:
            raise ValueError(f"dataset {self.name}: all {len(self.batches_per_file)} files are empty")
        if self.epochs < 1:
            raise ValueError(f"dataset {self.name}: epochs must be >= 1, got {self.epochs}")

    @property
    def total_batches(self) -> int:
        return sum(self.batches_per_file)

    def to_json(self) -> dict[str, Any]:
        return {"name": self.name, "batches_per_file": list(self.batches_per_file),
                "kind": self.kind.value, "epochs": self.epochs}

    @staticmethod
    def from_json(d: dict[str, Any]) -> "DatasetSpec":
        return DatasetSpec(d["name"], tuple(d["batches_per_file"]), DatasetKind(d["kind"]), int(d["epochs"]))

    @staticmethod
    def from_meta_io(name: str, path: str, kind: DatasetKind | str = DatasetKind.TRAIN, epochs: int = 1) -> "DatasetSpec":
        """Read the batch counts from a Meta-IO dataset's index.

        Example::

            DatasetSpec.from_meta_io("train", "data/train", "train", epochs=2)
        """
        from meta_io.reader import MetaIODataset  # only when a real dataset is used

        ds = MetaIODataset(path)
        spec = DatasetSpec(name, tuple(ds.num_batches(f) for f in range(ds.num_files)), DatasetKind(kind), epochs)
        spec.validate()
        return spec


@dataclass(frozen=True)
class ShardLease:
    """A shard handed to a worker. Report it back with ``shard_id`` and ``attempt``."""

    shard_id: str
    dataset: str
    epoch: int
    file: int
    start: int
    stop: int
    attempt: int
    lease_s: float

    @property
    def batches(self) -> int:
        return self.stop - self.start


@dataclass(frozen=True)
class GetResult:
    status: GetStatus
    lease: ShardLease | None = None


@dataclass(frozen=True)
class ReportResult:
    """Outcome of a report.

    Attributes:
        accepted: the report changed the shard's state (done, or requeued on failure).
        duplicate: the shard was already done (a retried report, or another attempt).
        kind: ``done`` | ``retry`` (same attempt re-sent, no-op) | ``duplicate`` |
            ``stale`` (lease lost) | ``requeued`` (failure).
    """

    accepted: bool
    duplicate: bool
    kind: str
    message: str = ""


@dataclass(frozen=True)
class DdsCut:
    """DDS position at a checkpoint cut: the ledger head and each dataset's epoch."""

    ledger_seq: int
    epochs: dict[str, int]
    time: float

    def to_json(self) -> dict[str, Any]:
        return {"ledger_seq": self.ledger_seq, "epochs": dict(self.epochs), "time": self.time}

    @staticmethod
    def from_json(d: dict[str, Any]) -> "DdsCut":
        return DdsCut(int(d["ledger_seq"]), {k: int(v) for k, v in d["epochs"].items()}, float(d["time"]))



def parse_shard_id(shard_id: str) -> tuple[str, int, int, int, int]:
    """``"train:0:3:16-24"`` -> ``("train", 0, 3, 16, 24)``; DdsError if malformed."""
    m = _ID_RE.match(shard_id or "")
    if not m:
        raise DdsError(f"malformed shard id {shard_id!r}: expected '<dataset>:<epoch>:<file>:<start>-<stop>'")
    return m["ds"], int(m["epoch"]), int(m["file"]), int(m["start"]), int(m["stop"])




class UnknownNode(MetapsError):
    """A node that never registered."""

    code = "not_found"


class BadNode(MetapsError):
    """A node reference with a bad role, index or source."""

    code = "invalid_argument"


@dataclass(frozen=True)
class Command:
    """A command for one node, handed out in its next heartbeat reply.

    Args:
        id: unique per controller run.
        kind: ``restart`` | ``drain`` | ``stop`` (agent) or ``set_batch_size`` | ``checkpoint`` | ``stop`` |
            ``release_clock`` | ``rejoin_clock`` | ``truncate`` (process; leave / rejoin the PS step
            clocks; stop the lease ``shard_id`` before batch ``stop_batch``: the DDS tail split).
        target: ``process`` or ``agent``.
        batch_size: for ``set_batch_size``.
        cut_id: the checkpoint cut (``checkpoint``) or the batch-size plan stamp (``set_batch_size``).
        reason: why, for the logs.
        shard_id, stop_batch: for ``truncate``.
    """

    id: int
    kind: str
    target: str = "process"
    batch_size: int = 0
    cut_id: int = 0
    reason: str = ""
    shard_id: str = ""
    stop_batch: int = 0


def check_node(role: str, index: int, source: str = "process") -> None:
    """BadNode unless ``role:index`` from ``source`` is a valid node reference."""
    if role not in ROLES:
        raise BadNode(f"unknown role {role!r}; expected one of {list(ROLES)}")
    if index < 0:
        raise BadNode(f"{role} index must be >= 0, got {index}")
    if source not in SOURCES:
        raise BadNode(f"unknown source {source!r}; expected one of {list(SOURCES)}")


__all__ = [
    "FINAL_CUT", "BadNode", "Command", "DatasetKind", "DatasetSpec", "DdsCut", "DdsError", "GetResult", "GetStatus",
    "ReportResult", "ReportStatus", "ShardLease", "StateMismatch", "UnknownDataset", "UnknownNode",
    "UnknownShard", "check_node", "parse_shard_id",
]
