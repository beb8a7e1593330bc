"""Every PS handler against hostile input: a clear status (never UNKNOWN/INTERNAL), nothing changed.

Table-driven over the whole ``ParameterServer`` service: negative and overflowing
shapes, non-numeric dtypes, empty and duplicate names, NaN/inf/negative leases and
timeouts, negative steps, out-of-range vshards, missing directories. After each
refusal the shard's rows, dense parameters, clocks, map, freeze and pause state
are exactly what they were.
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable

import grpc
import numpy as np
import pytest

from common.rpc import make_channel
from protos import ps_pb2, ps_pb2_grpc

IDS = np.array([1, 2, 3, 4, 5, 6, 7, 8], dtype=np.int64)
OK_CODES = {grpc.StatusCode.INVALID_ARGUMENT, grpc.StatusCode.FAILED_PRECONDITION, grpc.StatusCode.NOT_FOUND}


def _dense(name: str, shape: list[int], data: bytes, dtype: int = ps_pb2.DTYPE_FP32) -> ps_pb2.DenseTensor:
    return ps_pb2.DenseTensor(name=name, shape=shape, data=data, dtype=dtype)


def _arr(name: str, dtype: str, shape: list[int], data: bytes) -> ps_pb2.NamedArray:
    return ps_pb2.NamedArray(name=name, dtype=dtype, shape=shape, data=data)


def _chunk(tmp_override: dict[str, ps_pb2.NamedArray] | None = None, *, rows: int = 2, table: str = "user",
           extra: list[ps_pb2.NamedArray] = ()) -> ps_pb2.RowsChunk:
    """A well-formed 2-row 'user' chunk (SGD: no optimizer state) with some arrays replaced."""
    arrays = {
        "ids": _arr("ids", "<i8", [2], np.array([900, 901], "<i8").tobytes()),
        "weights": _arr("weights", "<f4", [2, 8], np.zeros((2, 8), "<f4").tobytes()),
        "freq": _arr("freq", "<i8", [2], np.ones(2, "<i8").tobytes()),
        "last_step": _arr("last_step", "<i8", [2], np.zeros(2, "<i8").tobytes()),
    }
    arrays.update(tmp_override or {})
    return ps_pb2.RowsChunk(table=table, rows=rows, arrays=list(arrays.values()) + list(extra))


F4 = np.zeros(4, "<f4").tobytes()
NAN4 = np.full(4, np.nan, "<f4").tobytes()
HUGE = 2**62

# (case id, method, request builder, expected code or None for "any clear code")
CASES: list[tuple[str, str, Callable[[Any], Any], grpc.StatusCode | None]] = [
    # sparse data
    ("pull-negative-id", "PullMany", lambda tmp: ps_pb2.PullManyRequest(
        tables=[ps_pb2.TableIds(table="user", ids=np.array([-5], "<i8").tobytes())]), grpc.StatusCode.INVALID_ARGUMENT),
    ("pull-empty-table-name", "PullMany", lambda tmp: ps_pb2.PullManyRequest(
        tables=[ps_pb2.TableIds(table="", ids=IDS.tobytes())]), grpc.StatusCode.INVALID_ARGUMENT),
    ("pull-negative-step", "PullMany", lambda tmp: ps_pb2.PullManyRequest(
        tables=[ps_pb2.TableIds(table="user", ids=IDS.tobytes())], worker_id="w", step=-1), grpc.StatusCode.INVALID_ARGUMENT),
    ("pull-single-bad-ids", "Pull", lambda tmp: ps_pb2.PullRequest(table="user", ids=b"\x01" * 7),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("push-negative-step", "PushMany", lambda tmp: ps_pb2.PushManyRequest(
        tables=[ps_pb2.TableGrads(table="user", ids=IDS.tobytes(), grads=np.ones((8, 8), "<f4").tobytes(),
                                  dtype=ps_pb2.DTYPE_FP32)], worker_id="w", step=-3), grpc.StatusCode.INVALID_ARGUMENT),
    ("push-unspecified-dtype", "Push", lambda tmp: ps_pb2.PushRequest(
        table="user", ids=IDS.tobytes(), grads=np.ones((8, 8), "<f4").tobytes()), grpc.StatusCode.INVALID_ARGUMENT),
    ("push-nan", "PushMany", lambda tmp: ps_pb2.PushManyRequest(
        tables=[ps_pb2.TableGrads(table="user", ids=IDS.tobytes(), grads=np.full((8, 8), np.nan, "<f4").tobytes(),
                                  dtype=ps_pb2.DTYPE_FP32)]), grpc.StatusCode.INVALID_ARGUMENT),
    # dense
    ("dense-register-negative-shape", "RegisterDense", lambda tmp: ps_pb2.RegisterDenseRequest(
        params=[_dense("x", [-1, -4], np.zeros(4, "<f4").tobytes())]), grpc.StatusCode.INVALID_ARGUMENT),
    ("dense-register-overflowing-shape", "RegisterDense", lambda tmp: ps_pb2.RegisterDenseRequest(
        params=[_dense("x", [HUGE, HUGE, 16], b"")]), grpc.StatusCode.INVALID_ARGUMENT),
    ("dense-register-empty-name", "RegisterDense", lambda tmp: ps_pb2.RegisterDenseRequest(
        params=[_dense("", [4], F4)]), grpc.StatusCode.INVALID_ARGUMENT),
    ("dense-register-nan", "RegisterDense", lambda tmp: ps_pb2.RegisterDenseRequest(
        params=[_dense("x", [4], NAN4)]), grpc.StatusCode.INVALID_ARGUMENT),
    ("dense-register-bad-dtype", "RegisterDense", lambda tmp: ps_pb2.RegisterDenseRequest(
        params=[_dense("x", [4], F4, dtype=7)]), grpc.StatusCode.INVALID_ARGUMENT),
    ("dense-register-shape-change", "RegisterDense", lambda tmp: ps_pb2.RegisterDenseRequest(
        params=[_dense("d", [2], np.zeros(2, "<f4").tobytes())], overwrite=True), grpc.StatusCode.INVALID_ARGUMENT),
    ("dense-push-negative-shape", "PushDense", lambda tmp: ps_pb2.PushDenseRequest(
        grads=[_dense("d", [-4], F4)]), grpc.StatusCode.INVALID_ARGUMENT),
    ("dense-push-overflowing-shape", "PushDense", lambda tmp: ps_pb2.PushDenseRequest(
        grads=[_dense("d", [HUGE, 4, 4, 4], b"")]), grpc.StatusCode.INVALID_ARGUMENT),
    ("dense-push-twice", "PushDense", lambda tmp: ps_pb2.PushDenseRequest(
        grads=[_dense("d", [4], F4), _dense("d", [4], F4)]), grpc.StatusCode.INVALID_ARGUMENT),
    ("dense-push-unknown", "PushDense", lambda tmp: ps_pb2.PushDenseRequest(
        grads=[_dense("nope", [4], F4)]), grpc.StatusCode.INVALID_ARGUMENT),
    ("dense-push-wrong-shape", "PushDense", lambda tmp: ps_pb2.PushDenseRequest(
        grads=[_dense("d", [2, 2], F4)]), grpc.StatusCode.INVALID_ARGUMENT),
    ("dense-push-nan", "PushDense", lambda tmp: ps_pb2.PushDenseRequest(
        grads=[_dense("d", [4], NAN4)]), grpc.StatusCode.INVALID_ARGUMENT),
    ("dense-pull-empty-name", "PullDense", lambda tmp: ps_pb2.PullDenseRequest(names=[""]),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("dense-pull-unknown", "PullDense", lambda tmp: ps_pb2.PullDenseRequest(names=["nope"]),
     grpc.StatusCode.INVALID_ARGUMENT),
    # partition map
    ("map-bad-owners", "UpdatePartitionMap", lambda tmp: ps_pb2.PartitionMap(
        version=5, num_vshards=32, num_shards=1, owners=[0] * 3), grpc.StatusCode.INVALID_ARGUMENT),
    ("map-negative-owner", "UpdatePartitionMap", lambda tmp: ps_pb2.PartitionMap(
        version=5, num_vshards=32, num_shards=1, owners=[-1] * 32), grpc.StatusCode.INVALID_ARGUMENT),
    # migration
    ("freeze-vshard-out-of-range", "FreezeVshards", lambda tmp: ps_pb2.FreezeRequest(vshards=[32], frozen=True),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("freeze-negative-vshard", "FreezeVshards", lambda tmp: ps_pb2.FreezeRequest(vshards=[-1], frozen=True),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("freeze-nan-lease", "FreezeVshards", lambda tmp: ps_pb2.FreezeRequest(vshards=[1], frozen=True, lease_s=math.nan),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("freeze-inf-lease", "FreezeVshards", lambda tmp: ps_pb2.FreezeRequest(vshards=[1], frozen=True, lease_s=math.inf),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("freeze-negative-lease", "FreezeVshards", lambda tmp: ps_pb2.FreezeRequest(vshards=[1], frozen=True, lease_s=-1),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("export-negative-chunk", "ExportVshards", lambda tmp: ps_pb2.ExportRequest(vshards=[1], max_chunk_bytes=-1),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("export-vshard-out-of-range", "ExportVshards", lambda tmp: ps_pb2.ExportRequest(vshards=[10**6]),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("import-unknown-table", "ImportVshards", lambda tmp: _chunk(table="nope"), grpc.StatusCode.INVALID_ARGUMENT),
    ("import-negative-shape", "ImportVshards", lambda tmp: _chunk(
        {"weights": _arr("weights", "<f4", [-2, -8], np.zeros((2, 8), "<f4").tobytes())}), grpc.StatusCode.INVALID_ARGUMENT),
    ("import-overflowing-shape", "ImportVshards", lambda tmp: _chunk(
        {"weights": _arr("weights", "<f4", [HUGE, HUGE, 4], b"")}), grpc.StatusCode.INVALID_ARGUMENT),
    ("import-object-dtype", "ImportVshards", lambda tmp: _chunk(
        {"freq": _arr("freq", "|O", [2], b"\x00" * 16)}), grpc.StatusCode.INVALID_ARGUMENT),
    ("import-garbage-dtype", "ImportVshards", lambda tmp: _chunk(
        {"freq": _arr("freq", "not-a-dtype", [2], b"\x00" * 16)}), grpc.StatusCode.INVALID_ARGUMENT),
    ("import-missing-array", "ImportVshards", lambda tmp: ps_pb2.RowsChunk(
        table="user", rows=2, arrays=[_arr("ids", "<i8", [2], np.array([900, 901], "<i8").tobytes())]),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("import-duplicate-array", "ImportVshards", lambda tmp: _chunk(
        extra=[_arr("ids", "<i8", [2], np.array([902, 903], "<i8").tobytes())]), grpc.StatusCode.INVALID_ARGUMENT),
    ("import-rows-mismatch", "ImportVshards", lambda tmp: _chunk(rows=-2), grpc.StatusCode.INVALID_ARGUMENT),
    ("import-wrong-dim", "ImportVshards", lambda tmp: _chunk(
        {"weights": _arr("weights", "<f4", [2, 4], np.zeros((2, 4), "<f4").tobytes())}), grpc.StatusCode.INVALID_ARGUMENT),
    ("drop-owned", "DropVshards", lambda tmp: ps_pb2.VshardsRequest(vshards=[1]), grpc.StatusCode.FAILED_PRECONDITION),
    ("drop-out-of-range", "DropVshards", lambda tmp: ps_pb2.VshardsRequest(vshards=[-7]), grpc.StatusCode.INVALID_ARGUMENT),
    # checkpoints, clocks
    ("pause-nan-lease", "PauseWrites", lambda tmp: ps_pb2.PauseRequest(paused=True, lease_s=math.nan),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("pause-inf-lease", "PauseWrites", lambda tmp: ps_pb2.PauseRequest(paused=True, lease_s=math.inf),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("pause-negative-lease", "PauseWrites", lambda tmp: ps_pb2.PauseRequest(paused=True, lease_s=-5),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("checkpoint-no-dir", "Checkpoint", lambda tmp: ps_pb2.CheckpointRequest(dir="", step=1),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("restore-missing-dir", "Restore", lambda tmp: ps_pb2.RestoreRequest(dir=str(tmp / "no-such-ckpt")),
     grpc.StatusCode.NOT_FOUND),
    ("restore-a-file", "Restore", lambda tmp: ps_pb2.RestoreRequest(dir=str(_file(tmp))), grpc.StatusCode.NOT_FOUND),
    ("restore-empty-dir-name", "Restore", lambda tmp: ps_pb2.RestoreRequest(dir=""),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("register-no-worker", "RegisterWorker", lambda tmp: ps_pb2.RegisterWorkerRequest(worker_id="", step=1),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("register-negative-step", "RegisterWorker", lambda tmp: ps_pb2.RegisterWorkerRequest(worker_id="w9", step=-1),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("barrier-no-worker", "Barrier", lambda tmp: ps_pb2.BarrierRequest(worker_id="", step=0),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("barrier-negative-step", "Barrier", lambda tmp: ps_pb2.BarrierRequest(worker_id="w0", step=-1),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("barrier-nan-timeout", "Barrier", lambda tmp: ps_pb2.BarrierRequest(worker_id="w0", step=0, timeout_s=math.nan),
     grpc.StatusCode.INVALID_ARGUMENT),
    ("barrier-negative-timeout", "Barrier", lambda tmp: ps_pb2.BarrierRequest(worker_id="w0", step=0, timeout_s=-1),
     grpc.StatusCode.INVALID_ARGUMENT),
]


def _file(tmp) -> Any:
    p = tmp / "not-a-dir"
    p.write_text("x")
    return p


@pytest.fixture(scope="module")
def shard(tmp_path_factory):
    """One real shard (SGD tables) with rows, a dense param and a registered worker."""
    from .conftest import start_fleet

    fleet = start_fleet(1)
    client = fleet.client(worker_id="w0", register=True)
    client.push({"user": (IDS, np.ones((IDS.size, 8), np.float32))}, step=0)
    client.register_dense({"d": np.arange(4, dtype=np.float32)})
    stub = ps_pb2_grpc.ParameterServerStub(make_channel(fleet.addresses[0], fleet.rpc))
    yield fleet, client, stub, tmp_path_factory.mktemp("hostile")
    fleet.stop()


def _state(fleet, client) -> dict[str, Any]:
    server = fleet.servers[0]
    stats = server.stats()
    return {
        "rows": client.pull({"user": IDS})["user"].tobytes(),
        "imported": client.pull({"user": np.array([900, 901, 902, 903])})["user"].tobytes(),
        "dense": client.pull_dense(["d"])["d"].tobytes(),
        "dense_names": sorted(server.store.dense.names()),
        "clocks": stats["clocks"],
        "map": (stats["map_version"], stats["owned_vshards"]),
        "paused": stats["paused"],
        "frozen": server._frozen.tobytes(),
        "store_rows": json.dumps({t: v.get("rows") for t, v in (stats["store"].get("tables") or {}).items()}, default=str),
    }


@pytest.mark.parametrize("case,method,build,code", CASES, ids=[c[0] for c in CASES])
def test_hostile_input_gets_a_clear_status_and_changes_nothing(shard, case, method, build, code) -> None:
    fleet, client, stub, tmp = shard
    before = _state(fleet, client)
    with pytest.raises(grpc.RpcError) as err:
        reply = getattr(stub, method)(build(tmp), timeout=20)
        if method == "ExportVshards":
            list(reply)
    got = err.value.code()
    assert got not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.INTERNAL), (case, got, err.value.details())
    assert got == code if code is not None else got in OK_CODES, (case, got, err.value.details())
    assert err.value.details() and "Traceback" not in err.value.details()
    assert _state(fleet, client) == before, case
