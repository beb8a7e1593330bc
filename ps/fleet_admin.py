"""PS fleet administration over gRPC: the operations a controller drives on the whole fleet.

Read who owns which vshard, move vshards (``ps.migration``), check every shard answers,
and restore the fleet from a checkpoint cut under one write pause. :class:`GrpcPsFleet`
bundles them; it satisfies the controller's ``PsFleet`` port (``controller/ports.py``)
structurally: this module imports nothing of ``controller`` (the app floor wires one into
the other), and its arguments and results are plain values or dataclasses defined here.

Restore, in order::

    PauseWrites(lease) on every shard         (drain in-flight requests, hold new ones)
    newest partition map -> every shard that lags   (migrations after the cut are kept:
                                                      a checkpoint restores onto any map)
    for each directory, preferred first:
        Restore(dir) on every shard           (all or nothing per shard: a corrupt
                                               checkpoint is refused with DATA_LOSS and
                                               leaves the shard as it was)
        refused -> try the next directory on EVERY shard (the fleet ends at one cut)
    while_paused(dir)                          (the controller rolls its data ledger back)
    PauseWrites(false) on every shard

Example::

    fleet = GrpcPsFleet(rpc_cfg)
    fleet.unreachable(addresses)                              # '' when every shard answers
    fleet.migrate_vshards(addresses, fleet.vshards_of(addresses, 1)[:4], dst=0, freeze_lease_s=120)
    out = fleet.restore(addresses, ["/ckpt/cut-7", "/ckpt/cut-6"], pause_lease_s=120, while_paused=None)
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import Callable, Sequence

import grpc

from metaps.core.errors import MetapsError
from metaps.core.log import kv
from metaps.core.rpc import RpcConfig, make_channel
from protos import ps_pb2, ps_pb2_grpc
from ps.migration import MigrationReport, migrate_vshards
from ps.partition_map import PartitionMap

log = logging.getLogger(__name__)


class FleetRestoreError(MetapsError):
    """The fleet could not be restored (a shard unreachable or failing); the message names it."""


class CheckpointRefused(FleetRestoreError):
    """Every checkpoint directory was refused by a shard as corrupt, incomplete or missing (DATA_LOSS, NOT_FOUND)."""


@dataclass(frozen=True)
class FleetRestore:
    """What :func:`restore_fleet` did.

    Args:
        dir: the directory every shard now holds.
        rows: rows loaded over every shard.
        map_version: the partition map version every shard has.
        healed: shards whose map lagged and were updated.
        rejected: ``{"dir", "shard", "error"}`` for each directory refused before ``dir``.
    """

    dir: str
    rows: int
    map_version: int
    healed: list[int] = field(default_factory=list)
    rejected: list[dict[str, str]] = field(default_factory=list)


def restore_fleet(addresses: Sequence[str], rpc_cfg: RpcConfig, ckpt_dirs: str | Sequence[str], *,
                  pause_lease_s: float = 120.0,
                  while_paused: Callable[[str], None] | None = None) -> FleetRestore:
    """Restore every shard from the first of ``ckpt_dirs`` that every shard accepts, under one pause.

    A shard refuses a corrupt or incomplete checkpoint with DATA_LOSS and is left
    unchanged (the PS restore is all or nothing); the next directory is then tried
    on *every* shard, so the fleet always ends at one cut. ``while_paused(dir)``
    runs once, for the directory restored, before the shards resume.

    Args:
        addresses: every shard's address, in shard-id order.
        rpc_cfg: token/TLS/limits for the admin calls.
        ckpt_dirs: one directory, or several, preferred first.
        pause_lease_s: the write pause ends by itself after this long.
        while_paused: called with the restored directory before the shards resume.

    Raises:
        CheckpointRefused: every directory was refused (the message names each and why).
        FleetRestoreError: a shard unreachable or failing otherwise.
    """
    dirs = [ckpt_dirs] if isinstance(ckpt_dirs, str) else list(ckpt_dirs)
    if not dirs:
        raise CheckpointRefused("no checkpoint directory to restore from")
    channels = [make_channel(a, rpc_cfg) for a in addresses]
    stubs = [ps_pb2_grpc.ParameterServerStub(c) for c in channels]
    timeout = rpc_cfg.timeout_s
    paused: list[int] = []
    rejected: list[dict[str, str]] = []
    try:
        try:
            for k, s in enumerate(stubs):
                s.PauseWrites(ps_pb2.PauseRequest(paused=True, lease_s=pause_lease_s), timeout=timeout)
                paused.append(k)
            maps = [PartitionMap.from_proto(s.GetPartitionMap(ps_pb2.GetPartitionMapRequest(), timeout=timeout))
                    for s in stubs]
            newest = max(maps, key=lambda m: m.version)
            healed = [k for k, m in enumerate(maps) if m.version < newest.version]
            for k in healed:
                stubs[k].UpdatePartitionMap(newest.to_proto(), timeout=timeout)
            for ckpt_dir in dirs:
                rows = 0
                k = 0
                try:
                    for k, s in enumerate(stubs):
                        rows += int(s.Restore(ps_pb2.RestoreRequest(dir=ckpt_dir), timeout=timeout * 10).rows)
                except grpc.RpcError as exc:
                    if exc.code() not in (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.NOT_FOUND):
                        raise  # corrupt or vanished cuts fall back to the previous one; anything else fails
                    log.error("a shard refused the checkpoint; trying the previous one",
                              extra=kv(shard=k, dir=ckpt_dir, error=(exc.details() or "")[:300]))
                    rejected.append({"dir": ckpt_dir, "shard": str(k), "error": exc.details() or ""})
                    continue
                if while_paused is not None:
                    while_paused(ckpt_dir)
                return FleetRestore(ckpt_dir, rows, int(newest.version), healed, rejected)
        except grpc.RpcError as exc:
            raise FleetRestoreError(f"restoring the PS fleet {list(addresses)} failed: "
                                    f"{exc.code().name}: {exc.details()}") from None
        why = "; ".join(f"{r['dir']}: {r['error']}" for r in rejected)
        raise CheckpointRefused(f"no committed checkpoint could be restored ({len(rejected)} refused): {why}")
    finally:
        for k in paused:
            try:
                stubs[k].PauseWrites(ps_pb2.PauseRequest(paused=False), timeout=timeout)
            except grpc.RpcError as exc:  # the pause lease ends it anyway
                log.warning("could not resume a shard after recovery", extra=kv(shard=k, error=exc.details()))
        for c in channels:
            c.close()


class GrpcPsFleet:
    """The controller's ``PsFleet`` port over gRPC (see the module docstring).

    Args:
        rpc_cfg: the job's RPC settings (token, TLS, timeouts).
    """

    def __init__(self, rpc_cfg: RpcConfig) -> None:
        self.rpc_cfg = rpc_cfg

    def unreachable(self, addresses: Sequence[str]) -> str:
        """'' when every shard answers GetPartitionMap, else the first failure (``address: CODE``).

        Args:
            addresses: every shard's address.
        """
        for a in addresses:
            ch = make_channel(a, self.rpc_cfg)
            try:
                ps_pb2_grpc.ParameterServerStub(ch).GetPartitionMap(ps_pb2.GetPartitionMapRequest(),
                                                                    timeout=min(2.0, self.rpc_cfg.timeout_s))
            except grpc.RpcError as exc:
                return f"{a}: {exc.code().name}"
            finally:
                ch.close()
        return ""

    def vshards_of(self, addresses: Sequence[str], ps: int) -> list[int]:
        """The vshards shard ``ps`` owns in the newest partition map any shard holds.

        Args:
            addresses: every shard's address.
            ps: the shard id.
        """
        maps = []
        for addr in addresses:
            ch = make_channel(addr, self.rpc_cfg)
            try:
                stub = ps_pb2_grpc.ParameterServerStub(ch)
                maps.append(PartitionMap.from_proto(
                    stub.GetPartitionMap(ps_pb2.GetPartitionMapRequest(), timeout=self.rpc_cfg.timeout_s)))
            finally:
                ch.close()
        pmap = max(maps, key=lambda m: m.version)
        return [int(v) for v in pmap.vshards_of(ps)]

    def migrate_vshards(self, addresses: Sequence[str], vshards: Sequence[int], dst: int, *,
                        freeze_lease_s: float) -> MigrationReport:
        """Move ``vshards`` to shard ``dst`` (``ps.migration.migrate_vshards``: no update lost).

        Args:
            addresses: every shard's address.
            vshards: the vshards to move.
            dst: the receiving shard id.
            freeze_lease_s: a freeze ends by itself after this long.
        """
        return migrate_vshards(list(addresses), self.rpc_cfg, vshards, dst, freeze_lease_s=freeze_lease_s)

    def restore(self, addresses: Sequence[str], ckpt_dirs: Sequence[str], *, pause_lease_s: float = 120.0,
                while_paused: Callable[[str], None] | None = None) -> FleetRestore:
        """:func:`restore_fleet` with this fleet's RPC settings.

        Args:
            addresses: every shard's address.
            ckpt_dirs: committed checkpoint directories, preferred first.
            pause_lease_s: the write pause ends by itself after this long.
            while_paused: called with the restored directory before the shards resume.
        """
        return restore_fleet(addresses, self.rpc_cfg, ckpt_dirs, pause_lease_s=pause_lease_s,
                             while_paused=while_paused)


__all__ = ["CheckpointRefused", "FleetRestore", "FleetRestoreError", "GrpcPsFleet", "restore_fleet"]
