"""FreezeVshards drains in-flight pushes: a push admitted before the freeze is in the export.

The race is forced, not hoped for: the source shard's store holds one push *inside*
the request gate (a wrapper around the real ``push_many`` that waits on an event;
the push itself is the real one, over real gRPC). The test lets the push go only
once the shard's gate has an admin change waiting for it (the freeze drains), or
once the freeze / migration finished without waiting. A freeze that does not drain
lets the export read the rows without that push: the update is lost on the new
owner, every time.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Callable

import grpc
import numpy as np
import pytest

from common.hashing import vshard_of
from common.rpc import make_channel
from protos import ps_pb2, ps_pb2_grpc
from ps.client import PsUnavailableError
from ps.codec import rows_from_chunk
from ps.migration import migrate_vshards
from ps.servicer import PsServer

LR = 0.5  # sgd_tables' learning rate: a push of g moves a row by -0.5 g
NUM_VSHARDS = 8
WAIT_S = 20.0


class HeldPush:
    """Hold the first push that reaches ``server``'s store until :meth:`release` (test-only hook)."""

    def __init__(self, server: PsServer) -> None:
        self.server = server
        self.entered = threading.Event()
        self._release = threading.Event()
        self.applied = threading.Event()
        real: Callable[..., Any] = server.store.push_many

        def push_many(*args: Any, **kw: Any) -> Any:
            if self.entered.is_set():
                return real(*args, **kw)
            self.entered.set()
            assert self._release.wait(WAIT_S), "held push never released"
            try:
                return real(*args, **kw)
            finally:
                self.applied.set()

        server.store.push_many = push_many  # type: ignore[method-assign]

    def release(self) -> None:
        self._release.set()

    def release_when(self, done: threading.Event) -> str:
        """Release once the gate has an admin change waiting (a drain) or ``done`` is set; say which."""
        deadline = time.monotonic() + WAIT_S
        while time.monotonic() < deadline:
            if self.server._gate._writer:  # an exclusive change waits for the held push
                self.release()
                return "drained"
            if done.is_set():
                self.release()
                return "done"
            time.sleep(0.002)
        self.release()
        raise AssertionError("neither a drain nor the end of the admin change within the wait")


def _ids_on(fleet, shard: int, n: int = 6) -> tuple[np.ndarray, list[int]]:
    """``n`` ids whose vshards shard ``shard`` owns, and those vshards."""
    pmap = fleet.servers[0].pmap
    cand = np.arange(10_000, dtype=np.int64)
    own = cand[pmap.owners[vshard_of(cand, NUM_VSHARDS)] == shard][:n]
    return own, sorted(set(vshard_of(own, NUM_VSHARDS).tolist()))


def _push_in_thread(client, ids: np.ndarray, grad: float) -> tuple[threading.Thread, list[BaseException]]:
    errors: list[BaseException] = []

    def run() -> None:
        try:
            client.push({"user": (ids, np.full((ids.size, 8), grad, np.float32))})
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    t = threading.Thread(target=run)
    t.start()
    return t, errors


def test_freeze_returns_only_after_the_in_flight_push_and_the_export_holds_it(ps_fleet) -> None:
    fleet = ps_fleet(1, num_vshards=NUM_VSHARDS)
    ids, vshards = _ids_on(fleet, 0)
    client = fleet.client()
    client.push({"user": (ids, np.ones((ids.size, 8), np.float32))})  # the rows exist on shard 0
    before = client.pull({"user": ids})["user"]
    held = HeldPush(fleet.servers[0])
    pusher, push_errors = _push_in_thread(client, ids, 1.0)
    assert held.entered.wait(WAIT_S)  # the push is in the gate, inside the store

    channel = make_channel(fleet.addresses[0], fleet.rpc)
    stub = ps_pb2_grpc.ParameterServerStub(channel)
    froze = threading.Event()
    answers: list[Any] = []

    def freeze() -> None:
        try:
            answers.append(stub.FreezeVshards(ps_pb2.FreezeRequest(vshards=vshards, frozen=True, lease_s=30),
                                              timeout=WAIT_S))
        except grpc.RpcError as exc:
            answers.append(exc)
        froze.set()

    freezer = threading.Thread(target=freeze)
    freezer.start()
    try:
        how = held.release_when(froze)
        assert froze.wait(WAIT_S)
        # what the freeze guarantees: once it answered, the push admitted before it is applied ...
        applied_before_answer = held.applied.is_set()
        rows = {}
        for chunk in stub.ExportVshards(ps_pb2.ExportRequest(vshards=vshards), timeout=WAIT_S):
            if chunk.table == "user":
                got = rows_from_chunk(chunk)
                rows.update(zip(got.ids.tolist(), got.weights))
    finally:
        held.release()
        freezer.join(WAIT_S)
        pusher.join(WAIT_S)
        channel.close()
    assert not push_errors, push_errors
    assert answers and not isinstance(answers[0], grpc.RpcError), answers
    assert sorted(answers[0].frozen) == vshards
    assert how == "drained" and applied_before_answer, f"FreezeVshards answered ({how}) with a push still in flight"
    # ... and the export of the frozen vshards holds it
    exported = np.stack([rows[i] for i in ids.tolist()])
    np.testing.assert_allclose(exported, before - LR * 1.0, rtol=1e-6)
    # the frozen vshards refuse new pushes until thawed
    with pytest.raises(PsUnavailableError):
        fleet.client(retry_timeout_s=0.5).push({"user": (ids, np.ones((ids.size, 8), np.float32))})


def test_a_push_in_flight_during_a_migration_is_not_lost(ps_fleet) -> None:
    fleet = ps_fleet(2, num_vshards=NUM_VSHARDS)
    ids, vshards = _ids_on(fleet, 0)
    client = fleet.client()
    client.push({"user": (ids, np.ones((ids.size, 8), np.float32))})  # the rows exist on shard 0
    before = client.pull({"user": ids})["user"]
    held = HeldPush(fleet.servers[0])
    pusher, push_errors = _push_in_thread(client, ids, 2.0)
    assert held.entered.wait(WAIT_S)

    moved = threading.Event()
    reports: list[Any] = []

    def move() -> None:
        try:
            reports.append(migrate_vshards(fleet.addresses, fleet.rpc, vshards, 1))
        except BaseException as exc:  # noqa: BLE001
            reports.append(exc)
        moved.set()

    mover = threading.Thread(target=move)
    mover.start()
    try:
        held.release_when(moved)
        assert moved.wait(WAIT_S)
    finally:
        held.release()
        mover.join(WAIT_S)
        pusher.join(WAIT_S)
    assert not push_errors, push_errors
    assert reports and not isinstance(reports[0], BaseException), reports
    assert all(int(fleet.servers[1].pmap.owners[v]) == 1 for v in vshards)
    after = fleet.client().pull({"user": ids})["user"]  # served by shard 1, the new owner
    np.testing.assert_allclose(after, before - LR * 2.0, rtol=1e-6,
                               err_msg="the push in flight at the freeze was lost by the move")
    assert reports[0].rows == ids.size
