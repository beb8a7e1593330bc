"""The worker-side PS client: dedup, route, fan out, retry, reassemble.

A pull of several tables becomes at most one ``PullMany`` per shard (more
only when a request would exceed the row or message limit), all in flight at
once; a push likewise with ``PushMany``::

    ids (any order, duplicates)        np.unique(return_inverse)
    [7 3 7 9 3 5]  ---------------->   uniq [3 5 7 9], inv [2 0 2 3 0 1]
                                        | vshard_of(uniq) -> owners[...] -> shard
                                        | argsort by shard, split
                  shard 0: [3 9]  shard 1: [5 7]     (PullMany futures in parallel)
                                        | scatter replies into rows_uniq[4, dim]
    rows = rows_uniq[inv]  <------------+

Pushes aggregate gradients per id (``index_add``) before sending, so each id
travels once per step. Ids that are already unique (``_all_unique``: no full sort in the common cases)
skip ``np.unique``: they travel in request order, and a pull's reply needs no
gather back, a push's gradients no reordering. The routing itself (owner split, chunking, request
building, scatter) is pure and lives in ``ps/routing.py``; :meth:`PsClient.pull`
and :meth:`PsClient.push` are short methods over one fan-out/retry loop
(``PsClient._fan_out``). A worker's step goes as one message per shard
(:meth:`PsClient.step_groups`, ``ps/step_frame.py``: push, dense, next pull), with the
ordinary calls as its fallback. Failures are handled per shard sub-request:

* ``UNAVAILABLE`` (a PS restarting): back off exponentially and resend, up to
  ``retry_timeout_s``, with a log line when it starts and when it recovers;
* ``FAILED_PRECONDITION`` + ``wrong_owner`` (a vshard moved, or the map
  changed): refresh the map from every shard and re-route only the refused part
  (a refused request was not applied, so nothing is applied twice);
* ``RESOURCE_EXHAUSTED`` (too many rows / bytes, or a reply over the message
  limit): resend in requests of the shard's ``metaps-max-rows`` hint (else half);
* ``ABORTED`` + ``stale_wait`` (this worker is ahead of the staleness bound, or a
  barrier is not reached yet) or ``paused`` (checkpoint): the shard did nothing
  and held no thread; wait *here* with short backoff (1 ms doubling to 50 ms) and
  ask again, until the bound is met or the wait time is spent (the client's
  ``wait_timeout_s`` capped by the shard's ``metaps-wait-timeout``), then
  :class:`PsStalenessTimeout` (``DEADLINE_EXCEEDED``) with the shard's message;
  every such wait is counted with its seconds in :attr:`PsClient.waits` (:class:`StaleWaits`);
* ``UNAVAILABLE`` + ``awaiting_recovery`` (a restarted shard the controller has not
  restored yet): retried like any UNAVAILABLE;
* ``FAILED_PRECONDITION`` + ``clock_expired`` (this worker's step clock lease ran out
  on that shard: it was silent longer than ``[ps] clock_lease_s``): re-register on
  that shard (``RegisterWorker``; it rejoins at no less than the slowest clock there),
  log it, count it in :attr:`PsClient.rejoins` and resend (nothing was applied);
* anything else (bad input): :class:`PsRequestError` with the server's message.

Rows per request are planned from each table's dim against the message limit
(the reply of a pull, values of a push), so a 100k-id pull at dim 128 fits
whatever the limit; the dim is learned from the first reply (or the shard's
hint when that first request was too large).

Example::

    client = PsClient(["127.0.0.1:5000", "127.0.0.1:5001"], RpcConfig(token="t"), worker_id="w0")
    rows = client.pull({"user": user_ids, "item": item_ids})        # dict -> float32 [n, dim]
    client.push({"user": (user_ids, user_grads)}, step=12)
    fut = client.pull_async({"user": next_ids})                     # overlap with compute
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import logging
import threading
import time
from typing import Any, Callable, Iterable, Mapping

import grpc
import numpy as np
import torch

from common.errors import MetapsError
from common.log import kv
from common.rpc import RpcConfig, make_channel
from ps import frame, group_frame, routing, step_frame, wire
from ps.partition_map import PartitionMap, dense_owner
from ps.types import (
    StepResult,
    CLOCK_EXPIRED, ERROR_KEY, MAX_ROWS_KEY, PAUSED, PUSH_COUNT_FIELDS, REPLY_LIMIT_KEY, STALE_WAIT, WAIT_TIMEOUT_KEY,
    WRONG_OWNER,
)
from protos import ps_pb2, ps_pb2_grpc

log = logging.getLogger(__name__)


class PsClientError(MetapsError):
    """The PS could not serve a request."""


class PsRequestError(PsClientError):
    """A shard refused a request as invalid (the server's message says why)."""

    def __init__(self, message: str, code: grpc.StatusCode) -> None:
        super().__init__(message)
        self.code = code


class PsStalenessTimeout(PsRequestError):
    """A worker waited for slower workers (staleness bound, barrier) longer than allowed."""

    def __init__(self, message: str) -> None:
        super().__init__(message, grpc.StatusCode.DEADLINE_EXCEEDED)


class PsUnavailableError(PsClientError):
    """A shard stayed unreachable for longer than the retry budget."""


def _rpc_kind(err: grpc.RpcError) -> str:
    code = err.code()
    if code == grpc.StatusCode.FAILED_PRECONDITION:
        md = dict(err.trailing_metadata() or ())
        if md.get(ERROR_KEY) == WRONG_OWNER:
            return "wrong_owner"
        if md.get(ERROR_KEY) == CLOCK_EXPIRED:
            return "clock_expired"
    if code == grpc.StatusCode.ABORTED:
        reason = dict(err.trailing_metadata() or ()).get(ERROR_KEY)
        if reason == STALE_WAIT:
            return "wait"
        if reason == PAUSED:
            return "paused"
    if code == grpc.StatusCode.UNAVAILABLE:
        return "unavailable"
    if code == grpc.StatusCode.RESOURCE_EXHAUSTED:
        return "split"
    return "fatal"


def _md_float(err: grpc.RpcError, key: str) -> float | None:
    try:
        v = float(dict(err.trailing_metadata() or ()).get(key, ""))
    except ValueError:
        return None
    return v if v == v else None


class StaleWaits:
    """How long this client waited for slower workers (staleness bound, barriers), by call kind.

    A *wait* is one call (pull, push, barrier) that a shard told to ask again
    (``stale_wait``); its seconds run from the first such answer until the call
    returns or gives up. A wait in progress counts at once, and its seconds so
    far are in :meth:`totals` (they only grow: a Prometheus counter can read them).

    Example::

        client.waits.totals()   # {"pull": (3, 0.42)}: 3 waits, 0.42 s in all
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._done: dict[str, tuple[int, float]] = {}
        self._active: dict[int, tuple[str, float]] = {}
        self._next = 0

    def begin(self, kind: str) -> int:
        """A call of ``kind`` starts waiting; returns the token for :meth:`end`."""
        with self._lock:
            self._next += 1
            self._active[self._next] = (kind, time.monotonic())
            return self._next

    def end(self, token: int) -> None:
        """The wait ``token`` is over (the call went through or gave up)."""
        with self._lock:
            kind, start = self._active.pop(token)
            n, secs = self._done.get(kind, (0, 0.0))
            self._done[kind] = (n + 1, secs + time.monotonic() - start)

    def totals(self) -> dict[str, tuple[int, float]]:
        """kind -> (waits, seconds), waits in progress included."""
        with self._lock:
            out = dict(self._done)
            now = time.monotonic()
            for kind, start in self._active.values():
                n, secs = out.get(kind, (0, 0.0))
                out[kind] = (n + 1, secs + now - start)
            return out


class _Waiter:
    """Client-side wait for slower workers: backoff 1 ms doubling to 50 ms, bounded time.

    Args:
        own_limit_s: the caller's own bound (None: only the shard's cap).
        backoff_s, max_backoff_s: first and largest pause between asks.
        waits / kind: where the wait is accounted (:class:`StaleWaits`), under which call kind.
    """

    def __init__(self, own_limit_s: float | None, backoff_s: float, max_backoff_s: float,
                 waits: StaleWaits | None = None, kind: str = "") -> None:
        self.limit = own_limit_s if own_limit_s else float("inf")
        self.start: float | None = None
        self.delay = backoff_s
        self.max_delay = max_backoff_s
        self.last: tuple[int, grpc.RpcError] | None = None
        self._waits, self._kind, self._token = waits, kind, 0

    def finish(self) -> None:
        """The call is over: close its wait in :class:`StaleWaits` (if it waited)."""
        if self._token and self._waits is not None:
            self._waits.end(self._token)
        self._token = 0

    def __enter__(self) -> "_Waiter":
        return self

    def __exit__(self, *exc: object) -> None:
        self.finish()

    def behind(self, shard: int, err: grpc.RpcError) -> None:
        """A shard said stale_wait: start the clock, adopt its cap."""
        if self.start is None:
            self.start = time.monotonic()
            if self._waits is not None:
                self._token = self._waits.begin(self._kind)
        cap = _md_float(err, WAIT_TIMEOUT_KEY)
        if cap is not None:
            self.limit = min(self.limit, cap)
        self.last = (shard, err)

    def check(self, what: str, addresses: list[str]) -> None:
        """Raise PsStalenessTimeout once the wait time is spent."""
        if self.start is None or self.last is None:
            return
        waited = time.monotonic() - self.start
        if waited >= self.limit:
            s, err = self.last
            raise PsStalenessTimeout(
                f"shard {s} ({addresses[s]}) refused {what}: DEADLINE_EXCEEDED: {err.details()} "
                f"(waited {waited:.1f}s, limit {self.limit:.1f}s)"
            )

    def sleep(self) -> float:
        d = self.delay
        time.sleep(d)
        self.delay = min(self.delay * 2, self.max_delay)
        return d


class PsClient:
    """Client of a PS fleet (one address per shard, in shard-id order).

    Args:
        addresses: ``host:port`` of shard 0..N-1.
        rpc_cfg: token, TLS, message limits, per-call timeout.
        value_dtype: "fp32" or "fp16" for pulled rows on the wire (returned as float32).
        grad_dtype: "fp32" or "fp16" for pushed gradients on the wire.
        worker_id: this worker's id (bounded staleness, barriers); '' = anonymous.
        max_request_rows: rows per RPC at most (0: only the message limit bounds it).
        retry_timeout_s: how long one call keeps retrying an unavailable shard.
        backoff_s / max_backoff_s: first and largest retry pause.
        wait_timeout_s: longest this worker waits for slower workers (staleness bound, barriers)
            before :class:`PsStalenessTimeout`; None: the shard's cap (``[ps] wait_timeout_s``).
        wait_backoff_s / max_wait_backoff_s: first and largest pause between asks while waiting.
        register: register ``worker_id`` with every shard (its clock starts at ``start_step``,
            or where the shards say: :attr:`registered_clock`).
        start_step: the worker's clock when it registers (steps already completed).
        framed: pull and push through the framed data plane (``ps/frame.py``: PullFrame /
            PushFrame, raw bytes with a fixed header, no protobuf on the hot path); False:
            the protobuf PullMany / PushMany (the same results bit for bit). A shard that
            answers UNIMPLEMENTED (an older build) switches the client to protobuf for good.

    Attributes:
        registered_clock: the clock the shards answered at the last registration
            (:meth:`join_clock`): a restarted worker's old clock, or at least the
            slowest clock present; the worker numbers its steps from it.
        rejoins: how often a shard told this worker its clock lease had expired.
        waits: time spent waiting for slower workers (:class:`StaleWaits`).
        stale_wait_s: seconds spent waiting for slower workers (staleness bound, barriers) so
            far, all kinds (from ``waits``); a worker reports its batch times without it (its
            own speed, for the monitor).
    """

    def __init__(
        self,
        addresses: list[str],
        rpc_cfg: RpcConfig | None = None,
        *,
        value_dtype: str = "fp32",
        grad_dtype: str = "fp32",
        worker_id: str = "",
        max_request_rows: int = 0,
        retry_timeout_s: float = 60.0,
        backoff_s: float = 0.05,
        max_backoff_s: float = 2.0,
        wait_timeout_s: float | None = None,
        wait_backoff_s: float = 0.001,
        max_wait_backoff_s: float = 0.05,
        register: bool = False,
        start_step: int = 0,
        framed: bool = True,
    ) -> None:
        if not addresses:
            raise ValueError("PsClient needs at least one shard address")
        self.addresses = list(addresses)
        self.rpc_cfg = rpc_cfg or RpcConfig()
        # our receive limit travels with each call, so a shard with a larger send limit sizes replies to us
        self._reply_limit_md = ((REPLY_LIMIT_KEY, str(self.rpc_cfg.max_message_bytes)),)
        self.value_dtype = wire.DType(value_dtype)
        self.grad_dtype = wire.DType(grad_dtype)
        self.worker_id = worker_id
        self.max_request_rows = max_request_rows
        self.retry_timeout_s = retry_timeout_s
        self.backoff_s = backoff_s
        self.max_backoff_s = max_backoff_s
        self.wait_timeout_s = wait_timeout_s
        self.wait_backoff_s = wait_backoff_s
        self.max_wait_backoff_s = max_wait_backoff_s
        self._channels = [make_channel(a, self.rpc_cfg) for a in self.addresses]
        self._stubs = [ps_pb2_grpc.ParameterServerStub(c) for c in self._channels]
        # PullMany replies parsed around their row bytes (views, no protobuf copies): ps.wire.decode_pull_reply
        self._pull_many = [
            c.unary_unary("/metaps.ps.ParameterServer/PullMany", request_serializer=ps_pb2.PullManyRequest.SerializeToString,
                          response_deserializer=wire.decode_pull_reply)
            for c in self._channels
        ]
        # PushMany requests serialized around the gradient buffers: ps.routing.push_request_bytes
        self._push_many = [
            c.unary_unary("/metaps.ps.ParameterServer/PushMany", request_serializer=None,
                          response_deserializer=ps_pb2.PushManyResponse.FromString)
            for c in self._channels
        ]
        # The framed data plane (ps/frame.py: generic byte handlers, no protobuf on the hot path)
        self.framed = framed
        self._pull_frame = [c.unary_unary(frame.PULL_PATH, request_serializer=None, response_deserializer=frame.decode_pull_reply)
                            for c in self._channels]
        self._push_frame = [c.unary_unary(frame.PUSH_PATH, request_serializer=None, response_deserializer=frame.decode_push_reply)
                            for c in self._channels]
        # One message per shard per step (ps/step_frame.py); off after a shard answers UNIMPLEMENTED
        self.step_frames = framed
        self._step_frame = [c.unary_unary(step_frame.STEP_PATH, request_serializer=None, response_deserializer=None)
                            for c in self._channels]
        self._dense_plans: dict[tuple[tuple[str, ...], tuple[int, ...], int], dict[int, _DensePart]] = {}
        self._dims: dict[str, int] = {}
        self._row_cap: int | None = None  # learned from RESOURCE_EXHAUSTED
        self._map_lock = threading.Lock()
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=2, thread_name_prefix="ps-client")
        self._down: set[int] = set()
        self.registered_clock = 0
        self.rejoins = 0
        self.waits = StaleWaits()
        self._pmap: PartitionMap = self.refresh_map()
        if self._pmap.num_shards != len(self.addresses):
            raise PsClientError(
                f"partition map has {self._pmap.num_shards} shards but {len(self.addresses)} addresses were given"
            )
        if register:
            if not worker_id:
                raise ValueError("register=True needs a worker_id")
            self.join_clock(start_step)

    # -- lifecycle ------------------------------------------------------------------
    def close(self, leave: bool = False) -> None:
        """Close channels; ``leave`` first unregisters the worker so it holds nobody back."""
        if leave and self.worker_id:
            try:
                self._broadcast("RegisterWorker", ps_pb2.RegisterWorkerRequest(worker_id=self.worker_id, leave=True))
            except PsClientError as exc:
                log.warning("could not unregister worker", extra=kv(worker=self.worker_id, error=exc))
        self._pool.shutdown(wait=False)
        for c in self._channels:
            c.close()

    def leave_clock(self) -> None:
        """Stop counting this worker in bounded staleness (e.g. while it waits for data).

        A worker idle on the data queue would otherwise freeze the slowest clock,
        and workers more than ``max_staleness`` steps ahead would block forever.
        """
        if self.worker_id:
            self._broadcast("RegisterWorker", ps_pb2.RegisterWorkerRequest(worker_id=self.worker_id, leave=True))

    def join_clock(self, step: int) -> int:
        """Register (again) on every shard from ``step``; returns the clock the fleet gave it.

        Each shard answers the worker's clock there: its old clock when the worker is
        still known (a restarted process resumes), else at least the slowest clock of
        the workers present. When shards differ (one restarted and lost its clocks) the
        worker registers again at the largest, so every shard counts it alike.

        Args:
            step: the clock (steps completed) the worker believes it has.

        Returns:
            the clock to number the next steps from (also :attr:`registered_clock`).
        """
        if not self.worker_id:
            return step
        clocks = [int(r.clock) for r in self._broadcast(
            "RegisterWorker", ps_pb2.RegisterWorkerRequest(worker_id=self.worker_id, step=step))]
        clock = max(clocks + [step])
        if any(c != clock for c in clocks):
            self._broadcast("RegisterWorker", ps_pb2.RegisterWorkerRequest(worker_id=self.worker_id, step=clock))
        if clock != step:
            log.info("worker clock taken from the PS", extra=kv(worker=self.worker_id, asked=step, clock=clock))
        self.registered_clock = clock
        return clock

    def _rejoin(self, shard: int, exc: grpc.RpcError) -> None:
        """A shard expired this worker's clock lease: register there again (see the module doc)."""
        self.rejoins += 1
        resp = self._stubs[shard].RegisterWorker(ps_pb2.RegisterWorkerRequest(worker_id=self.worker_id, step=0),
                                                 timeout=self.rpc_cfg.timeout_s)
        log.warning("step clock lease expired on a shard; rejoined",
                    extra=kv(worker=self.worker_id, shard=shard, clock=int(resp.clock), error=exc.details()))

    def __enter__(self) -> "PsClient":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def num_shards(self) -> int:
        return len(self.addresses)

    @property
    def pmap(self) -> PartitionMap:
        return self._pmap

    # -- partition map ------------------------------------------------------------------
    def refresh_map(self) -> PartitionMap:
        """Fetch the map from every reachable shard; keep the newest; heal lagging shards."""
        deadline = time.monotonic() + self.retry_timeout_s
        delay = self.backoff_s
        while True:
            futs = [s.GetPartitionMap.future(ps_pb2.GetPartitionMapRequest(), timeout=self.rpc_cfg.timeout_s) for s in self._stubs]
            maps: list[PartitionMap | None] = []
            last_err: grpc.RpcError | None = None
            for f in futs:
                try:
                    maps.append(PartitionMap.from_proto(f.result()))
                except grpc.RpcError as exc:
                    if _rpc_kind(exc) != "unavailable":
                        raise PsRequestError(f"GetPartitionMap failed: {exc.details()}", exc.code()) from None
                    maps.append(None)
                    last_err = exc
            live = [m for m in maps if m is not None]
            if live:
                break
            if time.monotonic() > deadline:
                raise PsUnavailableError(f"no PS shard reachable at {self.addresses}: {last_err.details() if last_err else ''}")
            time.sleep(delay)
            delay = min(delay * 2, self.max_backoff_s)
        newest = max(live, key=lambda m: m.version)
        for i, m in enumerate(maps):
            if m is not None and m.version < newest.version:
                # A shard that missed an update (e.g. restarted) gets the newest map.
                try:
                    self._stubs[i].UpdatePartitionMap(newest.to_proto(), timeout=self.rpc_cfg.timeout_s)
                    log.info("pushed newer partition map to lagging shard", extra=kv(shard=i, version=newest.version))
                except grpc.RpcError as exc:
                    log.warning("could not update lagging shard's map", extra=kv(shard=i, error=exc.details()))
        with self._map_lock:
            if not hasattr(self, "_pmap") or newest.version >= self._pmap.version:
                self._pmap = newest
        return self._pmap

    # -- sparse ---------------------------------------------------------------------------
    def pull(self, ids: Mapping[str, Any], *, step: int | None = None) -> dict[str, np.ndarray]:
        """Rows of ``ids`` per table, in request order (float32 [n, dim]).

        Args:
            ids: table -> int64 ids (numpy or torch, any shape is flattened; duplicates fine).
            step: this worker's training step (bounded staleness waits on the PS).
        """
        jobs: list[routing.Job] = []
        inverse: list[np.ndarray | None] = []
        for table, t_ids in ids.items():
            flat = _as_ids(t_ids, table)
            if _all_unique(flat):  # sent in request order: the reply needs no gather back
                jobs.append(routing.Job(table, flat))
                inverse.append(None)
                continue
            uniq, inv = np.unique(flat, return_inverse=True)
            jobs.append(routing.Job(table, uniq))
            inverse.append(inv)
        fp16 = self.value_dtype == wire.DType.FP16

        def request(pieces: list[routing.Piece], pmap: PartitionMap) -> ps_pb2.PullManyRequest | bytes:
            if self.framed:
                return frame.encode_pull_request([(jobs[j].table, jobs[j].ids, _positions(jobs[j], p)) for j, p in pieces],
                                                 map_version=pmap.version, fp16=fp16, worker_id=self.worker_id, step=step)
            return routing.pull_request(jobs, pieces, map_version=pmap.version, fp16=fp16, worker_id=self.worker_id, step=step)

        self._fan_out("pull", jobs, request, lambda pieces, resp: routing.scatter_pull(jobs, pieces, resp, self._dims),
                      probe=[i for i, j in enumerate(jobs) if j.table not in self._dims])
        routing.finish_pull(jobs, self._dims)
        # torch.index_select: a row gather ~3x faster than numpy fancy indexing here.
        return {
            j.table: _writable(j.out) if inv is None or routing.is_identity(inv)
            else routing.as_tensor(j.out).index_select(0, torch.from_numpy(inv)).numpy()
            for j, inv in zip(jobs, inverse) if j.out is not None
        }

    def pull_async(
        self, ids: Mapping[str, Any], *, step: int | None = None
    ) -> concurrent.futures.Future[dict[str, np.ndarray]]:
        """:meth:`pull` on a background thread; ``.result()`` gives its dict."""
        frozen = {t: np.array(_as_ids(v, t)) for t, v in ids.items()}
        return self._pool.submit(self.pull, frozen, step=step)

    def push(self, grads: Mapping[str, tuple[Any, Any]], *, step: int | None = None) -> dict[str, dict[str, int]]:
        """Apply gradients: table -> (ids [n], grads [n, dim]); duplicates are summed first.

        With ``step`` (and a worker_id) every shard learns this worker finished
        ``step``, even shards that got no rows from it.

        Returns:
            table -> counts summed over shards: rows (unique ids) and the
            ``ps.embedding_table.PushResult`` fields (applied, nonfinite_dropped, ...).
        """
        jobs = []
        for table, (t_ids, t_grads) in grads.items():
            flat = _as_ids(t_ids, table)
            g = t_grads.detach().to("cpu", torch.float32) if isinstance(t_grads, torch.Tensor) else torch.from_numpy(
                np.ascontiguousarray(t_grads, dtype=np.float32)
            )
            if g.ndim != 2 or g.shape[0] != flat.size:
                raise ValueError(f"table '{table}': grads must be [n={flat.size}, dim], got shape {tuple(g.shape)}")
            if _all_unique(flat):  # sent in request order (the shard takes unique ids in any order)
                jobs.append(routing.Job(table, flat, grads=g.numpy()))
                continue
            uniq, inv = np.unique(flat, return_inverse=True)
            agg = torch.zeros((uniq.size, g.shape[1]), dtype=torch.float32).index_add_(0, torch.from_numpy(inv), g).numpy()
            jobs.append(routing.Job(table, uniq, grads=agg))
        counts = routing.new_counts(jobs)

        def request(pieces: list[routing.Piece], pmap: PartitionMap) -> bytes:
            if self.framed:
                return frame.encode_push_request(
                    [(jobs[j].table, jobs[j].ids, _grads(jobs[j]), _positions(jobs[j], p)) for j, p in pieces],
                    grad_dtype=self.grad_dtype, map_version=pmap.version, worker_id=self.worker_id, step=step)
            return routing.push_request_bytes(jobs, pieces, map_version=pmap.version, grad_dtype=self.grad_dtype,
                                              worker_id=self.worker_id, step=step)

        # With a step, every shard must hear it (clocks), even shards with no rows.
        self._fan_out("push", jobs, request, lambda pieces, resp: routing.add_push_counts(counts, resp),
                      clock=step is not None and bool(self.worker_id))
        return counts

    def pull_groups(self, tables: list[tuple[str, ...]], counts: list[np.ndarray], ids: list[torch.Tensor],
                    dims: list[int], *, step: int | None = None) -> list[torch.Tensor]:
        """Rows of a step's tables grouped as the shards store them (``ps.grouping``).

        Each group travels as one job: routed at once (one vshard hash over its ids), sent
        as its tables' sections of one frame per shard, and its reply rows (one run of
        bytes per shard) land in one ``[N_g, dim]`` output. The ids are the caller's unique
        ids per table (a worker's Meta-IO batch): no deduplication here.

        Args:
            tables: per group, its tables (storage order).
            counts: per group, int64 [tables]: ids per table.
            ids: per group, int64 [N_g]: the tables' unique ids, table by table.
            dims: per group, its dim.
            step: this worker's training step (bounded staleness).

        Returns:
            per group, float32 [N_g, dim] rows in ``ids`` order.
        """
        if not self.framed:  # protobuf PullMany (an older shard): table by table
            return self._pull_groups_per_table(tables, counts, ids, dims, step)
        jobs = [routing.Job(names[0], _as_ids(g, names[0]), sections=(names, c))
                for names, c, g in zip(tables, counts, ids)]
        self._fan_out("pull", jobs, self._pull_groups_request(jobs, step),
                      lambda pieces, resp: _scatter_groups(jobs, pieces, resp, self._dims))
        out = []
        for job, dim in zip(jobs, dims):
            rows = job.out if job.out is not None else np.empty((job.ids.size, dim), dtype=np.float32)
            out.append(torch.from_numpy(_writable(rows)))
        return out

    def _pull_groups_per_table(self, tables: list[tuple[str, ...]], counts: list[np.ndarray], ids: list[torch.Tensor],
                               dims: list[int], step: int | None) -> list[torch.Tensor]:
        by_table: dict[str, Any] = {}
        for names, c, g_ids in zip(tables, counts, ids):
            by_table.update((t, v) for t, v in zip(names, torch.split(g_ids, c.tolist())) if v.numel())
        got = self.pull(by_table, step=step)
        out = []
        for names, c, dim in zip(tables, counts, dims):
            parts = [torch.from_numpy(got[t]) for t, n in zip(names, c.tolist()) if n]
            out.append(torch.cat(parts) if parts else torch.empty((0, dim), dtype=torch.float32))
        return out

    def pull_groups_async(self, tables: list[tuple[str, ...]], counts: list[np.ndarray], ids: list[torch.Tensor],
                          dims: list[int], *, step: int | None = None) -> concurrent.futures.Future[list[torch.Tensor]]:
        """:meth:`pull_groups` on a background thread."""
        return self._pool.submit(self.pull_groups, tables, counts, ids, dims, step=step)

    def push_groups(self, tables: list[tuple[str, ...]], counts: list[np.ndarray], ids: list[torch.Tensor],
                    grads: list[torch.Tensor], *, step: int | None = None) -> dict[str, dict[str, int]]:
        """Apply a step's gradients grouped as the shards store them (see :meth:`pull_groups`).

        Args:
            grads: per group, float32 [N_g, dim], rows in ``ids`` order.

        Returns:
            as :meth:`push` (table -> counts summed over shards).
        """
        if not self.framed:
            by_table: dict[str, tuple[Any, Any]] = {}
            for names, c, g_ids, g in zip(tables, counts, ids, grads):
                sizes = c.tolist()
                by_table.update((t, (i, gg)) for t, i, gg in zip(names, torch.split(g_ids, sizes), torch.split(g, sizes))
                                if i.numel())
            return self.push(by_table, step=step)
        jobs = _push_group_jobs(tables, counts, ids, grads)
        counts_out = _group_counts(tables)
        self._fan_out("push", jobs, self._push_groups_request(jobs, step),
                      lambda pieces, resp: routing.add_push_counts(counts_out, resp),
                      clock=step is not None and bool(self.worker_id))
        return counts_out

    def _push_groups_request(self, jobs: list[routing.Job], step: int | None) -> Callable[[list[routing.Piece], PartitionMap], bytes]:
        def request(pieces: list[routing.Piece], pmap: PartitionMap) -> bytes:
            return frame.encode_push_request([(t, jobs[j].ids[rows], _grads(jobs[j])[rows], at) for j, p in pieces
                                              for t, rows, at in _group_entries(jobs[j], p)],
                                             grad_dtype=self.grad_dtype, map_version=pmap.version,
                                             worker_id=self.worker_id, step=step)
        return request

    def _pull_groups_request(self, jobs: list[routing.Job], step: int | None) -> Callable[[list[routing.Piece], PartitionMap], bytes]:
        fp16 = self.value_dtype == wire.DType.FP16

        def request(pieces: list[routing.Piece], pmap: PartitionMap) -> bytes:
            return frame.encode_pull_request([(t, jobs[j].ids[rows], at) for j, p in pieces
                                              for t, rows, at in _group_entries(jobs[j], p)],
                                             map_version=pmap.version, fp16=fp16, worker_id=self.worker_id, step=step)
        return request

    # -- one message per shard per step ---------------------------------------------------------
    def step_groups(self, *, push: GroupPush | None = None, dense: DenseFlat | None = None,
                    pull: GroupPull | None = None, step: int | None = None, want_values: bool = True) -> StepResult:
        """A worker step's traffic in one message per shard (``ps/step_frame.py``): the push of
        ``step``, the dense gradients (their new values back), then the next batch's pull.

        Each shard applies the push and the dense gradients, then serves the pull, so the rows
        include this push (a serial worker's next rows are exact). What a shard could not take
        in the one message (it refused the message before applying anything, it is down, its
        map moved, the pull had to wait or was too big, or it speaks no StepFrame) goes by the
        ordinary calls afterwards, in the same order (push, dense, pull), with their waits,
        retries and map refreshes. Without the framed data plane: the ordinary calls only.

        Args:
            push: per group (tables, counts, ids, grads), as :meth:`push_groups` takes them.
            dense: (names, flat float32 gradients in that order, each one's size).
            pull: per group (tables, counts, ids, dims), as :meth:`pull_groups` takes them.
            step: the step the push completes (its clock; the pull is for ``step + 1``).
            want_values: get the dense parameters' new values back.

        Returns:
            the pulled rows per group, the dense values (flat, in ``dense``'s order) and the push counts.
        """
        push_jobs = _push_group_jobs(*push) if push is not None else []
        pull_jobs = [routing.Job(names[0], _as_ids(g, names[0]), sections=(names, c))
                     for names, c, g in zip(pull[0], pull[1], pull[2])] if pull is not None else []
        counts_out = _group_counts(push[0]) if push is not None else {}  # what goes by the ordinary calls
        totals: dict[int, np.ndarray] = {}  # push job -> its counts from step replies, summed over shards
        names, flat, sizes = dense if dense is not None else ([], np.empty(0, dtype=np.float32), [])
        values = np.empty(flat.size, dtype=np.float32) if dense is not None and want_values else None
        clock = push is not None and step is not None and bool(self.worker_id)
        pull_step = None if step is None else step + 1
        parts = self._dense_parts(list(names), list(sizes)) if dense is not None else {}
        late_push: list[routing.Piece] = []
        late_clock: set[int] = set()
        late_dense: list[int] = []
        late_pull: list[routing.Piece] = []
        pmap = self._pmap
        push_plan = {p.shard: p for p in routing.plan(push_jobs, routing.everything(push_jobs), pmap, 1 << 62,
                                                      every_shard=range(pmap.num_shards) if clock else ())}
        pull_plan = {p.shard: p for p in routing.plan(pull_jobs, routing.everything(pull_jobs), pmap, 1 << 62)}
        shards = sorted(set(push_plan) | set(pull_plan) | set(parts))
        too_big = any(p.rows > self._rows_per_call(jobs, kind) for plan, jobs, kind in
                      ((push_plan, push_jobs, "push"), (pull_plan, pull_jobs, "pull")) for p in plan.values())
        if not self.framed or not self.step_frames or too_big:
            late_push = [pc for p in push_plan.values() for pc in p.pieces]
            late_clock = set(push_plan) if clock else set()
            late_dense, late_pull = sorted(parts), [pc for p in pull_plan.values() for pc in p.pieces]
        else:
            fp16 = self.value_dtype == wire.DType.FP16
            reqs = []
            for s in shards:
                part = parts.get(s)
                msg = step_frame.encode_step(
                    step_frame.REQUEST,
                    push=group_frame.encode_push(
                        [(_names_of(push_jobs[j]), _counts_of(push_jobs[j], pos), push_jobs[j].ids, _grads(push_jobs[j]),
                          _positions(push_jobs[j], pos)) for j, pos in push_plan[s].pieces],
                        grad_dtype=self.grad_dtype, map_version=pmap.version, worker_id=self.worker_id, step=step)
                    if s in push_plan else None,
                    dense=step_frame.encode_dense(part.names, flat if part.pos is None else flat[part.pos], part.sizes)
                    if part is not None else None,
                    pull=group_frame.encode_pull(
                        [(_names_of(pull_jobs[j]), _counts_of(pull_jobs[j], pos), pull_jobs[j].ids,
                          _positions(pull_jobs[j], pos)) for j, pos in pull_plan[s].pieces],
                        fp16=fp16, map_version=pmap.version, worker_id=self.worker_id, step=pull_step)
                    if s in pull_plan else None,
                    flags=step_frame.FLAG_WANT_VALUES if values is not None and part is not None else 0)
                reqs.append((s, msg))
            if len(reqs) == 1:
                s, msg = reqs[0]
                calls = [(s, _Immediate.call(self._step_frame[s], msg, self.rpc_cfg.timeout_s, self._reply_limit_md))]
            else:
                calls = [(s, self._step_frame[s].future(msg, timeout=self.rpc_cfg.timeout_s, metadata=self._reply_limit_md))
                         for s, msg in reqs]
            for s, fut in calls:
                try:
                    reply = step_frame.decode_step(fut.result(), step_frame.REPLY, writable=True)
                except grpc.RpcError as exc:  # nothing of this shard's message was applied
                    if exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                        self.step_frames = False
                        log.warning("ps shard has no StepFrame; a step goes as separate calls",
                                    extra=kv(shard=s, address=self.addresses[s]))
                    elif _rpc_kind(exc) == "fatal":
                        raise PsRequestError(f"shard {s} ({self.addresses[s]}) refused a step: {exc.code().name}: "
                                             f"{exc.details()}", exc.code()) from None
                    elif _rpc_kind(exc) == "unavailable":
                        self._note_down(s, exc)
                    late_push += push_plan[s].pieces if s in push_plan else []
                    late_clock |= {s} if clock and s in push_plan else set()
                    late_dense += [s] if s in parts else []
                    late_pull += pull_plan[s].pieces if s in pull_plan else []
                    continue
                self._note_up(s)
                if s in push_plan and reply.push is not None:
                    _add_group_counts(totals, push_jobs, push_plan[s].pieces,
                                      group_frame.decode(reply.push, group_frame.PUSH_REPLY))
                if values is not None and s in parts:
                    self._take_dense(parts[s], reply.dense, values, s)
                if s in pull_plan:
                    if reply.pull_deferred or reply.pull is None:
                        log.debug("step pull deferred", extra=kv(shard=s, reason=reply.deferred_reason))
                        late_pull += pull_plan[s].pieces
                    else:
                        _scatter_group_rows(pull_jobs, pull_plan[s].pieces,
                                            group_frame.decode(reply.pull, group_frame.PULL_REPLY))
        if late_push or late_clock:
            self._fan_out("push", push_jobs, self._push_groups_request(push_jobs, step),
                          lambda pieces, resp: routing.add_push_counts(counts_out, resp),
                          clock=bool(late_clock), pending=late_push, clock_shards=late_clock)
        if late_dense:
            grads = {n: (flat if parts[s].pos is None else flat[parts[s].pos])[a:b]
                     for s in late_dense for n, a, b in parts[s].spans()}
            got = self.push_dense(grads, return_values=values is not None)
            if values is not None:
                for s in late_dense:
                    part = parts[s]
                    vals = np.concatenate([np.asarray(got[n], dtype=np.float32).reshape(-1) for n in part.names])
                    if part.pos is None:
                        values[:] = vals
                    else:
                        values[part.pos] = vals
        if late_pull:
            self._fan_out("pull", pull_jobs, self._pull_groups_request(pull_jobs, pull_step),
                          lambda pieces, resp: _scatter_groups(pull_jobs, pieces, resp, self._dims), pending=late_pull)
        rows = None
        if pull is not None:
            rows = []
            for job, dim in zip(pull_jobs, pull[3]):
                got_rows = job.out if job.out is not None else np.empty((job.ids.size, dim), dtype=np.float32)
                rows.append(torch.from_numpy(_writable(got_rows)))
        return StepResult(rows=rows, dense=values, other_counts=counts_out,
                          group_counts=[(_names_of(push_jobs[j]), t) for j, t in sorted(totals.items())])

    def _dense_parts(self, names: list[str], sizes: list[int]) -> dict[int, "_DensePart"]:
        """Per shard, the dense parameters it owns among ``names`` (cached per name list)."""
        key = (tuple(names), tuple(int(n) for n in sizes), self.num_shards)
        got = self._dense_plans.get(key)
        if got is None:
            offs = np.concatenate([[0], np.cumsum(np.asarray(sizes, dtype=np.int64))])
            mine: dict[int, list[int]] = {}
            for i, n in enumerate(names):
                mine.setdefault(dense_owner(n, self.num_shards), []).append(i)
            got = {}
            for s, idx in mine.items():
                pos = np.concatenate([np.arange(offs[i], offs[i + 1]) for i in idx]) if idx else np.empty(0, np.int64)
                whole = len(idx) == len(names) and routing.is_identity(pos)
                got[s] = _DensePart([names[i] for i in idx], [int(sizes[i]) for i in idx], None if whole else pos)
            self._dense_plans[key] = got
        return got

    @staticmethod
    def _take_dense(part: "_DensePart", data: memoryview | None, values: np.ndarray, shard: int) -> None:
        """A shard's dense values (a step reply's dense part) into ``values`` at the part's positions."""
        if data is None:
            raise PsRequestError(f"shard {shard}: a step reply without the dense values asked for",
                                 grpc.StatusCode.INTERNAL)
        sec = step_frame.decode_dense(data)
        if sec.names != part.names or sec.sizes != part.sizes:
            raise wire.WireError(f"step reply from shard {shard}: dense values for {sec.names}, asked for {part.names}")
        if part.pos is None:
            values[:] = sec.flat
        else:
            values[part.pos] = sec.flat

    def barrier(self, step: int, timeout_s: float | None = None) -> None:
        """Sync mode: return once every registered worker finished ``step`` on every shard.

        Each shard is asked (arrive + poll; the shard never blocks) until it answers OK;
        waiting happens here, with short backoff.

        Args:
            step: the step every worker must have completed.
            timeout_s: longest wait (default: ``wait_timeout_s``, else the shard's cap).

        Raises:
            PsStalenessTimeout: some worker did not reach ``step`` in time.
        """
        if not self.worker_id:
            raise ValueError("barrier needs a worker_id")
        t = timeout_s or self.wait_timeout_s or 0.0
        req = ps_pb2.BarrierRequest(worker_id=self.worker_id, step=step, timeout_s=t)
        with self._waiter(t or None, "barrier") as waiter:
            pending = set(range(self.num_shards))
            deadline = time.monotonic() + self.retry_timeout_s
            delay = self.backoff_s
            while pending:
                futs = {s: self._stubs[s].Barrier.future(req, timeout=self.rpc_cfg.timeout_s) for s in sorted(pending)}
                down = False
                for s, fut in futs.items():
                    try:
                        fut.result()
                    except grpc.RpcError as exc:
                        what = _rpc_kind(exc)
                        if what in ("wait", "paused"):
                            waiter.behind(s, exc)
                        elif what == "clock_expired":
                            self._rejoin(s, exc)
                        elif what == "unavailable":
                            self._note_down(s, exc)
                            down = True
                        else:
                            raise PsRequestError(f"shard {s} ({self.addresses[s]}) Barrier: {exc.details()}", exc.code()) from None
                        continue
                    self._note_up(s)
                    pending.discard(s)
                if not pending:
                    break
                waiter.check(f"barrier of step {step}", self.addresses)
                if down:
                    if time.monotonic() + delay > deadline:
                        raise PsUnavailableError(f"barrier of step {step}: shards {sorted(self._down)} unavailable for "
                                                 f"{self.retry_timeout_s:.0f}s")
                    time.sleep(delay)
                    delay = min(delay * 2, self.max_backoff_s)
                else:
                    deadline += waiter.sleep()  # waiting for slower workers is not retry time

    @property
    def stale_wait_s(self) -> float:
        """Seconds spent waiting for slower workers so far, all call kinds (from :attr:`waits`)."""
        return sum(secs for _, secs in self.waits.totals().values())

    def _waiter(self, own_limit_s: float | None, kind: str) -> _Waiter:
        return _Waiter(own_limit_s, self.wait_backoff_s, self.max_wait_backoff_s, self.waits, kind)

    # -- dense ------------------------------------------------------------------------------
    def register_dense(self, params: Mapping[str, Any], *, overwrite: bool = False) -> list[str]:
        """Create dense parameters with initial values (existing names keep theirs unless ``overwrite``)."""
        by_shard: dict[int, list[ps_pb2.DenseTensor]] = {}
        for name, value in params.items():
            by_shard.setdefault(dense_owner(name, self.num_shards), []).append(wire.dense_to_proto(name, value))
        created: list[str] = []
        requests = {s: ps_pb2.RegisterDenseRequest(params=p, overwrite=overwrite) for s, p in by_shard.items()}
        for resp in self._per_shard("RegisterDense", requests):
            created.extend(resp.created)
        return created

    def set_dense(self, values: Mapping[str, Any]) -> None:
        """Store these dense values on the PS (registering new names): all-reduce workers publish their params."""
        self.register_dense(values, overwrite=True)

    def pull_dense(self, names: Iterable[str]) -> dict[str, np.ndarray]:
        by_shard: dict[int, list[str]] = {}
        for n in names:
            by_shard.setdefault(dense_owner(n, self.num_shards), []).append(n)
        out: dict[str, np.ndarray] = {}
        for resp in self._per_shard("PullDense", {s: ps_pb2.PullDenseRequest(names=n) for s, n in by_shard.items()}):
            out.update({p.name: wire.dense_from_proto(p) for p in resp.params})
        return out

    def push_dense(self, grads: Mapping[str, Any], *, return_values: bool = False) -> dict[str, np.ndarray]:
        """Apply dense gradients on the shards owning them.

        Args:
            grads: name -> gradient.
            return_values: also get the parameters' new values back in the same round trip
                (what a worker loads next: one RPC per step instead of a push and a pull).

        Returns:
            name -> new value with ``return_values`` (every pushed name), else {}.
        """
        by_shard: dict[int, list[ps_pb2.DenseTensor]] = {}
        for name, g in grads.items():
            by_shard.setdefault(dense_owner(name, self.num_shards), []).append(wire.dense_to_proto(name, g))
        replies = self._per_shard(
            "PushDense", {s: ps_pb2.PushDenseRequest(grads=g, worker_id=self.worker_id, return_values=return_values)
                          for s, g in by_shard.items()}
        )
        out: dict[str, np.ndarray] = {}
        for resp in replies:
            out.update({p.name: wire.dense_from_proto(p) for p in resp.params})
        if return_values and set(out) != set(grads):  # a shard of an older build answered without values
            out.update(self.pull_dense([n for n in grads if n not in out]))
        return out

    # -- admin -----------------------------------------------------------------------------------
    def stats(self) -> list[dict[str, Any]]:
        import json

        return [json.loads(r.json) for r in self._broadcast("Stats", ps_pb2.StatsRequest())]

    def stub(self, shard: int) -> ps_pb2_grpc.ParameterServerStub:
        return self._stubs[shard]

    # -- internals ----------------------------------------------------------------------------------
    def _call_with_retry(self, shard: int, method: str, request: Any, timeout: float | None = None) -> Any:
        with self._waiter(self.wait_timeout_s, method) as waiter:
            deadline = time.monotonic() + self.retry_timeout_s
            delay = self.backoff_s
            while True:
                try:
                    resp = getattr(self._stubs[shard], method)(request, timeout=timeout or self.rpc_cfg.timeout_s,
                                                               metadata=self._reply_limit_md)
                    self._note_up(shard)
                    return resp
                except grpc.RpcError as exc:
                    what = _rpc_kind(exc)
                    if what == "wait":
                        waiter.behind(shard, exc)
                        waiter.check(method, self.addresses)
                        deadline += waiter.sleep()
                        continue
                    if what == "clock_expired" and self.worker_id:
                        self._rejoin(shard, exc)
                        continue
                    if what == "paused":  # a checkpoint pause: lease-bounded on the shard
                        if time.monotonic() > deadline:
                            raise PsUnavailableError(f"shard {shard} ({self.addresses[shard]}) {method}: paused for "
                                                     f"{self.retry_timeout_s:.0f}s: {exc.details()}") from None
                        waiter.sleep()
                        continue
                    if what != "unavailable":
                        raise PsRequestError(f"shard {shard} ({self.addresses[shard]}) {method}: {exc.details()}", exc.code()) from None
                    self._note_down(shard, exc)
                    if time.monotonic() + delay > deadline:
                        raise PsUnavailableError(
                            f"shard {shard} ({self.addresses[shard]}) unavailable for {self.retry_timeout_s:.0f}s: {exc.details()}"
                        ) from None
                    time.sleep(delay)
                    delay = min(delay * 2, self.max_backoff_s)

    def _per_shard(self, method: str, requests: dict[int, Any], timeout: float | None = None) -> list[Any]:
        """One call per shard, in parallel, each retried while its shard is unavailable."""
        if len(requests) == 1:
            (s, r), = requests.items()
            return [self._call_with_retry(s, method, r, timeout)]
        futs = [_THREADS.submit(self._call_with_retry, s, method, r, timeout) for s, r in requests.items()]
        return [f.result() for f in futs]

    def _broadcast(self, method: str, request: Any, timeout: float | None = None) -> list[Any]:
        return self._per_shard(method, {s: request for s in range(self.num_shards)}, timeout)

    def _note_down(self, shard: int, exc: grpc.RpcError) -> None:
        if shard not in self._down:
            self._down.add(shard)
            log.warning(
                "ps shard unavailable; retrying with backoff",
                extra=kv(shard=shard, address=self.addresses[shard], error=exc.details()),
            )

    def _note_up(self, shard: int) -> None:
        if shard in self._down:
            self._down.discard(shard)
            log.info("ps shard reachable again; continuing", extra=kv(shard=shard, address=self.addresses[shard]))

    def _rows_per_call(self, jobs: list[routing.Job], kind: str) -> int:
        dim = max([self._dims.get(j.table, 0) for j in jobs] + [1 if not self._dims else max(self._dims.values())])
        dtype = self.value_dtype if kind == "pull" else self.grad_dtype
        cap = max(1, int(self.rpc_cfg.max_message_bytes * 0.9) // (8 + dim * dtype.numpy.itemsize))
        if self.max_request_rows:
            cap = min(cap, self.max_request_rows)
        if self._row_cap:
            cap = min(cap, self._row_cap)
        return cap

    def _fan_out(
        self,
        kind: str,
        jobs: list[routing.Job],
        request: Callable[[list[routing.Piece], PartitionMap], Any],
        on_reply: Callable[[list[routing.Piece], Any], None],
        *,
        probe: Iterable[int] = (),
        clock: bool = False,
        pending: list[routing.Piece] | None = None,
        clock_shards: Iterable[int] | None = None,
    ) -> None:
        """Route, send to every shard at once, retry what was refused, hand each reply to ``on_reply``.

        Args:
            kind: "pull" (PullMany) or "push" (PushMany).
            jobs: the call's tables (``ps.routing.Job``).
            request: builds one shard's request from its pieces and the map they were routed with.
            on_reply: takes a reply with the pieces it answers.
            probe: jobs whose dim is unknown: an empty one still asks shard 0 (see ``routing.plan``).
            clock: every shard must get a request (a push with a step), rows or not.
            pending: send only these pieces (default: every row of every job).
            clock_shards: with ``clock``, the shards that must get a request (default: all).
        """
        with self._waiter(self.wait_timeout_s, kind) as waiter:
            pending = routing.everything(jobs) if pending is None else list(pending)
            deadline = time.monotonic() + self.retry_timeout_s
            delay = self.backoff_s
            need_clock = (set(range(self._pmap.num_shards)) if clock_shards is None else set(clock_shards)) if clock else set()
            while pending or need_clock:
                pmap = self._pmap
                planned = routing.plan(jobs, pending, pmap, self._rows_per_call(jobs, kind), every_shard=need_clock, probe=probe)
                if self.framed:
                    methods = self._pull_frame if kind == "pull" else self._push_frame
                else:
                    methods = self._pull_many if kind == "pull" else self._push_many
                reqs = [(p, methods[p.shard], request(p.pieces, pmap)) for p in planned]
                if len(reqs) == 1:
                    # One call: block on it. A gRPC future costs a channel-spin thread per call
                    # (~2-4 ms here), which only pays off when several shards answer in parallel.
                    p, method, req = reqs[0]
                    calls: list[tuple[routing.Planned, Any]] = [
                        (p, _Immediate.call(method, req, self.rpc_cfg.timeout_s, self._reply_limit_md))]
                else:
                    calls = [(p, method.future(req, timeout=self.rpc_cfg.timeout_s, metadata=self._reply_limit_md))
                             for p, method, req in reqs]
                pending = []
                refresh = retry = waited = paused = False  # what this round's failures ask for
                for p, fut in calls:
                    s = p.shard
                    try:
                        resp = fut.result()
                    except grpc.RpcError as exc:
                        if self.framed and exc.code() == grpc.StatusCode.UNIMPLEMENTED:
                            # a shard without the frame methods (an older build): nothing was done;
                            # this client speaks protobuf PullMany/PushMany from now on
                            self.framed = False
                            log.warning("ps shard has no framed data plane; using protobuf PullMany/PushMany",
                                        extra=kv(shard=s, address=self.addresses[s]))
                            pending.extend(p.pieces)
                            continue
                        what = _rpc_kind(exc)
                        if what == "fatal":
                            for _, other in calls:
                                other.cancel()
                            raise PsRequestError(
                                f"shard {s} ({self.addresses[s]}) refused {kind}: {exc.code().name}: {exc.details()}", exc.code()
                            ) from None
                        if what == "wait":
                            waiter.behind(s, exc)
                            waited = True
                        elif what == "paused":
                            paused = True
                        elif what == "wrong_owner":
                            refresh = retry = True
                        elif what == "clock_expired":
                            self._rejoin(s, exc)  # then resend at once: nothing was applied
                        elif what == "unavailable":
                            self._note_down(s, exc)
                            retry = True
                        elif what == "split":
                            self._shrink(s, p.rows, exc)  # no sleep needed: the resend is smaller, not later
                        pending.extend(p.pieces)
                        continue
                    self._note_up(s)
                    need_clock.discard(s)
                    on_reply(p.pieces, resp)
                if pending or need_clock:
                    if waited:
                        waiter.check(kind, self.addresses)
                    if retry or (paused and time.monotonic() > deadline):
                        if time.monotonic() + delay > deadline:
                            raise PsUnavailableError(
                                f"{kind} could not complete within {self.retry_timeout_s:.0f}s (shards down: {sorted(self._down)}, "
                                f"map v{self._pmap.version}{', paused' if paused else ''})"
                            )
                        time.sleep(delay)
                        delay = min(delay * 2, self.max_backoff_s)
                        if refresh:
                            self.refresh_map()
                    elif waited or paused:
                        slept = waiter.sleep()
                        if not paused:
                            deadline += slept  # waiting for slower workers is not retry time
                    # only "split": resend smaller at once
                else:
                    delay = self.backoff_s

    def _shrink(self, shard: int, rows: int, exc: grpc.RpcError) -> None:
        """A shard said RESOURCE_EXHAUSTED: lower the rows per request (its hint, else half)."""
        if rows <= 1:
            raise PsRequestError(f"shard {shard}: a single row exceeds the limits: {exc.details()}", exc.code()) from None
        hint = _md_float(exc, MAX_ROWS_KEY)
        cap = int(hint) if hint is not None and 1 <= hint < rows else max(1, rows // 2)
        self._row_cap = min(cap, self._row_cap or cap)
        log.info("request too large; splitting", extra=kv(shard=shard, rows=rows, cap=self._row_cap))


GroupPush = tuple[list[tuple[str, ...]], list[np.ndarray], list[torch.Tensor], list[torch.Tensor]]
"""A step's push per storage group: (tables, counts, ids, grads), as :meth:`PsClient.push_groups` takes them."""
GroupPull = tuple[list[tuple[str, ...]], list[np.ndarray], list[torch.Tensor], list[int]]
"""A step's pull per storage group: (tables, counts, ids, dims), as :meth:`PsClient.pull_groups` takes them."""
DenseFlat = tuple[list[str], np.ndarray, list[int]]
"""Dense gradients as one flat float32 array: (names, flat, each one's size)."""


@dataclasses.dataclass
class _DensePart:
    """The dense parameters one shard owns in a step: names, sizes and their positions in the
    step's flat vector (None: the whole vector, in order)."""

    names: list[str]
    sizes: list[int]
    pos: np.ndarray | None

    def spans(self) -> list[tuple[str, int, int]]:
        """(name, start, end) of each parameter in this part's own flat values."""
        out, at = [], 0
        for n, k in zip(self.names, self.sizes):
            out.append((n, at, at + k))
            at += k
        return out


def _names_of(job: routing.Job) -> tuple[str, ...]:
    """A group job's tables."""
    assert job.sections is not None
    return job.sections[0]


def _counts_of(job: routing.Job, pos: np.ndarray) -> np.ndarray:
    """Ids per table of a group job's piece (``pos`` increasing: each table's positions one run)."""
    assert job.sections is not None
    if pos.size == job.ids.size:
        return np.asarray(job.sections[1], dtype=np.int64)
    return np.diff(np.searchsorted(pos, job.table_starts())).astype(np.int64)


def _add_group_counts(totals: dict[int, np.ndarray], jobs: list[routing.Job], pieces: list[routing.Piece],
                      reply: group_frame.GroupFrame) -> None:
    """A group push reply's counts (per group: int64 [tables, COUNT_FIELDS]) added into ``totals``
    per job: one array add a group, no per-table work (``StepResult.counts`` splits them when read).

    Raises:
        ps.wire.WireError: the reply's groups do not match the request's.
    """
    if len(reply.groups) != len(pieces):
        raise wire.WireError(f"step reply: {len(reply.groups)} push groups, the request sent {len(pieces)}")
    for (j, _), g in zip(pieces, reply.groups):
        names = _names_of(jobs[j])
        vals = g.values
        if vals is None or vals.shape != (len(names), len(group_frame.COUNT_FIELDS)):
            raise wire.WireError(f"step reply: push counts of shape {None if vals is None else vals.shape} for group "
                                 f"{list(names)}")
        if j in totals:
            totals[j] += vals
        else:
            totals[j] = vals.astype(np.int64, copy=True)


def _scatter_group_rows(jobs: list[routing.Job], pieces: list[routing.Piece], reply: group_frame.GroupFrame) -> None:
    """A group pull reply's rows into the jobs' ``out`` (the whole group in order: kept as a view).

    Raises:
        ps.wire.WireError: the reply's groups do not match the request's.
    """
    if len(reply.groups) != len(pieces):
        raise wire.WireError(f"step reply: {len(reply.groups)} pull groups, the request asked for {len(pieces)}")
    for (j, pos), g in zip(pieces, reply.groups):
        job = jobs[j]
        vals = g.values
        if vals is None or vals.shape[0] != pos.size:
            raise wire.WireError(f"step reply: {0 if vals is None else vals.shape[0]} rows for group '{job.table}', "
                                 f"asked for {pos.size}")
        _place_rows(job, pos, wire.to_float32(vals))


def _place_rows(job: routing.Job, pos: np.ndarray, rows: np.ndarray) -> None:
    """A reply's float32 rows of a group job's piece into ``job.out``: the whole group in order is
    kept as it is (a view of the reply, no copy), a part is scattered with one ``index_copy_``."""
    if job.out is None and pos.size == job.ids.size:  # pieces keep their order: all positions = in order
        job.out = rows
        return
    if job.out is None:
        job.out = np.empty((job.ids.size, rows.shape[1]), dtype=np.float32)
    routing.as_tensor(job.out).index_copy_(0, torch.from_numpy(pos), routing.as_tensor(rows))


def _push_group_jobs(tables: list[tuple[str, ...]], counts: list[np.ndarray], ids: list[torch.Tensor],
                     grads: list[torch.Tensor]) -> list[routing.Job]:
    """One push job per storage group (its ids unique: the reader's), grads float32 [N_g, dim]."""
    jobs = []
    for names, c, g_ids, g in zip(tables, counts, ids, grads):
        flat = _as_ids(g_ids, names[0])
        gg = g.detach().to("cpu", torch.float32).contiguous().numpy()
        if gg.ndim != 2 or gg.shape[0] != flat.size:
            raise ValueError(f"group {list(names)}: grads must be [n={flat.size}, dim], got shape {gg.shape}")
        jobs.append(routing.Job(names[0], flat, grads=gg, sections=(names, c)))
    return jobs


def _group_counts(tables: list[tuple[str, ...]]) -> dict[str, dict[str, int]]:
    return {t: dict.fromkeys(("rows",) + PUSH_COUNT_FIELDS, 0) for names in tables for t in names}


_THREADS = concurrent.futures.ThreadPoolExecutor(max_workers=16, thread_name_prefix="ps-client-rpc")


class _Immediate:
    """The outcome of a blocking call, shaped like the gRPC future it replaces."""

    def __init__(self, value: Any = None, error: grpc.RpcError | None = None) -> None:
        self._value, self._error = value, error

    @classmethod
    def call(cls, method: Any, request: Any, timeout: float, metadata: Any = None) -> "_Immediate":
        try:
            return cls(value=method(request, timeout=timeout, metadata=metadata))
        except grpc.RpcError as exc:
            return cls(error=exc)

    def result(self) -> Any:
        if self._error is not None:
            raise self._error
        return self._value

    def cancel(self) -> bool:
        return False


def _group_entries(job: routing.Job, pos: np.ndarray) -> list[tuple[str, slice, np.ndarray | None]]:
    """A piece of a group job as frame tables: (table, the rows of the job's ids and grads it
    sends, positions into those rows or None = all of them). The whole group, in order, sends
    each table's own slice; a part of it sends the table's positions into the whole."""
    secs = routing.sections(job, pos)
    if pos.size == job.ids.size:
        return [(t, slice(a, b), None) for t, a, b in secs]
    return [(t, slice(None), pos[a:b]) for t, a, b in secs]


def _scatter_groups(jobs: list[routing.Job], pieces: list[routing.Piece], resp: wire.PullReply,
                    dims: dict[str, int]) -> None:
    """Put a framed pull reply of group jobs into their ``out`` (see :meth:`PsClient.pull_groups`).

    A group's tables come back as one run of bytes: viewed whole (no copy when the piece
    is the whole group), else scattered to the piece's positions with one ``index_copy_``.

    Raises:
        ps.wire.WireError: the reply does not match the request (tables, counts, dims).
    """
    k = 0
    for j, pos in pieces:
        job = jobs[j]
        secs = routing.sections(job, pos)
        if k + len(secs) > len(resp.tables):
            raise wire.WireError(f"pull reply has {len(resp.tables)} tables, the request asked for more")
        for (t, a, b), tv in zip(secs, resp.tables[k : k + len(secs)]):
            if tv.table != t or tv.rows != b - a:
                raise wire.WireError(f"pull reply has table '{tv.table}' ({tv.rows} rows) where the request asked for "
                                     f"'{t}' ({b - a} rows)")
        tv0 = resp.tables[k]
        span = resp.span(k, k + len(secs))
        k += len(secs)
        dtype = wire.DType.from_proto(tv0.dtype, table=tv0.table)
        dims[job.table] = int(tv0.dim)
        if span is None:
            raise wire.WireError(f"pull reply: the tables of group '{job.table}' are not one run of rows")
        _place_rows(job, pos, wire.to_float32(wire.decode_rows(span, dtype, int(pos.size), tv0.dim, table=tv0.table)))
    if k != len(resp.tables):
        raise wire.WireError(f"pull reply has {len(resp.tables)} tables, the request asked for {k}")


def _writable(rows: np.ndarray) -> np.ndarray:
    """``rows`` when the caller may own it (a writable view of a framed reply), else a writable copy."""
    return rows if rows.flags.writeable and rows.flags.c_contiguous else np.array(rows)


def _positions(job: routing.Job, pos: np.ndarray) -> np.ndarray | None:
    """None when ``pos`` is every row of ``job`` in order (sent without a gather), else ``pos``."""
    return None if pos.size == job.ids.size and routing.is_identity(pos) else pos


def _grads(job: routing.Job) -> np.ndarray:
    if job.grads is None:
        raise ValueError(f"table '{job.table}': a push needs gradients")
    return job.grads


_UNIQUE_SORT_MAX = 2048
"""Up to this many ids :func:`_all_unique` sorts them (cheaper than its bucket count)."""
_UNIQUE_MAX_BITS = 22
_GOLDEN = np.uint64(0x9E3779B97F4A7C15)


def _unique_hash_bits(n: int) -> int:
    """Buckets (log2) of :func:`_all_unique`'s pre-check for ``n`` ids: ~8-16 buckets an id
    (16K ids: 2^18 buckets, ~6% of random ids in shared ones), at most 2^22 (32 MiB of counts)."""
    return min(_UNIQUE_MAX_BITS, n.bit_length() + 3)


def _all_unique(ids: np.ndarray) -> bool:
    """Whether ``ids`` holds no repeat, exactly, without sorting them all in the common cases.

    Strictly increasing ids (what workers send: ``meta_io``'s sorted unique ids) pass
    one compare. Up to ``_UNIQUE_SORT_MAX`` ids are sorted. Otherwise the ids are
    hashed (Fibonacci hashing of the 64-bit id) into buckets counted by one
    ``bincount``: an id alone in its bucket cannot repeat, and only the ids that share
    a bucket are sorted and compared. For 16K int64 a full ``np.sort`` costs ~0.45 ms
    here; this ~0.12 ms (random order) or ~5 us (sorted). Adversarial ids that share
    buckets degrade to that one sort, never to a wrong answer.

    Args:
        ids: int64 [n].
    """
    if ids.size < 2:
        return True
    if bool((ids[1:] > ids[:-1]).all()):
        return True
    shared = ids
    if ids.size > _UNIQUE_SORT_MAX:
        bits = _unique_hash_bits(int(ids.size))
        h = ((ids.view(np.uint64) * _GOLDEN) >> np.uint64(64 - bits)).view(np.int64)
        shared = ids[np.bincount(h, minlength=1 << bits)[h] > 1]
        if shared.size < 2:
            return True
    s = np.sort(shared)
    return not bool((s[1:] == s[:-1]).any())


def _as_ids(ids: Any, table: str) -> np.ndarray:
    if isinstance(ids, torch.Tensor):
        ids = ids.detach().cpu().numpy()
    arr = np.asarray(ids)
    if arr.dtype.kind not in "iu":
        raise ValueError(f"table '{table}': ids must be integers, got dtype {arr.dtype}")
    return arr.reshape(-1).astype(np.int64, copy=False)
