"""Request gating of one PS shard: shared entry for data RPCs, exclusive for admin changes, a pause.

Data requests (pull/push) enter :meth:`Gate.data` shared; admin changes (map
update, freeze, import, checkpoint, pause) take :meth:`Gate.exclusive`, which
waits for in-flight data requests, so a request is either wholly before or wholly
after the change. A paused shard answers data requests at once with ABORTED
``paused`` (the client waits and asks again; no handler thread waits).

:class:`RpcAbort` carries a gRPC status and trailing metadata from anywhere in a
handler to the servicer's error mapping (``ps/servicer.py``).

Example::

    gate = Gate()
    with gate.data(timeout_s=60):
        rows = store.pull("user", ids)
    with gate.exclusive():
        store.import_rows("user", rows)
"""

from __future__ import annotations

import contextlib
import threading
import time
from typing import Iterator

import grpc

from ps.types import ERROR_KEY, PAUSED, WAIT_TIMEOUT_KEY


class RpcAbort(Exception):
    """Ends an RPC with ``code`` and a message; optional trailing metadata."""

    def __init__(self, code: grpc.StatusCode, message: str, metadata: tuple[tuple[str, str], ...] = ()) -> None:
        super().__init__(message)
        self.code = code
        self.metadata = metadata


def bad(message: str) -> RpcAbort:
    """INVALID_ARGUMENT with ``message`` (one line naming the field and value)."""
    return RpcAbort(grpc.StatusCode.INVALID_ARGUMENT, message)


class Gate:
    """Shared entry for data requests, exclusive for admin changes, plus a pause.

    Writer-preferring: once an admin change waits, new data requests wait too,
    so a freeze or checkpoint cannot be starved by a stream of pushes.
    """

    def __init__(self) -> None:
        self._cond = threading.Condition()
        self._active = 0
        self._writer = False
        self._paused_until = 0.0
        self.waited = threading.local()  # .s: seconds this thread's request waited here (load totals exclude it)

    @contextlib.contextmanager
    def data(self, timeout_s: float, hold: bool = False) -> Iterator[None]:
        """Enter as a data request.

        Args:
            timeout_s: longest wait for an admin change's drain (or, with ``hold``, a pause).
            hold: wait out a pause here (admin callers only); otherwise a paused shard
                answers ABORTED "paused" at once and the client asks again.
        """
        t0 = time.monotonic()
        deadline = t0 + timeout_s
        with self._cond:
            while True:
                now = time.monotonic()
                if not self._writer and now >= self._paused_until:
                    break
                if not hold and now < self._paused_until:
                    raise RpcAbort(
                        grpc.StatusCode.ABORTED,
                        f"shard paused (checkpoint) for {self._paused_until - now:.1f}s more; ask again",
                        ((ERROR_KEY, PAUSED), (WAIT_TIMEOUT_KEY, f"{self._paused_until - now:.3f}")),
                    )
                if now >= deadline:
                    raise RpcAbort(
                        grpc.StatusCode.UNAVAILABLE,
                        f"shard paused (checkpoint or migration) for more than {timeout_s:.1f}s",
                    )
                self._cond.wait(min(deadline - now, max(self._paused_until - now, 0.0) or 0.5, 0.5))
            self._active += 1
        self.waited.s = getattr(self.waited, "s", 0.0) + (time.monotonic() - t0)
        try:
            yield
        finally:
            with self._cond:
                self._active -= 1
                self._cond.notify_all()

    @contextlib.contextmanager
    def exclusive(self) -> Iterator[None]:
        with self._cond:
            while self._writer:
                self._cond.wait()
            self._writer = True
            while self._active:
                self._cond.wait()
        try:
            yield
        finally:
            with self._cond:
                self._writer = False
                self._cond.notify_all()

    def pause(self, lease_s: float) -> None:
        with self.exclusive():  # drain in-flight requests first: a consistent cut
            self._paused_until = time.monotonic() + lease_s

    def resume(self) -> None:
        with self._cond:
            self._paused_until = 0.0
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return time.monotonic() < self._paused_until
