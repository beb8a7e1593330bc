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
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping, Sequence

import grpc

from common.errors import MetapsError
from common.log import kv
from common.rpc import RpcConfig, make_channel
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
        digests: shard -> table -> ``{"rows", "sha256"}``: what each shard restored here serves
            once its restore returned (its Restore reply, read from its live store: ``ps.digest``);
            shards in ``skip`` are not in it.
    """

    dir: str
    rows: int
    map_version: int
    healed: list[int] = field(default_factory=list)
    rejected: list[dict[str, str]] = field(default_factory=list)
    digests: dict[int, dict[str, dict[str, Any]]] = field(default_factory=dict)


def restore_fleet(addresses: Sequence[str], rpc_cfg: RpcConfig, ckpt_dirs: str | Sequence[str], *,
                  pause_lease_s: float = 120.0,
                  while_paused: Callable[[str], None] | None = None,
                  on_step: Callable[[str, dict[str, Any]], None] | None = None,
                  skip: Mapping[str, Sequence[int]] | None = None,
                  renew_s: float = 0.0) -> FleetRestore:
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
        on_step: called before each step acts (``pause`` {shards}, ``restore`` {dir, shard},
            ``resume`` {shards}), after each shard's restore (``restored`` {dir, shard, rows, digest}:
            rows as the shard replied, digest what it serves now, table -> ``{"rows", "sha256"}``) and
            after each pause renewal (``renewed`` {lease_s}): the controller records its progress
            durably there (an exception aborts the restore; the pause ends with its lease).
        skip: directory -> shards already restored to it by an earlier, interrupted restore
            (still paused since): not restored again; counted as 0 rows.
        renew_s: > 0: renew the pause every ``renew_s`` while the restore runs, so a short lease
            bounds the pause by the caller's life (a dead controller's pause ends by itself).

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
    step = on_step or (lambda what, detail: None)
    done = threading.Event()
    renewer: threading.Thread | None = None
    try:
        try:
            step("pause", {"shards": len(stubs), "lease_s": pause_lease_s})
            for k, s in enumerate(stubs):
                s.PauseWrites(ps_pb2.PauseRequest(paused=True, lease_s=pause_lease_s), timeout=timeout)
                paused.append(k)
            if renew_s > 0:
                renewer = threading.Thread(target=_renew_pause, args=(stubs, pause_lease_s, renew_s, timeout, done,
                                                                      step),
                                           name="pause-renew", daemon=True)
                renewer.start()
            maps = [PartitionMap.from_proto(s.GetPartitionMap(ps_pb2.GetPartitionMapRequest(), timeout=timeout))
                    for s in stubs]
            newest = max(maps, key=lambda m: m.version)
            healed = [k for k, m in enumerate(maps) if m.version < newest.version]
            for k in healed:
                stubs[k].UpdatePartitionMap(newest.to_proto(), timeout=timeout)
            for ckpt_dir in dirs:
                rows = 0
                k = 0
                digests: dict[int, dict[str, dict[str, Any]]] = {}
                already = set((skip or {}).get(ckpt_dir, ()))
                try:
                    for k, s in enumerate(stubs):
                        if k in already:
                            continue
                        step("restore", {"dir": ckpt_dir, "shard": k})
                        reply = s.Restore(ps_pb2.RestoreRequest(dir=ckpt_dir), timeout=timeout * 10)
                        n = int(reply.rows)
                        rows += n
                        served = {d.table: {"rows": int(d.rows), "sha256": d.sha256} for d in reply.served}
                        digests[k] = served
                        step("restored", {"dir": ckpt_dir, "shard": k, "rows": n, "digest": served})
                except grpc.RpcError as exc:
                    if exc.code() not in (grpc.StatusCode.DATA_LOSS, grpc.StatusCode.NOT_FOUND):
                        raise  # corrupt or vanished cuts fall back to the previous one; anything else fails
                    log.error("a shard refused the checkpoint; trying the previous one",
                              extra=kv(shard=k, dir=ckpt_dir, error=(exc.details() or "")[:300]))
                    rejected.append({"dir": ckpt_dir, "shard": str(k), "error": exc.details() or ""})
                    continue
                if while_paused is not None:
                    while_paused(ckpt_dir)
                return FleetRestore(ckpt_dir, rows, int(newest.version), healed, rejected, digests)
        except grpc.RpcError as exc:
            raise FleetRestoreError(f"restoring the PS fleet {list(addresses)} failed: "
                                    f"{exc.code().name}: {exc.details()}") from None
        why = "; ".join(f"{r['dir']}: {r['error']}" for r in rejected)
        raise CheckpointRefused(f"no committed checkpoint could be restored ({len(rejected)} refused): {why}")
    finally:
        done.set()
        if renewer is not None:
            renewer.join(timeout * 2)
        if paused:
            try:
                step("resume", {"shards": len(paused)})
            except Exception:  # the shards are resumed regardless
                log.exception("resume step hook failed")
        for k in paused:
            try:
                stubs[k].PauseWrites(ps_pb2.PauseRequest(paused=False), timeout=timeout)
            except grpc.RpcError as exc:  # the pause lease ends it anyway
                log.warning("could not resume a shard after recovery", extra=kv(shard=k, error=exc.details()))
        for c in channels:
            c.close()


def _renew_pause(stubs: Sequence[ps_pb2_grpc.ParameterServerStub], lease_s: float, every_s: float, timeout: float,
                 done: threading.Event, step: Callable[[str, dict[str, Any]], None]) -> None:
    """Renew the pause on every shard every ``every_s`` until ``done`` (a lapsed renewal is logged)."""
    while not done.wait(every_s):
        try:
            for s in stubs:
                s.PauseWrites(ps_pb2.PauseRequest(paused=True, lease_s=lease_s), timeout=timeout)
            step("renewed", {"lease_s": lease_s})
        except Exception as exc:  # the restore's own calls report a dead shard
            log.warning("pause renewal failed", extra=kv(error=str(exc)[:200]))


def resume_fleet(addresses: Sequence[str], rpc_cfg: RpcConfig) -> None:
    """End a write pause on every shard (a restore interrupted after its data were restored).

    Raises:
        FleetRestoreError: a shard could not be reached (its pause ends with its lease anyway).
    """
    for a in addresses:
        ch = make_channel(a, rpc_cfg)
        try:
            ps_pb2_grpc.ParameterServerStub(ch).PauseWrites(ps_pb2.PauseRequest(paused=False),
                                                            timeout=rpc_cfg.timeout_s)
        except grpc.RpcError as exc:
            raise FleetRestoreError(f"resuming PS shard {a} failed: {exc.code().name}: {exc.details()}") from None
        finally:
            ch.close()


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
                while_paused: Callable[[str], None] | None = None,
                on_step: Callable[[str, dict[str, Any]], None] | None = None,
                skip: Mapping[str, Sequence[int]] | None = None, renew_s: float = 0.0) -> FleetRestore:
        """:func:`restore_fleet` with this fleet's RPC settings.

        Args:
            addresses: every shard's address.
            ckpt_dirs: committed checkpoint directories, preferred first.
            pause_lease_s: the write pause ends by itself after this long.
            while_paused: called with the restored directory before the shards resume.
            on_step, skip, renew_s: see :func:`restore_fleet`.
        """
        return restore_fleet(addresses, self.rpc_cfg, ckpt_dirs, pause_lease_s=pause_lease_s,
                             while_paused=while_paused, on_step=on_step, skip=skip, renew_s=renew_s)

    def resume(self, addresses: Sequence[str]) -> None:
        """:func:`resume_fleet` with this fleet's RPC settings."""
        resume_fleet(addresses, self.rpc_cfg)


__all__ = ["CheckpointRefused", "FleetRestore", "FleetRestoreError", "GrpcPsFleet", "restore_fleet", "resume_fleet"]
