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
import uuid
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc

from common.errors import MetapsError
from common.log import kv
from common.rpc import RpcConfig, make_channel
from ps.partition_map import PartitionMap, dense_owner
from protos import ps_pb2, ps_pb2_grpc
from ps.types import ShardHost

if TYPE_CHECKING:
    from ps.shard_store import ShardStore

log = logging.getLogger(__name__)


class CheckpointCoordinationError(MetapsError, RuntimeError):
    """A coordinated checkpoint failed; nothing was committed."""


class CheckpointWriteFailed(CheckpointCoordinationError):
    """A checkpoint's files could not be written (a full disk, an I/O error, no permission) by
    the coordinator or by a shard; every partial file was removed and nothing was committed.

    Deterministic, unlike a shard that died or restarted during the checkpoint: taking the
    same checkpoint again fails the same way. A periodic cut is skipped (as any
    :class:`CheckpointCoordinationError`); the run's final checkpoint fails the run once
    (``workers.worker.FinalCheckpointFailed``) instead of being retried by a restart.

    Args:
        message: the one-line reason (names the file and the OS error).
        path: the checkpoint directory that was not committed (``<root>/ckpt-<step>``).
        cause: the write error alone (file, OS error), without the step and "nothing committed".
    """

    def __init__(self, message: str, path: Path, cause: str) -> None:
        super().__init__(message)
        self.path = path
        self.cause = cause


def checkpoint_all(
    addresses: list[str],
    root: str | Path,
    step: int,
    *,
    rpc_cfg: RpcConfig | None = None,
    extra_info: dict[str, Any] | None = None,
    pause_lease_s: float = 120.0,
    full_every: int = 1,
) -> Path:
    """Checkpoint every shard at one consistent cut and commit it atomically.

    Args:
        addresses: every shard, in shard-id order.
        root: checkpoint root (shared by all shards: same machine or shared FS).
        step: training step; the directory is ``<root>/ckpt-<step>``.
        rpc_cfg: token/TLS/limits.
        extra_info: stored in the manifest's ``info`` (e.g. DDS state, metrics).
        pause_lease_s: the pause ends by itself after this long.
        full_every: ``[ps] checkpoint_full_every``: a full checkpoint every this many,
            deltas over the newest committed checkpoint between (1 = always full).
            When a shard cannot write the delta (restarted without a restore, or
            its removal log forgot removals) the same cut is retaken as a full one.

    Returns:
        the committed checkpoint directory.
    """
    from ps.checkpoint import abort_checkpoint, begin_checkpoint
    from ps.errors import CheckpointWriteError

    final = Path(root) / f"ckpt-{int(step)}"
    try:
        tmp, plan = begin_checkpoint(root, step, full_every)
    except CheckpointWriteError as exc:  # a full disk before any shard wrote: one line, nothing left
        raise CheckpointWriteFailed(f"checkpoint of step {step} failed: {exc}; nothing committed", final,
                                    str(exc)) from None
    try:
        return _checkpoint_all(addresses, tmp, plan, step, rpc_cfg, extra_info, pause_lease_s)
    except CheckpointWriteError as exc:  # the commit hit a full disk (tmp dir already removed)
        raise CheckpointWriteFailed(f"checkpoint of step {step} failed: {exc}; nothing committed", final,
                                    str(exc)) from None
    except BaseException:
        abort_checkpoint(tmp)  # no committed checkpoint: its tmp dir (plan, partial shard files) goes
        raise


def _checkpoint_all(addresses: list[str], tmp: Path, plan: Any, step: int, rpc_cfg: RpcConfig | None,
                    extra_info: dict[str, Any] | None, pause_lease_s: float) -> Path:
    """:func:`checkpoint_all` once its plan is written into ``tmp``."""
    from ps.checkpoint import DELTA_UNAVAILABLE, CheckpointPlan, commit_checkpoint, write_plan

    rpc_cfg = rpc_cfg or RpcConfig()
    channels = [make_channel(a, rpc_cfg) for a in addresses]
    stubs = [ps_pb2_grpc.ParameterServerStub(c) for c in channels]
    timeout = rpc_cfg.timeout_s
    t0 = time.monotonic()
    pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, len(stubs)))
    try:
        def each(method: str, make: Any, t: float = timeout) -> list[Any]:
            futs = [pool.submit(getattr(s, method), make(i), timeout=t) for i, s in enumerate(stubs)]
            # every shard answers before one's error is raised: a shard still writing into the tmp
            # dir while the abort removes it would leave a partial file (or the dir) behind
            concurrent.futures.wait(futs)
            errors = [e for e in (f.exception() for f in futs) if e is not None]
            if errors:  # a write failure (deterministic) first: it decides what the failure means
                raise next((e for e in errors if _not_written(e)), errors[0])
            return [f.result() for f in futs]

        try:
            each("PauseWrites", lambda i: ps_pb2.PauseRequest(paused=True, lease_s=pause_lease_s))
            paused_s = time.monotonic() - t0
            save = lambda i: ps_pb2.CheckpointRequest(dir=str(tmp), step=step)  # noqa: E731
            try:
                replies = each("Checkpoint", save, timeout * 10)
            except grpc.RpcError as exc:
                if plan.parent is None or DELTA_UNAVAILABLE not in (exc.details() or ""):
                    raise
                log.warning("delta checkpoint unavailable; taking a full one",
                            extra=kv(step=step, parent=plan.parent, error=exc.details()))
                plan = CheckpointPlan(ckpt_id=uuid.uuid4().hex)
                write_plan(tmp, plan)
                replies = each("Checkpoint", save, timeout * 10)
        except grpc.RpcError as exc:
            msg = f"checkpoint of step {step} into {tmp} failed: {exc.code().name}: {exc.details()}; nothing committed"
            if _not_written(exc):
                raise CheckpointWriteFailed(msg, tmp.with_name(f"ckpt-{int(step)}"),
                                            f"{exc.code().name}: {exc.details()}") from None
            raise CheckpointCoordinationError(msg) from None
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
             extra=kv(dir=str(final), step=step, kind=plan.kind, shards=len(addresses), pause_s=round(held_s, 3),
                      drain_s=round(paused_s, 3)))
    return final


def _not_written(exc: BaseException) -> bool:
    """A shard's Checkpoint reply saying its file could not be written (``CHECKPOINT_NOT_WRITTEN``)."""
    from ps.types import CHECKPOINT_NOT_WRITTEN, ERROR_KEY

    if not isinstance(exc, grpc.RpcError) or not hasattr(exc, "trailing_metadata"):
        return False
    return dict(exc.trailing_metadata() or ()).get(ERROR_KEY) == CHECKPOINT_NOT_WRITTEN


def checkpoint_local(store: ShardStore, root: str | Path, step: int, info: dict[str, Any],
                     full_every: int = 1) -> Path:
    """One store's whole checkpoint (plan, save, commit), all or nothing.

    Any failure removes ``ckpt-<step>.tmp``; a write failure (full disk, I/O error)
    is raised as :class:`CheckpointWriteFailed` (a :class:`CheckpointCoordinationError`) -- what a worker's
    periodic checkpoint treats as "skip this cut, keep training" -- with the one-line
    reason of :class:`~ps.errors.CheckpointWriteError`.

    Args:
        store: the single shard's store.
        root: the checkpoint root.
        step: the checkpoint's step (``ckpt-<step>``).
        info: the manifest's ``info``.
        full_every: ``[ps] checkpoint_full_every``.
    """
    from ps.checkpoint import abort_checkpoint, begin_checkpoint, commit_checkpoint, save_shard
    from ps.errors import CheckpointWriteError

    tmp = Path(root) / f"ckpt-{int(step)}.tmp"
    try:
        tmp, _plan = begin_checkpoint(root, step, full_every)
        save_shard(store, tmp, 0)
        return commit_checkpoint(tmp, info)
    except CheckpointWriteError as exc:
        abort_checkpoint(tmp)
        raise CheckpointWriteFailed(f"checkpoint of step {step} failed: {exc}; nothing committed",
                                    tmp.with_name(f"ckpt-{int(step)}"), str(exc)) from None
    except BaseException:
        abort_checkpoint(tmp)
        raise


# -- the server side of Checkpoint / Restore -----------------------------------------------------
def _shard_store(server: ShardHost) -> ShardStore:
    """The host's store as a ShardStore (the checkpoint format is a ShardStore's), else CheckpointError."""
    from ps.errors import CheckpointError
    from ps.shard_store import ShardStore

    store = server.store
    if not isinstance(store, ShardStore):
        raise CheckpointError(f"shard {server.shard_id}: checkpoints need a ShardStore, the shard holds a {type(store).__name__}")
    return store


def save_shard_checkpoint(server: ShardHost, ckpt_dir: str, step: int) -> dict[str, Any]:
    """Write ``server``'s store into ``ckpt_dir`` (called under the server's exclusive gate).

    ``ckpt_dir`` is the coordinator's ``ckpt-<step>.tmp``, made with its plan before any shard is
    asked: a missing one was removed by an aborted attempt and is not made again (a partial
    file of this shard would be left in it). An OS error on the shard file (a full disk, no
    permission) is a :class:`~ps.errors.CheckpointWriteError` naming it; the file is removed.

    Raises:
        CheckpointWriteError: the directory is missing or the shard file could not be written.
    """
    from ps.checkpoint import save_shard, shard_path, write_failed
    from ps.errors import CheckpointWriteError

    store = _shard_store(server)
    if not Path(ckpt_dir).is_dir():
        raise CheckpointWriteError(f"{ckpt_dir}: no such checkpoint directory (the coordinator makes it before "
                                   "asking the shards; an aborted attempt removed it); nothing written")
    try:
        summary = save_shard(store, ckpt_dir, server.shard_id)
    except CheckpointWriteError:
        raise
    except OSError as exc:  # outside the shard file's write (removing a stale file: no permission)
        raise write_failed(shard_path(ckpt_dir, server.shard_id), exc, "writing checkpoint shard file") from None
    summary["dense_names"] = store.dense.names()
    summary["map_version"] = server.pmap.version
    summary["step"] = step
    return {**summary, "rows": summary.get("rows", {})}


def restore_shard_checkpoint(server: ShardHost, ckpt_dir: str | Path) -> tuple[int, int]:
    """Make ``server``'s shard *be* the checkpoint, all or nothing.

    1. verify: manifest, size + sha256 of every file it lists, the shard files
       present are exactly the listed ones, each file's meta agrees with the
       manifest (:func:`ps.checkpoint.verify_for_restore`);
    2. build aside: a fresh, empty ShardStore (``store.empty_like()``) is filled
       with the vshards this shard owns under the map it will have (the
       checkpoint's when it was taken with the same shard and vshard counts and
       is not older, else the current one) and its dense params; every chunk's
       shapes/dtypes are checked against the table dims on import;
       a *pristine* live store (nothing ever stored: a shard just started or
       restarted, before any restore: ``ShardStore.pristine``) is filled in place instead, and a
       failure part-way clears it back to empty (``ShardStore.clear``): it had
       nothing to lose, and a second store would double the memory (at 50M rows
       of dim 64, 2 x 15 GB: more than a 24 GB box holds);
    3. swap: adopt the map and replace ``server.store`` only when all of that
       succeeded. Dense params the live store holds that the checkpoint lacks
       (registered after the cut) are carried over.

    Any error raises :class:`~ps.errors.CheckpointError` naming file and key and
    leaves the shard exactly as it was (rows, dense params, partition map).
    Called under the server's exclusive gate (no request runs meanwhile), or
    before the server starts.

    Args:
        server: the serving shard (``ps.types.ShardHost``: ``store``, ``shard_id``, ``pmap``, ``adopt_map``).
        ckpt_dir: a committed checkpoint directory.

    Returns:
        (rows loaded, checkpoint step).
    """
    from ps.checkpoint import load_dense, load_shard, verify_for_restore
    from ps.errors import CheckpointError

    ckpt_dir = Path(ckpt_dir)
    manifest = verify_for_restore(ckpt_dir)
    info = manifest.get("info", {}) or {}
    cur = server.pmap
    target = cur
    saved = info.get("partition_map")
    if saved:
        try:
            pm = PartitionMap.from_dict(saved)
        except (KeyError, TypeError, ValueError) as exc:
            raise CheckpointError(f"{ckpt_dir / 'manifest.json'}: key 'info.partition_map' is invalid: {exc}") from None
        if pm.num_shards == cur.num_shards and pm.num_vshards == cur.num_vshards and pm.version >= cur.version:
            target = pm
    owned = target.vshards_of(server.shard_id)
    old = _shard_store(server)
    in_place = old.pristine()  # nothing to lose: fill it, no second store (2x memory) aside
    version = old.version
    fresh = old if in_place else old.empty_like()
    names = [n for n in info.get("dense_names", []) if dense_owner(n, target.num_shards) == server.shard_id]
    try:
        counts = load_shard(fresh, ckpt_dir, owned.tolist(), verify=False)
        if names:
            loaded = set(load_dense(fresh, ckpt_dir, names, verify=False))
            missing = sorted(set(names) - loaded)
            if missing:
                raise CheckpointError(f"{ckpt_dir}: dense param(s) {missing} listed in manifest key "
                                      f"'info.dense_names' have no 'd/<name>' chunk in any shard file")
    except BaseException:
        if in_place:
            old.clear(version)  # empty again, as it was (each table dropped before it is rebuilt)
        raise
    with old.write_lock():
        keep = {} if in_place else {k: v for k, v in old.dense.state().items() if k not in set(fresh.dense.names())}
        if keep:
            fresh.dense.load_state(keep)
        dropped = 0 if in_place else int(sum(len(t.used_rows()) for t in old.tables.values()))
        # the swap (in place: the store is already filled); built aside, nothing above changed the live shard
        if target is not cur:
            server.adopt_map(target)
        server.store = fresh
    rows = int(sum(counts.values()))
    step = int(manifest.get("step", info.get("step", 0)))
    log.info("shard restored", extra=kv(shard=server.shard_id, dir=str(ckpt_dir), rows=rows, replaced=dropped,
                                        in_place=in_place, dense=len(names), kept_dense=len(keep), step=step,
                                        map_version=server.pmap.version))
    return rows, step
