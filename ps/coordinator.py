"""Coordinated checkpoints across PS shards, and restoring one shard.

``checkpoint_all`` takes one consistent cut of the whole PS fleet::

    coordinator                      shard 0..N-1
      |-- PauseWrites(lease) ------>  drain in-flight requests, then hold new ones
      |-- Checkpoint(tmp, step) --->  save_shard(store) -> <root>/ckpt-<step>.tmp/shard-K.lmdb
      |-- PauseWrites(false) ------>  requests flow again
      |-- commit_checkpoint(tmp, info: step, partition map, dense names, caller's extra)
      v
    <root>/ckpt-<step>/   (atomic rename; manifest with checksums)

The pause covers every shard at once, so no push is applied on one shard
after the cut and on another before it *within the pause*; a worker's step
that straddles the pause may be partly in and partly out (async training
tolerates that; in sync mode checkpoint right after a Barrier). A pause has
a lease: a crashed coordinator cannot stall training.

Restore (``metaps ps --restore DIR`` or the Restore RPC) loads the vshards
this shard owns under its *current* map from every shard file, so a
checkpoint of N shards restores onto M shards; dense parameters go to the
shard that owns their name under M (``dense_owner``).

Example::

    final = checkpoint_all(addresses, "runs/x/ckpt", step=1200, rpc_cfg=rpc, extra_info={"dds": cursor})
"""

from __future__ import annotations

import concurrent.futures
import json
import logging
import time
from pathlib import Path
from typing import Any

import grpc

from metaps.log import kv
from metaps.rpc import RpcConfig, make_channel
from ps.partition_map import PartitionMap, dense_owner
from protos import ps_pb2, ps_pb2_grpc

log = logging.getLogger(__name__)


class CheckpointCoordinationError(RuntimeError):
    """A coordinated checkpoint failed; nothing was committed."""


def checkpoint_all(
    addresses: list[str],
    root: str | Path,
    step: int,
    *,
    rpc_cfg: RpcConfig | None = None,
    extra_info: dict[str, Any] | None = None,
    pause_lease_s: float = 120.0,
) -> Path:
    """Checkpoint every shard at one consistent cut and commit it atomically.

    Args:
        addresses: every shard, in shard-id order.
        root: checkpoint root (shared by all shards: same machine or shared FS).
        step: training step; the directory is ``<root>/ckpt-<step>``.
        rpc_cfg: token/TLS/limits.
        extra_info: stored in the manifest's ``info`` (e.g. DDS state, metrics).
        pause_lease_s: the pause ends by itself after this long.

    Returns:
        the committed checkpoint directory.
    """
    from ps.checkpoint import checkpoint_tmp_dir, commit_checkpoint

    rpc_cfg = rpc_cfg or RpcConfig()
    channels = [make_channel(a, rpc_cfg) for a in addresses]
    stubs = [ps_pb2_grpc.ParameterServerStub(c) for c in channels]
    timeout = rpc_cfg.timeout_s
    tmp = checkpoint_tmp_dir(root, step)
    t0 = time.monotonic()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(stubs)))
    try:
        def each(method: str, make: Any, t: float = timeout) -> list[Any]:
            futs = [pool.submit(getattr(s, method), make(i), timeout=t) for i, s in enumerate(stubs)]
            return [f.result() for f in futs]

        try:
            each("PauseWrites", lambda i: ps_pb2.PauseRequest(paused=True, lease_s=pause_lease_s))
            paused_s = time.monotonic() - t0
            replies = each("Checkpoint", lambda i: ps_pb2.CheckpointRequest(dir=str(tmp), step=step), timeout * 10)
        except grpc.RpcError as exc:
            raise CheckpointCoordinationError(
                f"checkpoint of step {step} into {tmp} failed: {exc.code().name}: {exc.details()}; nothing committed"
            ) from None
        finally:
            try:
                each("PauseWrites", lambda i: ps_pb2.PauseRequest(paused=False))
            except grpc.RpcError as exc:  # the lease ends the pause anyway
                log.warning("could not resume every shard", extra=kv(error=exc.details()))
        held_s = time.monotonic() - t0
        infos = [json.loads(r.info_json) for r in replies]
        maps = [PartitionMap.from_proto(s.GetPartitionMap(ps_pb2.GetPartitionMapRequest(), timeout=timeout)) for s in stubs]
        pmap = max(maps, key=lambda m: m.version)
        info = {
            "step": step,
            "partition_map": pmap.to_dict(),
            "dense_names": sorted({n for i in infos for n in i.get("dense_names", [])}),
            "shard_rows": [i.get("rows", {}) for i in infos],
            **(extra_info or {}),
        }
        final = commit_checkpoint(tmp, info)
    finally:
        pool.shutdown(wait=False)
        for c in channels:
            c.close()
    log.info("coordinated checkpoint committed",
             extra=kv(dir=str(final), step=step, shards=len(addresses), pause_s=round(held_s, 3), drain_s=round(paused_s, 3)))
    return final


# -- the server side of Checkpoint / Restore -----------------------------------------------------
def save_shard_checkpoint(server: Any, ckpt_dir: str, step: int) -> dict[str, Any]:
    """Write ``server``'s store into ``ckpt_dir`` (called under the server's exclusive gate)."""
    from ps.checkpoint import save_shard

    summary = save_shard(server.store, ckpt_dir, server.shard_id)
    summary["dense_names"] = server.store.dense.names()
    summary["map_version"] = server.pmap.version
    summary["step"] = step
    return {**summary, "rows": summary.get("rows", {})}


def restore_shard_checkpoint(server: Any, ckpt_dir: str | Path) -> tuple[int, int]:
    """Replace ``server``'s rows by the checkpoint's: drop every row, then load the
    vshards it owns (under its current map) and its dense params.

    When the checkpoint was taken with the same shard count and vshard count
    the checkpoint's partition map is adopted first (a restarted fleet keeps
    the layout migrations built). Returns (rows loaded, checkpoint step).
    """
    from ps.checkpoint import load_dense, load_shard, read_manifest

    manifest = read_manifest(ckpt_dir)
    info = manifest.get("info", {}) or {}
    saved = info.get("partition_map")
    if saved:
        pm = PartitionMap.from_dict(saved)
        cur = server.pmap
        if pm.num_shards == cur.num_shards and pm.num_vshards == cur.num_vshards and pm.version >= cur.version:
            server._set_map(pm)
    owned = server.pmap.vshards_of(server.shard_id)
    # A restore makes the shard *be* the checkpoint: rows created after it (a live shard
    # restored by the controller's recovery) must not survive next to the restored ones.
    dropped = server.store.drop_vshards(range(server.pmap.num_vshards))
    counts = load_shard(server.store, ckpt_dir, owned)
    names = [n for n in info.get("dense_names", []) if dense_owner(n, server.pmap.num_shards) == server.shard_id]
    if names:
        load_dense(server.store, ckpt_dir, names)
    rows = int(sum(counts.values()))
    step = int(manifest.get("step", info.get("step", 0)))
    log.info("shard restored", extra=kv(shard=server.shard_id, dir=str(ckpt_dir), rows=rows, dropped=dropped, dense=len(names),
                                        step=step, map_version=server.pmap.version))
    return rows, step
