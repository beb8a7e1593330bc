"""One PS shard as a gRPC service: data RPCs, routing checks, migration, checkpoints.

A :class:`PsServer` wraps one :class:`ps.shard_store.ShardStore` and serves the
``metaps.ps.ParameterServer`` service (``protos/ps.proto``). Production runs one
shard per process (``metaps ps``); tests run several in one process.

Request admission, in order, for a data request (Pull/Push, single or Many)::

    added latency (fault hook) -> decode + validate buffers (INVALID_ARGUMENT,
    RESOURCE_EXHAUSTED, also when the reply would exceed the message limit)
    -> staleness check (pulls; ABORTED "stale_wait" at once) -> gate (shared;
    ABORTED "paused" at once while paused; waits only while an admin change
    drains in-flight requests) -> map version + vshard ownership
    (FAILED_PRECONDITION "wrong_owner") -> store -> step clock advance (pushes)

**No handler thread ever waits for another worker.** A shard has a few fixed
gRPC threads (``[ps] server_threads``); had a pull waiting on the staleness bound
or a Barrier held one, a few fast workers waiting on a slow one would hold them
all and the slow worker's pushes (the very thing they wait for) could not be
served. So the server never waits on clocks or pauses: a pull whose caller is
too far ahead of the slowest worker, a Barrier not yet reached by everyone, and a
data request during a checkpoint pause answer at once with ``ABORTED`` and
trailing metadata::

    metaps-error: stale_wait | paused
    metaps-min-clock: <slowest registered worker's completed steps>   (stale_wait)
    metaps-wait-timeout: <seconds the caller may keep waiting>        (server cap)

and ``ps.client.PsClient`` waits *client-side* with bounded backoff (1 ms
doubling to 50 ms), re-asking until the bound is met or its wait time (its own
timeout, capped by the shard's ``metaps-wait-timeout``) is spent, then raises
:class:`ps.client.PsStalenessTimeout` (``DEADLINE_EXCEEDED``, the shard's message).
A Barrier is an idempotent arrive+poll: each call marks the caller's step done
and answers OK once every registered worker has done it. Semantics are those of
a blocking wait (a refused pull read nothing; a push is never refused for
staleness), so bounded staleness, sync barriers and sync-mode parity with
single-process training are unchanged. The only waits left in handlers are the
short drains of in-flight requests (which themselves never wait) before an
admin change.

**Step clock leases** (``[ps] clock_lease_s``, ``ps/staleness.py``): a worker's
clock not renewed by its requests within the lease leaves the min computation;
when that worker comes back, its next pull/push/Barrier with a step answers
``FAILED_PRECONDITION`` + ``metaps-error: clock_expired`` (nothing done) and the
client re-registers on that shard and resends. ``RegisterWorker`` answers the
worker's clock (a restarted worker resumes its step numbering from it).

**Awaiting recovery.** A shard process that replaced a crashed one
(``metaps ps --awaiting-recovery``, set by its agent on a restart, or the
controller reporting a later incarnation at registration) holds no rows of the
fleet's cut: until a ``Restore`` completes (or :meth:`PsServer.mark_recovered`)
its data RPCs, RegisterDense and Barrier answer ``UNAVAILABLE`` +
``metaps-error: awaiting_recovery`` (clients retry as for a restarting shard) and
``Checkpoint`` answers ``FAILED_PRECONDITION`` (the coordinator commits nothing),
so no cut can capture its empty rows.

Every client-supplied duration is checked: NaN, infinite or negative leases and
timeouts are refused with INVALID_ARGUMENT; larger ones are clamped to
``[ps] wait_timeout_s`` (barrier), ``max_pause_lease_s``, ``max_freeze_lease_s``.
Every request field that can be bad (shapes, dtypes, names, steps, vshards,
directories) gets INVALID_ARGUMENT / FAILED_PRECONDITION / NOT_FOUND with a
one-line message; an unexpected failure is INTERNAL (logged with its traceback
here), never UNKNOWN.

Admin changes (map update, freeze, import, checkpoint, pause) take the gate
exclusively: they wait for in-flight data requests, so a request is either
wholly before or wholly after the change. A multi-table push is validated for
every table before any table is touched, so a refused request changes nothing.

Example::

    store = ShardStore(tables, shard_id=0, num_vshards=256, seed=0)
    server = PsServer(store, 0, PartitionMap.initial(1, 256), RpcConfig())
    port = server.start("127.0.0.1:0")
    ...
    server.stop(grace=5)
"""

from __future__ import annotations

import dataclasses
import errno
import functools
import json
import logging
import math
import operator
import os
import threading
import time
from typing import TYPE_CHECKING, Any, Callable, Iterator

import grpc
import lmdb
import numpy as np
import torch
from grpc_health.v1 import health_pb2
from prometheus_client import CollectorRegistry

from common.atomic_write import json_default
from common.hashing import vshard_of
from common.log import kv
from common.rpc import RpcConfig, add_health, add_port, make_server
from protos import ps_pb2, ps_pb2_grpc
from ps import frame, group_frame, step_frame, wire
from ps.codec import checked_lease, dense_tensors, rows_from_chunk, rows_to_chunks
from ps.config import NonfiniteMode
from ps.errors import BadRequest, CheckpointError, CheckpointNoSpace, CheckpointNotFound, CheckpointWriteError
from ps.gate import Gate, RpcAbort, bad
from ps.partition_map import PartitionMap
from ps.reply_buffer import PullReplyBuffer
from ps.server_metrics import LoadTotals, PsMetrics
from ps.staleness import Behind, ClockExpired, StalenessTimeout, StepClock
from ps.types import (
    AWAITING_RECOVERY, CHECKPOINT_NOT_WRITTEN, CLOCK_EXPIRED, ERROR_KEY, MAP_VERSION_KEY, MAX_ROWS_KEY, MIN_CLOCK_KEY, PAUSED, PUSH_COUNT_FIELDS,
    REPLY_LIMIT_KEY, STALE_WAIT, WAIT_TIMEOUT_KEY, WRONG_OWNER, RowStore,
)

if TYPE_CHECKING:
    from ps.embedding_table import EmbeddingTable, PushResult

log = logging.getLogger(__name__)

_REPLY_OVERHEAD = 64
"""Bytes a reply spends per table besides its values (name, dtype, dim, rows, framing), generously."""


Handler = Callable[[Any, Any, grpc.ServicerContext], Any]
"""A servicer method: (self, request, context) -> reply."""


def _rpc(data: bool, name: str | None = None) -> Callable[[Handler], Handler]:
    """Wrap a servicer method: fault delay, timing, error -> status mapping.

    Args:
        data: a data-plane request (load totals, gate wait accounting, recovery refusal).
        name: the method in metrics and messages (default: the function's name); the
            framed PullFrame/PushFrame count as the PullMany/PushMany they stand for.
    """

    def deco(fn: Handler) -> Handler:
        method = name or fn.__name__

        @functools.wraps(fn)
        def wrapper(self: "PsServer", request: Any, context: grpc.ServicerContext) -> Any:
            t0 = time.perf_counter()
            shard = str(self.shard_id)
            asked_again = False
            if data:
                self.load.enter()
                self._gate.waited.s = 0.0
                self._touched.tables = ()
            try:
                if data and self.awaiting_recovery:
                    raise self._awaiting(method, grpc.StatusCode.UNAVAILABLE)
                if data and self.added_latency_s is not None:
                    delay = float(self.added_latency_s())
                    if delay > 0:
                        time.sleep(delay)
                return fn(self, request, context)
            except RpcAbort as exc:
                reason = dict(exc.metadata).get(ERROR_KEY, "")
                if exc.code == grpc.StatusCode.ABORTED and reason in (STALE_WAIT, PAUSED):
                    asked_again = True
                    self.metrics.wait_answers.labels(shard, method, reason).inc()
                else:
                    self.metrics.errors.labels(shard, method, exc.code.name).inc()
                if exc.metadata:
                    context.set_trailing_metadata(exc.metadata)
                context.abort(exc.code, str(exc))
            except ClockExpired as exc:  # the worker re-registers and resends (nothing was done)
                self.metrics.errors.labels(shard, method, "FAILED_PRECONDITION").inc()
                context.set_trailing_metadata(((ERROR_KEY, CLOCK_EXPIRED),))
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, str(exc))
            except (wire.WireError, BadRequest) as exc:
                self.metrics.errors.labels(shard, method, "INVALID_ARGUMENT").inc()
                context.abort(grpc.StatusCode.INVALID_ARGUMENT, str(exc))
            except CheckpointNotFound as exc:  # not a committed checkpoint (no such dir / no manifest)
                self.metrics.errors.labels(shard, method, "NOT_FOUND").inc()
                context.abort(grpc.StatusCode.NOT_FOUND, f"{method}: {exc}")
            except CheckpointNoSpace as exc:  # a checkpoint hit a full disk: partial files removed, nothing committed
                self.metrics.errors.labels(shard, method, "RESOURCE_EXHAUSTED").inc()
                log.error("checkpoint not written: no space", extra=kv(shard=self.shard_id, method=method, error=str(exc)))
                context.set_trailing_metadata(((ERROR_KEY, CHECKPOINT_NOT_WRITTEN),))
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{method}: {exc}")
            except CheckpointWriteError as exc:  # an I/O error writing a checkpoint: partial files removed
                self.metrics.errors.labels(shard, method, "FAILED_PRECONDITION").inc()
                log.error("checkpoint not written", extra=kv(shard=self.shard_id, method=method, error=str(exc)))
                context.set_trailing_metadata(((ERROR_KEY, CHECKPOINT_NOT_WRITTEN),))
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{method}: {exc}")
            except CheckpointError as exc:  # a corrupt/incomplete checkpoint: the shard is unchanged
                self.metrics.errors.labels(shard, method, "DATA_LOSS").inc()
                context.abort(grpc.StatusCode.DATA_LOSS, str(exc))
            except StalenessTimeout as exc:
                self.metrics.errors.labels(shard, method, "DEADLINE_EXCEEDED").inc()
                context.abort(grpc.StatusCode.DEADLINE_EXCEEDED, str(exc))
            except FileNotFoundError as exc:
                self.metrics.errors.labels(shard, method, "NOT_FOUND").inc()
                context.abort(grpc.StatusCode.NOT_FOUND, f"{method}: {exc}")
            except (lmdb.DiskError, lmdb.MapFullError) as exc:  # a checkpoint that does not fit its disk
                self.metrics.errors.labels(shard, method, "RESOURCE_EXHAUSTED").inc()
                context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{method}: no space to write: {exc}")
            except OSError as exc:  # an unreadable directory; a full disk
                if exc.errno in (errno.ENOSPC, errno.EDQUOT):
                    self.metrics.errors.labels(shard, method, "RESOURCE_EXHAUSTED").inc()
                    context.abort(grpc.StatusCode.RESOURCE_EXHAUSTED, f"{method}: no space to write: {exc}")
                self.metrics.errors.labels(shard, method, "FAILED_PRECONDITION").inc()
                context.abort(grpc.StatusCode.FAILED_PRECONDITION, f"{method}: {exc}")
            except Exception as exc:  # a bug, not bad input: INTERNAL with the traceback in our log, never UNKNOWN
                if isinstance(exc, grpc.RpcError):
                    raise
                log.exception("rpc failed", extra=kv(shard=self.shard_id, method=method))
                self.metrics.errors.labels(shard, method, "INTERNAL").inc()
                context.abort(grpc.StatusCode.INTERNAL, f"{method} failed on shard {self.shard_id}: {type(exc).__name__}: {exc}")
            finally:
                elapsed = time.perf_counter() - t0
                m = self.metrics
                m.child(m.latency, shard, method).observe(elapsed)
                if data:  # waits for a pause/migration/slower workers are not this shard being slow
                    self.load.leave(max(0.0, elapsed - self._gate.waited.s), count=not asked_again)
                    touched = self._touched.tables
                    if touched:  # per-table requests and latency (issue 14), one vectorized add
                        m.tables.observe(method, m.tables.index(touched), elapsed)

        return wrapper

    return deco


_NO_GRADS = np.zeros((0, 0), dtype=np.float32)
_RESULT_FIELDS = operator.attrgetter(*PUSH_COUNT_FIELDS)
"""A PushResult's counts as a tuple, in PUSH_COUNT_FIELDS order (one C call a table)."""


class _Handlers:
    """Stands in for a grpc.Server to capture the generated method handlers of the service."""

    def __init__(self) -> None:
        self.service = ""
        self.handlers: dict[str, grpc.RpcMethodHandler] = {}

    def add_generic_rpc_handlers(self, handlers: Any) -> None:
        pass

    def add_registered_method_handlers(self, service: str, handlers: dict[str, grpc.RpcMethodHandler]) -> None:
        self.service, self.handlers = service, dict(handlers)


def _add_servicer(servicer: "PsServer", server: grpc.Server) -> None:
    """Register the service as generated, except PullMany: its handler returns the serialized
    reply itself (``wire.encode_pull_reply``), so it is registered without a serializer; plus
    the framed data plane (``ps/frame.py``, ``ps/step_frame.py``): PullFrame, PushFrame and
    StepFrame take and return raw bytes (no protobuf on the hot path), under the same auth interceptor and ``_rpc`` wrapper.

    Args:
        servicer: the shard's servicer.
        server: the gRPC server.
    """
    cap = _Handlers()
    ps_pb2_grpc.add_ParameterServerServicer_to_server(servicer, cap)
    cap.handlers["PullMany"] = grpc.unary_unary_rpc_method_handler(
        servicer.PullMany, request_deserializer=ps_pb2.PullManyRequest.FromString, response_serializer=None
    )
    for method, handler in ((frame.PULL_METHOD, servicer.PullFrame), (frame.PUSH_METHOD, servicer.PushFrame),
                            (step_frame.STEP_METHOD, servicer.StepFrame)):
        cap.handlers[method] = grpc.unary_unary_rpc_method_handler(handler, request_deserializer=None, response_serializer=None)
    server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(cap.service, cap.handlers),))
    server.add_registered_method_handlers(cap.service, cap.handlers)


@dataclasses.dataclass
class _Parsed:
    table: str
    ids: np.ndarray
    grads: np.ndarray = dataclasses.field(default_factory=lambda: _NO_GRADS)
    """Pushes only; pulls carry an empty [0, 0] array."""



class PsServer(ps_pb2_grpc.ParameterServerServicer):  # type: ignore[misc]  # generated base: Any to mypy
    """The gRPC service of one PS shard.

    Args:
        store: this shard's ShardStore.
        shard_id: this shard's id (0..num_shards-1).
        pmap: the partition map it starts with.
        rpc_cfg: token, TLS, message limits.
        max_request_rows: refuse (RESOURCE_EXHAUSTED) requests with more rows; 0 = no limit.
        max_staleness: pulls wait while the caller is further ahead of the slowest worker; < 0 = unbounded.
        sync: synchronous steps (staleness 0 plus per-step Barrier).
        nonfinite_grads: "reject" refuses a push with NaN/Inf (checked here for every
            table before any is applied); "drop" lets the store drop and count them.
        wait_timeout_s: longest a worker may wait for slower workers (told to clients in
            ``metaps-wait-timeout``; caps a Barrier's client-supplied timeout).
        registry: Prometheus registry (default: a private one; the process entry passes the global one).
        added_latency_s: fault hook; its value (seconds) is slept before every data RPC.
        max_workers: gRPC handler threads (``[ps] server_threads``).
        max_pause_lease_s: cap on a PauseWrites lease.
        max_freeze_lease_s: cap on a FreezeVshards lease.
        clock_lease_s: a worker clock not renewed for this long expires (``ps/staleness.py``); 0 = never.
        awaiting_recovery: this process is a restart: refuse data RPCs (UNAVAILABLE) and
            Checkpoint (FAILED_PRECONDITION) until a Restore or :meth:`mark_recovered`.
    """

    checkpoint_root: str | None = None
    """Checkpoint/Restore accept only directories under this root (``metaps ps`` always sets
    it: ``--checkpoint-root``); None, for servers built in-process, accepts any directory."""

    warm_start_dir: str | None = None
    """The checkpoint this run warm-started from (``metaps ps --restore`` / ``--restore-latest``),
    outside the run's root: Restore accepts exactly it too (the run's cut 0, a fleet recovery
    before the run's own first cut). Checkpoint never writes there."""

    def __init__(
        self,
        store: RowStore,
        shard_id: int,
        pmap: PartitionMap,
        rpc_cfg: RpcConfig,
        *,
        max_request_rows: int = 0,
        max_staleness: int = -1,
        sync: bool = False,
        nonfinite_grads: NonfiniteMode | str = NonfiniteMode.REJECT,
        wait_timeout_s: float = 60.0,
        registry: CollectorRegistry | None = None,
        added_latency_s: Callable[[], float] | None = None,
        max_workers: int = 8,
        max_pause_lease_s: float = 600.0,
        max_freeze_lease_s: float = 600.0,
        clock_lease_s: float = 0.0,
        awaiting_recovery: bool = False,
    ) -> None:
        if not 0 <= shard_id < pmap.num_shards:
            raise ValueError(f"shard_id {shard_id} out of range for a map of {pmap.num_shards} shards")
        self.store = store
        self.shard_id = shard_id
        self.rpc_cfg = rpc_cfg
        self.max_request_rows = max_request_rows
        self.sync = sync
        self.nonfinite_grads = NonfiniteMode(nonfinite_grads)
        self.wait_timeout_s = wait_timeout_s
        self.max_pause_lease_s = max_pause_lease_s
        self.max_freeze_lease_s = max_freeze_lease_s
        self.added_latency_s = added_latency_s
        self.clock = StepClock(0 if sync else max_staleness, lease_s=clock_lease_s, name=f"shard {shard_id}")
        self.awaiting_recovery = awaiting_recovery
        self.restores = 0
        """Restore RPCs completed by this process (the controller's fleet recoveries)."""
        self.metrics = PsMetrics(lambda: self.store, shard_id, registry)
        self.metrics.clocks_expired.labels(str(shard_id)).set_function(lambda: self.clock.expired_total)
        self.metrics.watch_clock(lambda: self.clock)
        self.load = LoadTotals()
        self._gate = Gate()
        self._touched = threading.local()  # .tables: the tables of this thread's data request (metrics)
        self._group_cache: dict[tuple[str, ...], int] = {}
        """StepFrame: table names of a storage group -> its index in the store."""
        self._frozen = np.zeros(pmap.num_vshards, dtype=bool)
        self._frozen_until = 0.0
        self.adopt_map(pmap)
        self._server = make_server(rpc_cfg, max_workers=max_workers)
        _add_servicer(self, self._server)
        self._health = add_health(self._server)
        self.port = 0
        self._stopped = threading.Event()

    # -- lifecycle ----------------------------------------------------------------
    def start(self, address: str = "127.0.0.1:0") -> int:
        """Bind and start serving; returns the port."""
        self.port = add_port(self._server, address, self.rpc_cfg)
        self._server.start()
        log.info("ps shard serving", extra=kv(shard=self.shard_id, port=self.port, map_version=self.pmap.version))
        return self.port

    def stop(self, grace: float | None = None) -> None:
        """Stop accepting calls, let in-flight ones finish for ``grace`` seconds."""
        self._health.set("", health_pb2.HealthCheckResponse.NOT_SERVING)
        self._server.stop(grace).wait()
        self._stopped.set()
        log.info("ps shard stopped", extra=kv(shard=self.shard_id))

    def wait(self, timeout: float | None = None) -> bool:
        return self._stopped.wait(timeout)

    # -- awaiting recovery ------------------------------------------------------------
    def mark_awaiting_recovery(self, why: str) -> None:
        """This process replaced a crashed one: serve no data and refuse checkpoints until recovered.

        A cut committed now would capture this shard's empty (or stale) rows as if they
        were the fleet's state: a silent loss at the next restore.
        """
        if not self.awaiting_recovery:
            log.warning("shard awaits recovery: data RPCs and checkpoints refused until restored",
                        extra=kv(shard=self.shard_id, why=why))
        self.awaiting_recovery = True

    def mark_recovered(self, how: str) -> None:
        """The controller restored the fleet (or decided there is nothing to restore)."""
        if self.awaiting_recovery:
            log.info("shard recovered; serving again", extra=kv(shard=self.shard_id, how=how))
        self.awaiting_recovery = False

    def _awaiting(self, method: str, code: grpc.StatusCode) -> RpcAbort:
        return RpcAbort(
            code,
            f"{method}: shard {self.shard_id} restarted and awaits recovery by the controller "
            f"(its rows are not the fleet's until restored); try again",
            ((ERROR_KEY, AWAITING_RECOVERY),),
        )

    @property
    def pmap(self) -> PartitionMap:
        return self._pmap

    def adopt_map(self, pmap: PartitionMap) -> None:
        """Serve under ``pmap`` from now on (callers hold the exclusive gate, or the server is not started).

        Args:
            pmap: the new map (same shard and vshard counts).
        """
        self._pmap = pmap
        self._owned = pmap.owned_mask(self.shard_id)
        self._owns_all = pmap.sole_owner == self.shard_id  # _check_owner's fast path (e.g. one shard)
        self.metrics.map_version.labels(str(self.shard_id)).set(pmap.version)

    # -- request checks -------------------------------------------------------------
    def _table(self, name: str) -> EmbeddingTable:
        table = self.store.tables.get(name)
        if table is None:
            raise bad(f"unknown table '{name}' on shard {self.shard_id}; known tables: {sorted(self.store.tables)}")
        return table

    def _dim(self, name: str) -> int:
        return int(self._table(name).cfg.dim)

    def _decode_ids(self, table: str, buf: bytes | np.ndarray) -> np.ndarray:
        """The ids of one table (a view: the store copies what it keeps), refused when negative."""
        ids = buf if isinstance(buf, np.ndarray) else wire.decode_ids(buf, table=table)
        if ids.size and ids.min() < 0:
            row = int(np.argmax(ids < 0))
            raise bad(f"table '{table}': ids must be >= 0, got {int(ids[row])} at position {row}")
        return ids

    def _check_rows(self, total: int) -> None:
        if self.max_request_rows and total > self.max_request_rows:
            raise RpcAbort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"request has {total} rows, shard limit max_request_rows is {self.max_request_rows}: split it",
            )

    def _check_owner(self, map_version: int, parsed: list[_Parsed]) -> None:
        """Called inside the gate: the map cannot change until the request is done."""
        pmap = self._pmap
        md = ((ERROR_KEY, WRONG_OWNER), (MAP_VERSION_KEY, str(pmap.version)))
        if map_version != pmap.version:
            raise RpcAbort(
                grpc.StatusCode.FAILED_PRECONDITION,
                f"{WRONG_OWNER}: request routed with partition map v{map_version}, shard {self.shard_id} has v{pmap.version}",
                md,
            )
        frozen = self._frozen if time.monotonic() < self._frozen_until else None
        if frozen is None and self._owns_all:
            return  # every vshard is ours and none is frozen: every id passes (no hashing)
        for p in parsed:
            if not p.ids.size:
                continue
            vs = vshard_of(p.ids, pmap.num_vshards)
            ok = self._owned[vs] if frozen is None else self._owned[vs] & ~frozen[vs]
            if not ok.all():
                first = int(np.argmin(ok))
                v = int(vs[first])
                why = "is being migrated" if self._owned[v] else f"is owned by shard {int(pmap.owners[v])}"
                raise RpcAbort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"{WRONG_OWNER}: table '{p.table}' id {int(p.ids[first])} (vshard {v}) {why}, not shard {self.shard_id} (map v{pmap.version})",
                    md,
                )

    def _parse_pull(self, items: list[tuple[str, bytes | np.ndarray]]) -> list[_Parsed]:
        parsed = []
        for table, ids in items:
            self._table(table)
            parsed.append(_Parsed(table, self._decode_ids(table, ids)))
        self._check_rows(sum(p.ids.size for p in parsed))
        self._touched.tables = tuple(p.table for p in parsed)
        return parsed

    def _parse_push(self, items: list[tuple[str, bytes, bytes, int]]) -> list[_Parsed]:
        parsed = []
        for table, ids_buf, grads_buf, dtype in items:
            dim = self._dim(table)
            ids = self._decode_ids(table, ids_buf)
            dt = wire.DType.from_proto(dtype, table=table, field="grad dtype")
            grads = wire.decode_rows(grads_buf, dt, ids.size, dim, table=table, field="grads")
            parsed.append(_Parsed(table, ids, grads))
        return self._check_push(parsed)

    def _parse_push_frame(self, req: frame.Frame) -> list[_Parsed]:
        """A decoded push frame's tables, checked as :meth:`_parse_push` checks PushMany's."""
        parsed = []
        for t in req.tables:
            dim = self._dim(t.name)
            if t.dim != dim:
                raise bad(f"table '{t.name}': push frame says grads dim {t.dim}, the table's dim is {dim}")
            if t.ids is None or t.values is None:  # (decode_push_request sets both)
                raise wire.WireError(f"push frame: table '{t.name}' decoded without ids or grads")
            parsed.append(_Parsed(t.name, self._decode_ids(t.name, t.ids), t.values))
        return self._check_push(parsed)

    def _check_push(self, parsed: list[_Parsed]) -> list[_Parsed]:
        """Row limit and the non-finite check, for every table before any is applied."""
        self._check_rows(sum(p.ids.size for p in parsed))
        if self.nonfinite_grads is NonfiniteMode.REJECT:
            # Checked for every table before any is applied: a refused push changes nothing.
            for p in parsed:
                with np.errstate(over="ignore", invalid="ignore"):
                    total = p.grads.sum(dtype=np.float32)
                if np.isfinite(total):
                    continue  # a finite sum: every value is finite (NaN/Inf propagate); one SIMD pass
                finite = np.isfinite(p.grads).all(axis=1)  # or a finite overflow: the exact check
                if not finite.all():
                    rows = np.nonzero(~finite)[0]
                    self.metrics.nonfinite.labels(str(self.shard_id), p.table, "reject").inc(int(rows.size))
                    raise bad(
                        f"table '{p.table}': {rows.size} gradient row(s) contain NaN/Inf "
                        f"(first: id {int(p.ids[rows[0]])} at position {int(rows[0])}); nonfinite_grads='reject'"
                    )
        self._touched.tables = tuple(p.table for p in parsed)
        return parsed

    def _ask_again(self, behind: Behind) -> RpcAbort:
        """ABORTED "stale_wait": the caller waits client-side and asks again (see the module doc)."""
        return RpcAbort(
            grpc.StatusCode.ABORTED,
            behind.message,
            ((ERROR_KEY, STALE_WAIT), (MIN_CLOCK_KEY, str(behind.min_clock)), (WAIT_TIMEOUT_KEY, f"{self.wait_timeout_s:.3f}")),
        )

    def _check_staleness(self, worker: str, step: int | None) -> None:
        """Never blocks: a caller too far ahead of the slowest worker is told to ask again."""
        if step is not None and step < 0:
            raise bad(f"step must be >= 0, got {step}")
        if worker and step is not None:
            behind = self.clock.check_pull(worker, step)
            if behind is not None:
                raise self._ask_again(behind)

    def _check_reply_size(self, parsed: list[_Parsed], fp16: bool, context: grpc.ServicerContext) -> None:
        """Refuse (RESOURCE_EXHAUSTED + a rows hint) a pull whose reply would not fit the message limit:
        ours, or the caller's when it sends a smaller one in ``metaps-max-reply-bytes``.

        Checked before any row is read, so an oversized pull costs no store work.
        """
        itemsize = 2 if fp16 else 4
        dims = [self._dim(p.table) for p in parsed]
        total = sum(int(p.ids.size) * d * itemsize + _REPLY_OVERHEAD for p, d in zip(parsed, dims)) + _REPLY_OVERHEAD
        limit = self.rpc_cfg.max_message_bytes
        theirs = dict(context.invocation_metadata() or ()).get(REPLY_LIMIT_KEY, "")
        if theirs:
            if not theirs.isdigit() or int(theirs) < 1024:
                raise bad(f"metadata {REPLY_LIMIT_KEY} must be a whole number of bytes >= 1024, got {theirs!r}")
            limit = min(limit, int(theirs))
        if total > limit:
            per_row = max(dims) * itemsize + 8
            fit = max(1, (limit - _REPLY_OVERHEAD * (len(parsed) + 1)) // per_row)
            raise RpcAbort(
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"pull of {sum(int(p.ids.size) for p in parsed)} rows needs a reply of {total} bytes, over the "
                f"message limit {limit} (max_message_bytes): split it (at most {fit} rows of dim {max(dims)} per request)",
                ((MAX_ROWS_KEY, str(fit)),),
            )

    # -- sparse data ------------------------------------------------------------------
    def _pull(self, parsed: list[_Parsed], map_version: int, fp16: bool) -> list[tuple[str, wire.DType, np.ndarray]]:
        """Rows per table in the wire dtype (C-contiguous [n, dim]); callers write them into
        the reply once (``wire.encode_pull_reply``: no protobuf copies of the payload)."""
        dtype = wire.DType.FP16 if fp16 else wire.DType.FP32
        out = []
        with self._gate.data(self.wait_timeout_s):
            self._check_owner(map_version, parsed)
            pulled = self.store.pull_many([(p.table, p.ids) for p in parsed], fp16=fp16)  # one lookup per group
            for p, rows in zip(parsed, pulled):
                if rows.ndim != 2:
                    rows = rows.reshape(int(p.ids.size), self._dim(p.table))
                out.append((p.table, dtype, wire.wire_rows(rows, dtype)))
        self._count_rows("pulled", parsed)
        return out

    def _count_rows(self, kind: str, parsed: list[_Parsed]) -> None:
        """Rows pulled / pushed per table of a request, into the metrics (one vectorized add)."""
        t = self.metrics.tables
        t.rows(kind, t.index(tuple(p.table for p in parsed)), np.fromiter((p.ids.size for p in parsed), np.int64,
                                                                          count=len(parsed)))

    def _pull_reply(self, parsed: list[_Parsed], map_version: int, fp16: bool, framed: bool = False) -> bytes:
        """The serialized PullManyResponse (``framed``: the pull reply frame, ``ps/frame.py``).
        fp32 rows are gathered straight into the reply's bytes (``ps.reply_buffer``: no
        intermediate tensor, no join copy); fp16 rows are converted into it."""
        if fp16:
            rows = self._pull(parsed, map_version, fp16)
            return frame.encode_pull_reply(rows) if framed else wire.encode_pull_reply(rows)
        spans = [(p.table, wire.DType.FP32, int(p.ids.size), self._dim(p.table)) for p in parsed]
        buf: PullReplyBuffer | frame.PullFrameBuffer = frame.PullFrameBuffer(spans) if framed else PullReplyBuffer(spans)
        with self._gate.data(self.wait_timeout_s):
            self._check_owner(map_version, parsed)
            self.store.pull_many([(p.table, p.ids) for p in parsed], outs=[buf.rows(i) for i in range(len(parsed))])
        self._count_rows("pulled", parsed)
        return buf.bytes()

    def _push(self, parsed: list[_Parsed], map_version: int, worker: str, step: int | None,
              then: Callable[[], None] | None = None) -> list[PushResult]:
        """Apply a push; per table its PushResult (the callers put them in their reply).

        Args:
            then: also run this inside the same gate entry, after the rows are applied (a step's
                dense update: a pause cannot fall between the two).
        """
        if step is not None and step < 0:
            raise bad(f"step must be >= 0, got {step}")
        if worker and step is not None:
            self.clock.touch(worker)  # an expired worker rejoins before its push is applied
        with self._gate.data(self.wait_timeout_s):
            self._check_owner(map_version, parsed)
            # one lookup and one fused update per storage group, every table checked first
            results = self.store.push_many([(p.table, p.ids, wire.to_float32(p.grads)) for p in parsed])
            if then is not None:
                then()
        shard = str(self.shard_id)
        self._count_rows("pushed", parsed)
        for p, res in zip(parsed, results):
            if res.nonfinite_dropped:
                self.metrics.nonfinite.labels(shard, p.table, "drop").inc(res.nonfinite_dropped)
        if worker and step is not None:
            self.clock.advance(worker, step)
        return results

    @staticmethod
    def _counts(parsed: list[_Parsed], results: list[PushResult]) -> list[ps_pb2.PushCounts]:
        """The protobuf PushCounts of a push (PushMany / Push replies)."""
        out = []
        for p, res in zip(parsed, results):
            c = ps_pb2.PushCounts(table=p.table, rows=int(p.ids.size))
            for name in PUSH_COUNT_FIELDS:
                setattr(c, name, int(getattr(res, name, 0) or 0))
            out.append(c)
        return out

    @_rpc(data=True)
    def PullMany(self, request: ps_pb2.PullManyRequest, context: grpc.ServicerContext) -> bytes:
        """A serialized PullManyResponse, built around the row buffers (registered with no serializer)."""
        parsed = self._parse_pull([(t.table, t.ids) for t in request.tables])
        self._check_reply_size(parsed, request.want_fp16, context)
        self._check_staleness(request.worker_id, request.step if request.HasField("step") else None)
        return self._pull_reply(parsed, request.map_version, request.want_fp16)

    @_rpc(data=True, name="PullMany")
    def PullFrame(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """PullMany as a frame (``ps/frame.py``): raw bytes in and out, same checks in the same order."""
        req = frame.decode_pull_request(request)
        parsed = self._parse_pull([(t.name, t.ids if t.ids is not None else b"") for t in req.tables])
        self._check_reply_size(parsed, req.fp16, context)
        self._check_staleness(req.worker_id, req.step)
        return self._pull_reply(parsed, req.map_version, req.fp16, framed=True)

    @_rpc(data=True, name="PushMany")
    def PushFrame(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """PushMany as a frame (``ps/frame.py``): the gradients stay views of the request's bytes."""
        req = frame.decode_push_request(request, writable=True)  # the received bytes are ours alone
        parsed = self._parse_push_frame(req)
        results = self._push(parsed, req.map_version, req.worker_id, req.step)
        return frame.encode_push_reply([(p.table, int(p.ids.size), r) for p, r in zip(parsed, results)])

    @_rpc(data=True)
    def StepFrame(self, request: bytes, context: grpc.ServicerContext) -> bytes:
        """One worker step with this shard (``ps/step_frame.py``): push, dense, then pull, each
        storage group as one run (``ps/group_frame.py``) handed to the group's store call.

        Everything that can refuse the push or dense part is checked before either is applied
        (frames, groups, dims, ids, NaN, dense names and sizes, the owner inside the gate); a pull
        that cannot be served once they are applied is answered "deferred" with the reason.
        """
        parts = step_frame.decode_step(request, step_frame.REQUEST, writable=True)  # the received bytes are ours
        push = group_frame.decode(parts.push, group_frame.PUSH_REQUEST) if parts.push is not None else None
        pushed = self._check_groups(push) if push is not None else []
        dense = self._dense_grads(parts.dense) if parts.dense is not None else None
        pull = group_frame.decode(parts.pull, group_frame.PULL_REQUEST) if parts.pull is not None else None
        pulled = self._check_groups(pull) if pull is not None else []
        values: dict[str, np.ndarray] = {}

        def dense_step() -> None:  # inside the push's gate entry: both applied, or neither
            if dense is not None:
                self.store.dense.push(dense.split())
                if parts.want_values:
                    values.update(self.store.dense.pull(dense.names))

        push_reply = None
        if push is not None:
            push_reply = group_frame.encode_push_reply(self._push_groups(push, pushed, then=dense_step))
        elif dense is not None:
            with self._gate.data(self.wait_timeout_s):
                dense_step()
        dense_reply = None
        if dense is not None and parts.want_values:
            flat = np.concatenate([values[n].reshape(-1) for n in dense.names]) if dense.names else \
                np.empty(0, dtype=np.float32)
            dense_reply = step_frame.encode_dense(dense.names, flat, dense.sizes)
        pull_reply: bytes | None = None
        flags = 0
        if pull is not None:
            try:
                self._check_reply_size([_Parsed(g.names[0], g.ids) for g in pull.groups if g.ids is not None and g.names],
                                       pull.fp16, context)
                self._check_staleness(pull.worker_id, pull.step)
                pull_reply = self._pull_groups(pull, pulled)
            except (RpcAbort, ClockExpired, StalenessTimeout) as exc:  # the push and dense are applied: the
                # client pulls by the ordinary path (it waits, rejoins, refreshes the map or splits there)
                reason = (dict(exc.metadata).get(ERROR_KEY, "") or exc.code.name) if isinstance(exc, RpcAbort) \
                    else type(exc).__name__
                self.metrics.wait_answers.labels(str(self.shard_id), "StepFrame", f"pull_deferred:{reason}").inc()
                pull_reply, flags = f"{reason}: {exc}".encode("utf-8"), step_frame.FLAG_PULL_DEFERRED
        return step_frame.encode_step(step_frame.REPLY, push=push_reply, dense=dense_reply, pull=pull_reply, flags=flags)

    def _group_index(self, names: tuple[str, ...]) -> int:
        """The store's group holding exactly ``names`` (cached), refused in one line otherwise."""
        gi = self._group_cache.get(names)
        if gi is None:
            try:
                gi = self._group_cache[names] = self.store.group_of(names)
            except ValueError as exc:
                raise bad(f"step frame: {exc}") from None
        return gi

    def _check_groups(self, fr: group_frame.GroupFrame) -> list[tuple[int, torch.Tensor, torch.Tensor | None]]:
        """A group frame's groups checked whole (nothing applied yet): each a storage group of this
        shard at its dim, ids >= 0, the row limit, finite gradients under ``nonfinite_grads =
        "reject"``. Per group: (store group index, ids, grads or None) as tensors over the frame."""
        out = []
        total = 0
        for g in fr.groups:
            gi = self._group_index(g.names)
            ids = g.ids if g.ids is not None else np.zeros(0, np.int64)
            total += int(ids.size)
            if ids.size and int(ids.min()) < 0:
                row = int(np.argmax(ids < 0))
                table = g.names[int(np.searchsorted(np.cumsum(g.counts), row, side="right"))]
                raise bad(f"table '{table}': ids must be >= 0, got {int(ids[row])} at position {row} of its group")
            grads = None
            if fr.kind == group_frame.PUSH_REQUEST:
                dim = self.store.groups[gi].dim
                assert g.values is not None
                if g.dim != dim:
                    raise bad(f"group {list(g.names)}: push frame says grads dim {g.dim}, the tables' dim is {dim}")
                vals = wire.to_float32(g.values)
                if self.nonfinite_grads is NonfiniteMode.REJECT and vals.size:
                    with np.errstate(over="ignore", invalid="ignore"):
                        finite = bool(np.isfinite(vals.sum(dtype=np.float32))) or bool(np.isfinite(vals).all())
                    if not finite:
                        rows = np.nonzero(~np.isfinite(vals).all(axis=1))[0]
                        table = g.names[int(np.searchsorted(np.cumsum(g.counts), rows[0], side="right"))]
                        self.metrics.nonfinite.labels(str(self.shard_id), table, "reject").inc(int(rows.size))
                        raise bad(f"table '{table}': {rows.size} gradient row(s) of its group contain NaN/Inf "
                                  f"(first: id {int(ids[rows[0]])}); nonfinite_grads='reject'")
                grads = torch.from_numpy(vals)
            out.append((gi, torch.from_numpy(ids), grads))
        self._check_rows(total)
        self._touched.tables = tuple(t for g in fr.groups for t in g.names)
        return out

    def _push_groups(self, fr: group_frame.GroupFrame, checked: list[tuple[int, torch.Tensor, torch.Tensor | None]],
                     then: Callable[[], None]) -> list[np.ndarray]:
        """Apply a checked group push (and ``then``, in the same gate entry); per group its counts
        int64 [tables, len(group_frame.COUNT_FIELDS)] for the reply."""
        worker, step = fr.worker_id, fr.step
        if step is not None and step < 0:
            raise bad(f"step must be >= 0, got {step}")
        if worker and step is not None:
            self.clock.touch(worker)  # an expired worker rejoins before its push is applied
        with self._gate.data(self.wait_timeout_s):
            self._check_owner(fr.map_version, [_Parsed(g.names[0], g.ids) for g in fr.groups if g.ids is not None])
            results = [self.store.push_group(gi, g.counts, ids, grads, trusted=False)
                       for g, (gi, ids, grads) in zip(fr.groups, checked) if grads is not None]
            then()
        out = []
        m = self.metrics.tables
        shard = str(self.shard_id)
        for g, res in zip(fr.groups, results):
            counts = np.zeros((len(g.names), len(group_frame.COUNT_FIELDS)), dtype=np.int64)
            counts[:, 0] = g.counts
            present = np.flatnonzero(g.counts)
            if present.size:
                counts[present, 1:] = list(map(_RESULT_FIELDS, res))
            col = 1 + PUSH_COUNT_FIELDS.index("nonfinite_dropped")
            for k in np.flatnonzero(counts[:, col]):
                self.metrics.nonfinite.labels(shard, g.names[k], "drop").inc(int(counts[k, col]))
            m.rows("pushed", m.index(g.names), np.asarray(g.counts))
            out.append(counts)
        if worker and step is not None:
            self.clock.advance(worker, step)
        return out

    def _pull_groups(self, fr: group_frame.GroupFrame, checked: list[tuple[int, torch.Tensor, torch.Tensor | None]]) -> bytes:
        """A checked group pull: each group's rows gathered straight into the reply buffer."""
        dtype = wire.DType.FP16 if fr.fp16 else wire.DType.FP32
        buf = group_frame.PullReplyBuffer([(g.counts, int(g.counts.sum()), self.store.groups[gi].dim, dtype)
                                           for g, (gi, _, _) in zip(fr.groups, checked)])
        with self._gate.data(self.wait_timeout_s):
            self._check_owner(fr.map_version, [_Parsed(g.names[0], g.ids) for g in fr.groups if g.ids is not None])
            for i, (g, (gi, ids, _)) in enumerate(zip(fr.groups, checked)):
                if dtype == wire.DType.FP32:
                    self.store.pull_group(gi, g.counts, ids, out=torch.from_numpy(buf.rows(i)))
                else:
                    buf.rows(i)[...] = wire.wire_rows(self.store.pull_group(gi, g.counts, ids).numpy(), dtype)
        m = self.metrics.tables
        for g in fr.groups:
            m.rows("pulled", m.index(g.names), np.asarray(g.counts))
        return buf.bytes()

    def _dense_grads(self, data: memoryview) -> step_frame.DenseSection:
        """A step's dense part, checked before anything of the step is applied: known names, each
        once, at their registered sizes, finite (the dense store refuses NaN/Inf in every mode)."""
        sec = step_frame.decode_dense(data)
        shapes = self.store.dense.shapes()
        if len(set(sec.names)) != len(sec.names):
            raise bad(f"step dense part: a parameter is given twice in {sec.names}")
        for name, n in zip(sec.names, sec.sizes):
            if name not in shapes:
                raise bad(f"dense '{name}': unknown dense parameter; registered: {sorted(shapes)}")
            want = int(np.prod(shapes[name]))
            if n != want:
                raise bad(f"dense '{name}': gradient of {n} values, the parameter has {want} {shapes[name]}")
        if not np.isfinite(sec.flat).all():  # the dense store refuses them in every mode: refuse before the rows
            first = next(n for n, g in sec.split().items() if not np.isfinite(g).all())
            raise bad(f"dense '{first}': gradient contains NaN/Inf; push rejected")
        return sec

    @_rpc(data=True)
    def Pull(self, request: ps_pb2.PullRequest, context: grpc.ServicerContext) -> ps_pb2.PullResponse:
        parsed = self._parse_pull([(request.table, request.ids)])
        self._check_reply_size(parsed, request.want_fp16, context)
        self._check_staleness(request.worker_id, request.step if request.HasField("step") else None)
        _, dtype, rows = self._pull(parsed, request.map_version, request.want_fp16)[0]
        return ps_pb2.PullResponse(values=rows.tobytes(), dtype=dtype.proto, dim=int(rows.shape[1]), rows=int(rows.shape[0]))

    @_rpc(data=True)
    def PushMany(self, request: ps_pb2.PushManyRequest, context: grpc.ServicerContext) -> ps_pb2.PushManyResponse:
        parsed = self._parse_push([(t.table, t.ids, t.grads, t.dtype) for t in request.tables])
        step = request.step if request.HasField("step") else None
        return ps_pb2.PushManyResponse(tables=self._counts(parsed, self._push(parsed, request.map_version, request.worker_id,
                                                                              step)))

    @_rpc(data=True)
    def Push(self, request: ps_pb2.PushRequest, context: grpc.ServicerContext) -> ps_pb2.PushResponse:
        parsed = self._parse_push([(request.table, request.ids, request.grads, request.grad_dtype)])
        step = request.step if request.HasField("step") else None
        return ps_pb2.PushResponse(counts=self._counts(parsed, self._push(parsed, request.map_version, request.worker_id,
                                                                          step))[0])

    # -- dense ---------------------------------------------------------------------------
    @_rpc(data=False)
    def RegisterDense(self, request: ps_pb2.RegisterDenseRequest, context: grpc.ServicerContext) -> ps_pb2.RegisterDenseResponse:
        if self.awaiting_recovery:
            raise self._awaiting("RegisterDense", grpc.StatusCode.UNAVAILABLE)
        values = dense_tensors(request.params, "param")
        for name, v in values.items():
            if not np.isfinite(v).all():
                raise bad(f"dense '{name}': initial value contains NaN/Inf")
        with self._gate.data(self.wait_timeout_s):
            created = [name for name, value in values.items() if self.store.dense.register(name, value)]
            if request.overwrite:
                self.store.dense.set(values)
        return ps_pb2.RegisterDenseResponse(created=created)

    @_rpc(data=True)
    def PullDense(self, request: ps_pb2.PullDenseRequest, context: grpc.ServicerContext) -> ps_pb2.PullDenseResponse:
        names = list(request.names)
        if any(not n for n in names):
            raise bad("PullDense: a dense parameter name is empty")
        with self._gate.data(self.wait_timeout_s):
            values = self.store.dense.pull(names)
        return ps_pb2.PullDenseResponse(params=[wire.dense_to_proto(n, v) for n, v in values.items()])

    @_rpc(data=True)
    def PushDense(self, request: ps_pb2.PushDenseRequest, context: grpc.ServicerContext) -> ps_pb2.PushDenseResponse:
        grads = dense_tensors(request.grads, "gradient")
        if self.nonfinite_grads is NonfiniteMode.REJECT:
            for name, g in grads.items():
                if not np.isfinite(g).all():
                    raise bad(f"dense '{name}': gradient contains NaN/Inf; nonfinite_grads='reject'")
        with self._gate.data(self.wait_timeout_s):
            self.store.dense.push(grads)
            values = self.store.dense.pull(list(grads)) if request.return_values else {}
        return ps_pb2.PushDenseResponse(applied=len(grads), params=[wire.dense_to_proto(n, v) for n, v in values.items()])

    # -- partition map ----------------------------------------------------------------------
    @_rpc(data=False)
    def GetPartitionMap(self, request: ps_pb2.GetPartitionMapRequest, context: grpc.ServicerContext) -> ps_pb2.PartitionMap:
        return self._pmap.to_proto()

    @_rpc(data=False)
    def UpdatePartitionMap(self, request: ps_pb2.PartitionMap, context: grpc.ServicerContext) -> ps_pb2.UpdatePartitionMapResponse:
        try:
            new = PartitionMap.from_proto(request)
        except ValueError as exc:
            raise bad(f"bad partition map: {exc}") from None
        with self._gate.exclusive():
            cur = self._pmap
            if new.num_vshards != cur.num_vshards or new.num_shards != cur.num_shards:
                raise bad(
                    f"partition map shape {new.num_vshards} vshards/{new.num_shards} shards does not match "
                    f"this job's {cur.num_vshards}/{cur.num_shards}"
                )
            if new.version > cur.version:
                self.adopt_map(new)
                log.info("partition map updated", extra=kv(shard=self.shard_id, version=new.version, owned=int(self._owned.sum())))
            elif new.version < cur.version or not new.same_assignment(cur):
                raise RpcAbort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"partition map v{new.version} is not newer than shard {self.shard_id}'s v{cur.version}",
                    ((MAP_VERSION_KEY, str(cur.version)),),
                )
            return ps_pb2.UpdatePartitionMapResponse(version=self._pmap.version)

    # -- migration ----------------------------------------------------------------------------
    def _vshards(self, values: Any) -> np.ndarray:
        vs = np.asarray(list(values), dtype=np.int64)
        if vs.size and (vs.min() < 0 or vs.max() >= self._pmap.num_vshards):
            raise bad(f"vshards must be in 0..{self._pmap.num_vshards - 1}, got {vs.tolist()}")
        return vs

    @_rpc(data=False)
    def FreezeVshards(self, request: ps_pb2.FreezeRequest, context: grpc.ServicerContext) -> ps_pb2.FreezeResponse:
        vs = self._vshards(request.vshards)
        lease = checked_lease("FreezeVshards", request.lease_s, self.max_freeze_lease_s)
        with self._gate.exclusive():  # in-flight pushes to them finish first
            if time.monotonic() >= self._frozen_until:
                self._frozen[:] = False
            self._frozen[vs] = bool(request.frozen)
            if self._frozen.any():
                self._frozen_until = time.monotonic() + lease
            else:  # nothing frozen any more: end the lease (the owner check's fast path applies again)
                self._frozen_until = 0.0
            frozen = np.nonzero(self._frozen)[0].tolist()
        log.info("vshards frozen" if request.frozen else "vshards thawed", extra=kv(shard=self.shard_id, vshards=vs.tolist()))
        return ps_pb2.FreezeResponse(frozen=frozen)

    @_rpc(data=False)
    def ExportVshards(self, request: ps_pb2.ExportRequest, context: grpc.ServicerContext) -> Iterator[ps_pb2.RowsChunk]:
        # Not a generator itself: checks and the snapshot run here, inside _rpc's error mapping.
        vs = self._vshards(request.vshards)
        if request.max_chunk_bytes < 0:
            raise bad(f"max_chunk_bytes must be >= 0, got {request.max_chunk_bytes}")
        limit = min(request.max_chunk_bytes or self.rpc_cfg.max_message_bytes // 2, self.rpc_cfg.max_message_bytes // 2)
        with self._gate.data(self.wait_timeout_s, hold=True):  # a consistent snapshot of the vshards
            exported = self.store.export_vshards(vs.tolist())
        return (chunk for table, rows in exported.items() for chunk in rows_to_chunks(table, rows, limit))

    @_rpc(data=False)
    def ImportVshards(self, request: ps_pb2.RowsChunk, context: grpc.ServicerContext) -> ps_pb2.ImportResponse:
        self._table(request.table)
        rows = rows_from_chunk(request)
        with self._gate.exclusive():
            self.store.import_rows(request.table, rows)
        return ps_pb2.ImportResponse(rows=int(request.rows))

    @_rpc(data=False)
    def DropVshards(self, request: ps_pb2.VshardsRequest, context: grpc.ServicerContext) -> ps_pb2.DropResponse:
        vs = self._vshards(request.vshards)
        with self._gate.exclusive():
            owned = vs[self._owned[vs]] if vs.size else vs
            if owned.size:
                raise RpcAbort(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"shard {self.shard_id} still owns vshards {owned.tolist()} (map v{self._pmap.version}); refusing to drop them",
                )
            n = int(self.store.drop_vshards(vs.tolist()))
        log.info("vshards dropped", extra=kv(shard=self.shard_id, vshards=len(vs), rows=n))
        return ps_pb2.DropResponse(rows=n)

    # -- checkpoints, clocks, stats ---------------------------------------------------------------
    @_rpc(data=False)
    def PauseWrites(self, request: ps_pb2.PauseRequest, context: grpc.ServicerContext) -> ps_pb2.PauseResponse:
        if request.paused:
            self._gate.pause(checked_lease("PauseWrites", request.lease_s, self.max_pause_lease_s))
        else:
            self._gate.resume()
        return ps_pb2.PauseResponse(paused=self._gate.paused)

    @_rpc(data=False)
    def Checkpoint(self, request: ps_pb2.CheckpointRequest, context: grpc.ServicerContext) -> ps_pb2.CheckpointResponse:
        from ps.coordinator import save_shard_checkpoint

        if not request.dir:
            raise bad("Checkpoint needs a directory")
        directory = self._confined(request.dir, "Checkpoint")
        if self.awaiting_recovery:
            raise self._awaiting("Checkpoint", grpc.StatusCode.FAILED_PRECONDITION)
        with self._gate.exclusive():
            info = save_shard_checkpoint(self, directory, int(request.step))
        rows = info.get("rows", {})
        total = int(sum(rows.values())) if isinstance(rows, dict) else int(rows)
        return ps_pb2.CheckpointResponse(rows=total, info_json=json.dumps(info, default=json_default))

    @_rpc(data=False)
    def Restore(self, request: ps_pb2.RestoreRequest, context: grpc.ServicerContext) -> ps_pb2.RestoreResponse:
        from ps.coordinator import restore_shard_checkpoint
        from ps.digest import served_digest

        if not request.dir:
            raise bad("Restore needs a directory")
        directory = self._confined(request.dir, "Restore", also=self.warm_start_dir)
        with self._gate.exclusive():
            rows, step = restore_shard_checkpoint(self, directory)
            # what the shard serves now, read from its live store (not the restore's own count): a
            # judge compares it with the cut on disk (ps/digest.py, bench/chaos.py)
            served = served_digest(self.store)
            self.restores += 1
            self.mark_recovered(f"restored {directory}")
        return ps_pb2.RestoreResponse(rows=rows, step=step, served=[
            ps_pb2.TableDigest(table=t, rows=int(d["rows"]), sha256=str(d["sha256"])) for t, d in served.items()])

    def _confined(self, directory: str, method: str, also: str | None = None) -> str:
        """``directory`` resolved under :attr:`checkpoint_root` (or exactly ``also``), else
        PERMISSION_DENIED (nothing touched)."""
        if self.checkpoint_root is None:
            return directory
        from common.paths import PathNotAllowed, confine

        if also and os.path.realpath(directory) == os.path.realpath(also):
            return os.path.realpath(also)
        try:
            return str(confine(directory, self.checkpoint_root))
        except PathNotAllowed as exc:
            log.warning("path refused", extra=kv(shard=self.shard_id, method=method, error=str(exc)))
            raise RpcAbort(grpc.StatusCode.PERMISSION_DENIED, f"{method}: {exc}") from None

    def stats(self) -> dict[str, Any]:
        return {
            "shard": self.shard_id,
            "map_version": self._pmap.version,
            "owned_vshards": int(self._owned.sum()),
            "paused": self._gate.paused,
            "clocks": self.clock.snapshot(),
            "clocks_expired": self.clock.expired_total,
            "expired_workers": self.clock.expired(),
            "awaiting_recovery": self.awaiting_recovery,
            "memory_bytes": int(self.store.memory_bytes()),
            "store": self.store.stats(),
        }

    @_rpc(data=False)
    def Stats(self, request: ps_pb2.StatsRequest, context: grpc.ServicerContext) -> ps_pb2.StatsResponse:
        return ps_pb2.StatsResponse(json=json.dumps(self.stats(), default=json_default))

    @_rpc(data=False)
    def RegisterWorker(self, request: ps_pb2.RegisterWorkerRequest, context: grpc.ServicerContext) -> ps_pb2.RegisterWorkerResponse:
        if not request.worker_id:
            raise bad("RegisterWorker needs a worker_id")
        if request.step < 0:
            raise bad(f"RegisterWorker: step must be >= 0, got {request.step}")
        if request.leave:
            return ps_pb2.RegisterWorkerResponse(workers=self.clock.leave(request.worker_id), clock=0)
        clock = self.clock.join(request.worker_id, int(request.step))
        return ps_pb2.RegisterWorkerResponse(workers=len(self.clock.snapshot()), clock=clock)

    @_rpc(data=False)
    def Barrier(self, request: ps_pb2.BarrierRequest, context: grpc.ServicerContext) -> ps_pb2.BarrierResponse:
        """Arrive + poll, never blocks: OK once every registered worker completed ``step``,
        else ABORTED "stale_wait" (the client asks again) with ``metaps-wait-timeout`` =
        the client's timeout capped to ``wait_timeout_s``."""
        if not request.worker_id:
            raise bad("Barrier needs a worker_id")
        if request.step < 0:
            raise bad(f"Barrier: step must be >= 0, got {request.step}")
        t = request.timeout_s
        if not math.isfinite(t) or t < 0:
            raise bad(f"Barrier: timeout_s must be a finite number >= 0, got {t}")
        timeout = min(t or self.wait_timeout_s, self.wait_timeout_s)
        if self.awaiting_recovery:
            raise self._awaiting("Barrier", grpc.StatusCode.UNAVAILABLE)
        behind = self.clock.arrive(request.worker_id, int(request.step))
        if behind is not None:
            raise RpcAbort(
                grpc.StatusCode.ABORTED,
                behind.message,
                ((ERROR_KEY, STALE_WAIT), (MIN_CLOCK_KEY, str(behind.min_clock)), (WAIT_TIMEOUT_KEY, f"{timeout:.3f}")),
            )
        m = self.clock.min_clock()
        return ps_pb2.BarrierResponse(min_clock=-1 if m is None else m)

