"""bench.chaos's hostile-RPC battery runs against real in-process servers and judges every reply."""

from __future__ import annotations

from pathlib import Path

import grpc

from bench.chaos_inputs import _judge, controller_battery, ps_battery
from controller.config import ControllerConfig
from controller.dds import DatasetKind, DatasetSpec
from controller.server import ControllerServer
from common.rpc import RpcConfig
from tests.ps.conftest import start_fleet

TOKEN = "chaos-test-token"
KEYS = {"name", "target", "code", "message", "clear"}


def test_battery_runs_and_returns_judged_rows(tmp_path: Path) -> None:
    fleet = start_fleet(1, token=TOKEN)
    ctl = ControllerServer(ControllerConfig(tick_s=0.2), tmp_path / "ctl",
                           [DatasetSpec("train", (8,), DatasetKind.TRAIN, 1)], RpcConfig(token=TOKEN))
    ctl.start("127.0.0.1:0")
    try:
        rows = ps_battery(fleet.addresses[0], TOKEN, str(tmp_path / "outside"), barrier_deadline_s=2.0)
        rows += controller_battery(ctl.address, TOKEN)
    finally:
        ctl.stop(grace=0)
        fleet.stop()
    assert rows and all(KEYS <= set(r) for r in rows)
    by = {(r["target"], r["name"]): r for r in rows}
    # refusals that exist today are judged clear; the no-token calls never count as accepted
    assert by[("ps", "missing token")]["clear"] and by[("ps", "missing token")]["code"] == "UNAUTHENTICATED"
    assert by[("ps", "unknown table")]["clear"]
    assert by[("controller", "missing token")]["clear"]
    assert by[("ps", "ps_state_unchanged")]["clear"], by[("ps", "ps_state_unchanged")]


def test_judge_counts_ok_and_unknown_as_not_clear() -> None:
    class Boom(grpc.RpcError):
        def __init__(self, code: grpc.StatusCode, details: str) -> None:
            self._c, self._d = code, details

        def code(self) -> grpc.StatusCode:
            return self._c

        def details(self) -> str:
            return self._d

    def raise_(code: grpc.StatusCode, details: str):
        def call() -> None:
            raise Boom(code, details)
        return call

    assert not _judge("ok", "ps", lambda: object())["clear"]
    assert not _judge("unknown", "ps", raise_(grpc.StatusCode.UNKNOWN, "Exception calling application: x"))["clear"]
    assert not _judge("deadline", "ps", raise_(grpc.StatusCode.DEADLINE_EXCEEDED, "Deadline Exceeded"))["clear"]
    assert not _judge("empty", "ps", raise_(grpc.StatusCode.INVALID_ARGUMENT, ""))["clear"]
    assert _judge("clear", "ps", raise_(grpc.StatusCode.INVALID_ARGUMENT, "lease_s must be finite"))["clear"]
    assert not _judge("client limit", "ps", raise_(grpc.StatusCode.RESOURCE_EXHAUSTED,
                                                   "CLIENT: Received message larger than max (5 vs. 4)"))["clear"]
