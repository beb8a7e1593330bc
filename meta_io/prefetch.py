"""A one-thread, bounded background prefetcher for any iterator.

Arrow reads and torch ops release the GIL, so one producer thread overlaps
I/O and conversion with the consumer's compute; DataLoader worker processes
would fork after gRPC/torch pools exist, which can hang (see REFERENCES.md).

Contract:

* at most ``depth`` items wait in the queue (bounded memory);
* an exception raised by the source is re-raised in the consumer, with its
  traceback, after the items produced before it;
* when the consumer stops early (``break``, ``close()``, garbage collection),
  the producer thread is told to stop, the source iterator is closed in that
  thread, and the thread is joined: no thread is leaked;
* the thread starts on the first ``next()``: a prefetcher never iterated
  starts nothing.

Example::

    for batch in prefetch(dataset.read_range(0, 0, 100), depth=4):
        train_step(batch)
"""

from __future__ import annotations

import logging
import queue
import threading
from typing import Iterable, Iterator, TypeVar

from common.log import kv

log = logging.getLogger(__name__)

T = TypeVar("T")

_END = object()
_POLL_S = 0.05
JOIN_TIMEOUT_S = 30.0


def prefetch(it: Iterable[T], depth: int = 4) -> Iterator[T]:
    """Iterate ``it`` in a background thread, at most ``depth`` items ahead.

    Args:
        it: any iterable (e.g. ``MetaIODataset.read_range(...)``).
        depth: queue bound (>= 1).

    Example::

        >>> list(prefetch(range(5), depth=2))
        [0, 1, 2, 3, 4]
    """
    if depth < 1:
        raise ValueError(f"prefetch depth must be >= 1, got {depth}")
    return _prefetch(it, depth)


def _prefetch(it: Iterable[T], depth: int) -> Iterator[T]:
    q: queue.Queue = queue.Queue(maxsize=depth)
    stop = threading.Event()

    def put(item: object) -> bool:
        while not stop.is_set():
            try:
                q.put(item, timeout=_POLL_S)
                return True
            except queue.Full:
                continue
        return False

    def produce() -> None:
        src = iter(it)
        try:
            for item in src:
                if not put((True, item)):
                    return
            put((True, _END))
        except BaseException as exc:  # noqa: BLE001 - handed to the consumer
            put((False, exc))
        finally:
            close = getattr(src, "close", None)
            if close is not None:
                try:
                    close()
                except Exception as exc:  # noqa: BLE001 - best effort on shutdown
                    log.warning("prefetch source close failed", extra=kv(error=repr(exc)))

    thread = threading.Thread(target=produce, name="metaio-prefetch", daemon=True)
    thread.start()
    try:
        while True:
            ok, item = q.get()
            if not ok:
                raise item
            if item is _END:
                return
            yield item
    finally:
        stop.set()
        thread.join(timeout=JOIN_TIMEOUT_S)
        if thread.is_alive():
            log.warning("prefetch thread did not stop", extra=kv(timeout_s=JOIN_TIMEOUT_S))
