"""Intra-request parallelism on a PS shard: one large pull or push split over N threads.

A shard serves one data-plane call on one gRPC handler thread, and torch runs
with one intra-op thread (``metaps/roles/ps.py``: OpenMP threads spinning over a
few shared cores made fbgemm's CPU backward ~100x slower). While a worker waits
for its pull, the shard's other cores have nothing to do. ``[ps]
intra_op_threads = N`` (default 1 = off) lets the few heavy, row-independent
stages of a large request run over N spans of its rows, one per thread:

* pull: the id-map lookup and the gather into the reply (unknown ids: their
  initial rows), span by span (``EmbeddingTable._pull``);
* push: the id-map lookup and the rowwise-Adagrad update (rows are unique there,
  so spans touch disjoint rows; ``FusedTbeOptimizer._run``).

The calling thread runs the first span itself; the others go to a small shared
pool. torch and fbgemm release the GIL inside these ops, so spans run at once.
Every row's arithmetic is the one of the serial path, so the results are the
same bits whatever N (tests/ps/test_pull_fast_intra_op.py). Requests under
``MIN_ROWS_PER_THREAD`` rows per thread are not split (the split costs tens of
microseconds).

This is process-wide, like ``torch.set_num_threads``: the PS role sets it once
from the config at start (:func:`set_threads`).

Example::

    intra_op.set_threads(2)
    parts = intra_op.run(n, lambda lo, hi: lookup(ids[lo:hi]))  # one result per span, in order
"""

from __future__ import annotations

import concurrent.futures
import logging
import threading
from typing import Callable, TypeVar

from common.log import kv

__all__ = ["MAX_THREADS", "MIN_ROWS_PER_THREAD", "set_threads", "threads", "spans", "run"]

log = logging.getLogger(__name__)

MAX_THREADS = 64
"""Largest accepted ``intra_op_threads``."""

MIN_ROWS_PER_THREAD = 4096
"""A request is split only into spans of at least this many rows."""

T = TypeVar("T")

_lock = threading.Lock()
_threads = 1
_pool: concurrent.futures.ThreadPoolExecutor | None = None


def set_threads(n: int) -> None:
    """Use ``n`` threads per large request from now on (1 = every request on its handler thread).

    Args:
        n: threads per request, 1..MAX_THREADS.

    Raises:
        ValueError: ``n`` out of range.
    """
    global _threads, _pool
    if isinstance(n, bool) or not isinstance(n, int) or not 1 <= n <= MAX_THREADS:
        raise ValueError(f"intra_op_threads must be an integer in [1, {MAX_THREADS}], got {n!r}")
    with _lock:
        old, _pool = _pool, None
        _threads = n
        if n > 1:
            _pool = concurrent.futures.ThreadPoolExecutor(n - 1, thread_name_prefix="ps-intra-op")
    if old is not None:
        old.shutdown(wait=True)
    log.info("intra-op threads per request", extra=kv(threads=n, min_rows_per_thread=MIN_ROWS_PER_THREAD))


def threads() -> int:
    """Threads a large request is split over now."""
    return _threads


def spans(n: int) -> list[tuple[int, int]]:
    """The [lo, hi) spans ``n`` rows are split into (one span when not split).

    Args:
        n: rows of the request.
    """
    k = min(_threads, n // MIN_ROWS_PER_THREAD)
    if k <= 1:
        return [(0, n)]
    edges = [n * i // k for i in range(k + 1)]
    return [(edges[i], edges[i + 1]) for i in range(k)]


def run(n: int, fn: Callable[[int, int], T]) -> list[T]:
    """``fn(lo, hi)`` for each span of ``n`` rows, at once; the results in span order.

    Every span has finished (or failed) when this returns or raises, so no thread
    still touches the caller's buffers; the first span's error (in span order) is raised.

    Args:
        n: rows of the request.
        fn: the work for rows [lo, hi); must touch only those rows' outputs.
    """
    parts = spans(n)
    pool = _pool
    if len(parts) == 1 or pool is None:
        return [fn(0, n)]
    futures = [pool.submit(fn, lo, hi) for lo, hi in parts[1:]]
    first: list[T] = []
    err: BaseException | None = None
    try:
        first.append(fn(*parts[0]))
    except BaseException as exc:  # noqa: B036 -- re-raised below, after the other spans finished
        err = exc
    concurrent.futures.wait(futures)
    if err is not None:
        raise err
    return first + [f.result() for f in futures]
