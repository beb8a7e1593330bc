"""One PS shard as a gRPC service: the public names, gathered from the pieces it is cut into.

The service is split along its seams; this module re-exports their public names so
``from ps.server import PsServer, build_server, ERROR_KEY`` keeps working:

=======================  =====================================================================
``ps/servicer.py``       :class:`PsServer`: the gRPC handlers, request checks, error mapping
                         (its module docstring describes request admission and statuses)
``ps/gate.py``           :class:`Gate` (shared data / exclusive admin / pause), :class:`RpcAbort`
``ps/server_metrics.py`` :class:`PsMetrics`, :class:`LoadTotals` (Prometheus + controller load)
``ps/codec.py``          row chunks, named arrays, dense tensors (migration and dense RPCs)
``ps/factory.py``        :func:`build_server` (a ShardStore + PsServer from ``[ps]``)
``ps/types.py``          :class:`RowStore` / :class:`ShardHost` Protocols, trailing-metadata keys
=======================  =====================================================================

Example::

    store = ShardStore(tables, shard_id=0, num_vshards=256, seed=0)
    server = PsServer(store, 0, PartitionMap.initial(1, 256), RpcConfig())
    port = server.start("127.0.0.1:0")
    ...
    server.stop(grace=5)
"""

from __future__ import annotations

from ps.codec import rows_from_chunk, rows_to_chunks
from ps.factory import build_server
from ps.gate import Gate, RpcAbort
from ps.server_metrics import LoadTotals, PsMetrics
from ps.servicer import PsServer
from ps.types import (
    AWAITING_RECOVERY, CLOCK_EXPIRED, ERROR_KEY, MAP_VERSION_KEY, MAX_ROWS_KEY, MIN_CLOCK_KEY, PAUSED, PUSH_COUNT_FIELDS,
    REPLY_LIMIT_KEY, STALE_WAIT, WAIT_TIMEOUT_KEY, WRONG_OWNER, RowStore,
)

__all__ = [
    "AWAITING_RECOVERY", "CLOCK_EXPIRED", "ERROR_KEY", "MAP_VERSION_KEY", "MAX_ROWS_KEY", "MIN_CLOCK_KEY", "PAUSED",
    "PUSH_COUNT_FIELDS", "REPLY_LIMIT_KEY", "STALE_WAIT", "WAIT_TIMEOUT_KEY", "WRONG_OWNER", "Gate", "LoadTotals",
    "PsMetrics", "PsServer", "RowStore", "RpcAbort", "build_server", "rows_from_chunk", "rows_to_chunks",
]
