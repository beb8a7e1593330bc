"""Moving vshards (rows, optimizer state, id-map entries) between live PS shards.

The protocol loses no update while workers keep pushing::

    mover            src shard                 dst shard             other shards
      |-- Drop(vs) ---------------------------> (clears leftovers; dst does not own vs)
      |-- Freeze(vs) -> waits for in-flight requests, then refuses vs
      |                 with wrong_owner (clients back off and retry)
      |<- Export(vs) stream (rows + optimizer state, chunked under the message limit)
      |-- Import(chunk) ... ------------------> rows stored, still not owned
      |-- UpdateMap(v+1) ---------------------> owns vs from now on
      |-- UpdateMap(v+1) -> no longer owns vs ------------------------> (all shards)
      |-- Thaw(vs), Drop(vs) -> rows freed

* Every push to a moving vshard is applied either on src before the freeze
  (the freeze drains in-flight requests, so the export sees it) or on dst after
  the map flip; in between it is refused (not applied) and retried by the client.
* A refused request was not applied at all, so its retry never doubles it.
* If anything fails before the map flips, src thaws and dst drops the copy:
  the move is abandoned and nothing changed. A freeze carries a lease, so a
  crashed mover cannot freeze vshards forever.

The freeze lasts one export + import of the moving vshards (a fraction
``k / num_vshards`` of the shard), which is why V is large (e.g. 256).

Example::

    report = migrate_vshards(addresses, rpc_cfg, vshards=[3, 17], dst=2)
    report.rows, report.new_version, report.freeze_s
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Iterable

import grpc
import numpy as np

from common.errors import MetapsError
from common.log import kv
from common.rpc import RpcConfig, make_channel
from ps.partition_map import PartitionMap
from protos import ps_pb2, ps_pb2_grpc

log = logging.getLogger(__name__)


class MigrationError(MetapsError, RuntimeError):
    """A vshard move failed; the message says at which step and whether it was rolled back."""


@dataclass(frozen=True)
class MigrationReport:
    """What a move did.

    Args:
        vshards: the vshards now owned by ``dst``.
        sources: src shard -> vshards it gave away.
        dst: the receiving shard.
        rows: rows moved (all tables).
        bytes: payload bytes shipped.
        freeze_s: how long the moving vshards refused requests.
        new_version: the partition map version after the move.
    """

    vshards: list[int]
    sources: dict[int, list[int]]
    dst: int
    rows: int
    bytes: int
    freeze_s: float
    new_version: int
    per_table_rows: dict[str, int] = field(default_factory=dict)


def _fetch_map(stubs: list[ps_pb2_grpc.ParameterServerStub], timeout: float) -> PartitionMap:
    maps = [PartitionMap.from_proto(s.GetPartitionMap(ps_pb2.GetPartitionMapRequest(), timeout=timeout)) for s in stubs]
    return max(maps, key=lambda m: m.version)


def migrate_vshards(
    addresses: list[str],
    rpc_cfg: RpcConfig,
    vshards: Iterable[int],
    dst: int,
    *,
    freeze_lease_s: float = 120.0,
    chunk_bytes: int = 0,
) -> MigrationReport:
    """Move ``vshards`` to shard ``dst`` while the fleet keeps serving.

    Args:
        addresses: every shard's address, in shard-id order.
        rpc_cfg: token/TLS/limits for the admin calls.
        vshards: vshards to move (those already on ``dst`` are skipped).
        dst: the receiving shard id.
        freeze_lease_s: a freeze ends by itself after this long (crashed mover).
        chunk_bytes: export chunk size (0: half the message limit).

    Raises:
        MigrationError: a step failed (rolled back when it failed before the map flip).
    """
    channels = [make_channel(a, rpc_cfg) for a in addresses]
    stubs = [ps_pb2_grpc.ParameterServerStub(c) for c in channels]
    timeout = rpc_cfg.timeout_s
    try:
        pmap = _fetch_map(stubs, timeout)
        if not 0 <= dst < pmap.num_shards:
            raise MigrationError(f"dst shard {dst} out of range 0..{pmap.num_shards - 1}")
        vs = np.unique(np.asarray(list(vshards), dtype=np.int64))
        if vs.size and (vs.min() < 0 or vs.max() >= pmap.num_vshards):
            raise MigrationError(f"vshards must be in 0..{pmap.num_vshards - 1}, got {vs.tolist()}")
        vs = vs[pmap.owners[vs] != dst]
        sources: dict[int, list[int]] = {}
        for v in vs.tolist():
            sources.setdefault(int(pmap.owners[v]), []).append(int(v))
        if not sources:
            return MigrationReport([], {}, dst, 0, 0, 0.0, pmap.version)
        moving = vs.tolist()
        stubs[dst].DropVshards(ps_pb2.VshardsRequest(vshards=moving), timeout=timeout)

        frozen: list[int] = []
        rows = nbytes = 0
        per_table: dict[str, int] = {}
        t_freeze = time.monotonic()
        flipped = False
        try:
            for src, svs in sources.items():
                stubs[src].FreezeVshards(ps_pb2.FreezeRequest(vshards=svs, frozen=True, lease_s=freeze_lease_s), timeout=timeout)
                frozen.append(src)
            for src, svs in sources.items():
                stream = stubs[src].ExportVshards(ps_pb2.ExportRequest(vshards=svs, max_chunk_bytes=chunk_bytes), timeout=timeout * 10)
                for chunk in stream:
                    stubs[dst].ImportVshards(chunk, timeout=timeout)
                    rows += chunk.rows
                    nbytes += chunk.ByteSize()
                    per_table[chunk.table] = per_table.get(chunk.table, 0) + chunk.rows
            new = pmap.moved({v: dst for v in moving})
            # dst first: from here on the rows are served from dst only.
            stubs[dst].UpdatePartitionMap(new.to_proto(), timeout=timeout)
            flipped = True
            for i, stub in enumerate(stubs):
                if i != dst:
                    _update_map(stub, new, timeout)
        except grpc.RpcError as exc:
            if not flipped:
                _rollback(stubs, frozen, sources, dst, moving, timeout)
                raise MigrationError(
                    f"moving vshards {moving} to shard {dst} failed before the map flip "
                    f"({exc.code().name}: {exc.details()}); rolled back, nothing changed"
                ) from None
            raise MigrationError(
                f"moving vshards {moving} to shard {dst}: map v{pmap.version + 1} is on shard {dst} but not on every shard "
                f"({exc.code().name}: {exc.details()}); clients heal lagging shards on refresh; rerun to finish"
            ) from None
        freeze_s = time.monotonic() - t_freeze
        for src, svs in sources.items():
            stubs[src].FreezeVshards(ps_pb2.FreezeRequest(vshards=svs, frozen=False), timeout=timeout)
            stubs[src].DropVshards(ps_pb2.VshardsRequest(vshards=svs), timeout=timeout)
        log.info(
            "vshards migrated",
            extra=kv(vshards=len(moving), dst=dst, sources=sorted(sources), rows=rows, bytes=nbytes,
                     freeze_s=round(freeze_s, 4), version=new.version),
        )
        return MigrationReport(moving, sources, dst, rows, nbytes, freeze_s, new.version, per_table)
    finally:
        for c in channels:
            c.close()


def _update_map(stub: ps_pb2_grpc.ParameterServerStub, new: PartitionMap, timeout: float) -> None:
    try:
        stub.UpdatePartitionMap(new.to_proto(), timeout=timeout)
    except grpc.RpcError as exc:
        # A client refresh may already have healed this shard with the same map.
        md = dict(exc.trailing_metadata() or ())
        if exc.code() == grpc.StatusCode.FAILED_PRECONDITION and md.get("metaps-map-version", "") == str(new.version):
            return
        raise


def _rollback(stubs: list[ps_pb2_grpc.ParameterServerStub], frozen: list[int], sources: dict[int, list[int]], dst: int, moving: list[int], timeout: float) -> None:
    for src in frozen:
        try:
            stubs[src].FreezeVshards(ps_pb2.FreezeRequest(vshards=sources[src], frozen=False), timeout=timeout)
        except grpc.RpcError as exc:  # the lease thaws it anyway
            log.warning("rollback: thaw failed", extra=kv(shard=src, error=exc.details()))
    try:
        stubs[dst].DropVshards(ps_pb2.VshardsRequest(vshards=moving), timeout=timeout)
    except grpc.RpcError as exc:
        log.warning("rollback: dropping the partial copy failed", extra=kv(shard=dst, error=exc.details()))
