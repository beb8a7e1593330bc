"""Build one PS shard's service from the job's ``[ps]`` config: a fresh ShardStore plus a PsServer.

The config's enums (device, sync mode, non-finite policy) are passed on as enums;
the device is resolved by ``ps.shard_store.resolve_device`` only ('auto' -> cuda
when available; 'cuda' without a GPU is an error).

Example::

    server = build_server(job.ps, job.rpc, job.table_configs(), shard_id=1)
    server.start(f"{job.ps.host}:0")
"""

from __future__ import annotations

from typing import Callable

from prometheus_client import CollectorRegistry

from common.rpc import RpcConfig
from ps.config import PsConfig, SyncMode, TableConfig
from ps.partition_map import PartitionMap
from ps.servicer import PsServer
from ps.shard_store import ShardStore, resolve_device


def build_server(
    ps_cfg: PsConfig,
    rpc_cfg: RpcConfig,
    tables: list[TableConfig],
    shard_id: int,
    *,
    pmap: PartitionMap | None = None,
    registry: CollectorRegistry | None = None,
    added_latency_s: Callable[[], float] | None = None,
    wait_timeout_s: float | None = None,
    max_workers: int | None = None,
) -> PsServer:
    """A PsServer with a fresh ShardStore built from the job's ``[ps]`` config.

    Args:
        ps_cfg: ``ps.config.PsConfig``.
        rpc_cfg: ``[rpc]``.
        tables: resolved table configs (``JobConfig.table_configs()``).
        shard_id: which shard this process is.
        pmap: starting map (default: version 0, ``vshard % shards``).
        registry, added_latency_s: see :class:`PsServer`.
        wait_timeout_s: override of ``[ps] wait_timeout_s``.
        max_workers: override of ``[ps] server_threads``.

    Example::

        server = build_server(job.ps, job.rpc, job.table_configs(), shard_id=1)
        server.start(f"{job.ps.host}:0")
    """
    if not 0 <= shard_id < ps_cfg.shards:
        raise ValueError(f"--shard {shard_id} out of range: [ps] shards = {ps_cfg.shards}")
    store = ShardStore(
        tables,
        shard_id=shard_id,
        num_vshards=ps_cfg.num_vshards,
        seed=ps_cfg.seed,
        device=resolve_device(ps_cfg.device),
        nonfinite_grads=ps_cfg.nonfinite_grads,
        dense_optimizer=ps_cfg.dense_optimizer,
    )
    return PsServer(
        store,
        shard_id,
        pmap or PartitionMap.initial(ps_cfg.shards, ps_cfg.num_vshards),
        rpc_cfg,
        max_request_rows=ps_cfg.max_request_rows,
        max_staleness=ps_cfg.max_staleness,
        sync=SyncMode(ps_cfg.sync) is SyncMode.SYNC,  # tests build configs with plain strings
        nonfinite_grads=ps_cfg.nonfinite_grads,
        wait_timeout_s=ps_cfg.wait_timeout_s if wait_timeout_s is None else wait_timeout_s,
        registry=registry,
        added_latency_s=added_latency_s,
        max_workers=ps_cfg.server_threads if max_workers is None else max_workers,
        max_pause_lease_s=ps_cfg.max_pause_lease_s,
        max_freeze_lease_s=ps_cfg.max_freeze_lease_s,
        clock_lease_s=ps_cfg.clock_lease_s,
    )
