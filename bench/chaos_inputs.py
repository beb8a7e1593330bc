"""Hostile RPCs for ``bench.chaos``: each one sent to a live PS or controller, each reply judged.

A reply is a *clear error* when the server answered with a status that is neither
OK nor UNKNOWN, carried a message, and came back before the client's deadline
(DEADLINE_EXCEEDED means a handler sat on the request instead of refusing it), and
was not made up by the client library (its own receive limit: the server sent a
reply larger than the client takes instead of splitting it or refusing).
An OK reply to a hostile request counts as *accepted* (not clear): the server
took garbage without a word.

Example::

    rows = ps_battery("127.0.0.1:5000", token="t", outside_dir="/tmp/elsewhere")
    rows += controller_battery("127.0.0.1:7070", token="t")
    clear = sum(r["clear"] for r in rows)
"""

from __future__ import annotations

import json
import math
from typing import Any, Callable

import grpc
import numpy as np

from common.rpc import RpcConfig, make_channel
from protos import controller_pb2, controller_pb2_grpc, ps_pb2, ps_pb2_grpc

CALL_TIMEOUT_S = 20.0  # generous: the box is loaded; a refusal takes milliseconds
BARRIER_DEADLINE_S = 10.0  # a barrier with a hostile timeout must be refused or capped below this


def _judge(name: str, target: str, call: Callable[[], Any]) -> dict[str, Any]:
    """Run one hostile call and classify what came back."""
    try:
        reply = call()
    except grpc.RpcError as exc:
        code = exc.code()
        details = exc.details() or ""
        # a status the client library made up (its own receive limit) is not the server refusing
        client_side = "CLIENT:" in details or "Received message larger than max" in details
        clear = code not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED, grpc.StatusCode.OK) \
            and bool(details.strip()) and not client_side
        return {"name": name, "target": target, "code": code.name, "message": details[:300], "clear": clear}
    except Exception as exc:  # noqa: BLE001 -- anything else the client library raised: not a clear status
        return {"name": name, "target": target, "code": f"client:{type(exc).__name__}", "message": str(exc)[:300],
                "clear": False}
    # an iterator (server streaming) has to be drained to see its status
    if hasattr(reply, "__iter__") and not isinstance(reply, (bytes, str)) and hasattr(reply, "code"):
        try:
            for _ in reply:
                pass
        except grpc.RpcError as exc:
            details = exc.details() or ""
            clear = exc.code() not in (grpc.StatusCode.UNKNOWN, grpc.StatusCode.DEADLINE_EXCEEDED) and bool(details)
            return {"name": name, "target": target, "code": exc.code().name, "message": details[:300], "clear": clear}
    return {"name": name, "target": target, "code": "OK", "message": "accepted", "clear": False}


def _md(token: str) -> tuple[tuple[str, str], ...]:
    return (("authorization", f"Bearer {token}"),)


def _ps_rows(stub: Any, token: str) -> int:
    st = json.loads(stub.Stats(ps_pb2.StatsRequest(), timeout=CALL_TIMEOUT_S, metadata=_md(token)).json)
    return int(sum(int(t.get("rows", 0)) for t in st.get("store", {}).get("tables", {}).values()))


def ps_battery(address: str, token: str, outside_dir: str, table: str = "user", dim: int = 8,
               small_limit_bytes: int = 1 << 20, barrier_deadline_s: float = BARRIER_DEADLINE_S) -> list[dict[str, Any]]:
    """Send every hostile PS request to ``address``; one result row per request.

    The PS's rows (Stats) are read before and after: a last row ``ps_state_unchanged``
    is clear only when no hostile call changed them.

    Args:
        address: a live PS shard, ``host:port``.
        token: the job's token (the battery also tries none and a wrong one).
        outside_dir: a directory outside the PS's checkpoint root (Checkpoint/Restore targets).
        table: a table the PS serves; dim: its dimension.
        small_limit_bytes: receive limit of the client used for the oversized-reply probe.
        barrier_deadline_s: client deadline of the hostile Barrier calls (a refusal or cap must beat it).
    """
    rpc = RpcConfig(token=token, timeout_s=CALL_TIMEOUT_S)
    ch = make_channel(address, rpc)
    stub = ps_pb2_grpc.ParameterServerStub(ch)
    bare = grpc.insecure_channel(address)
    bare_stub = ps_pb2_grpc.ParameterServerStub(bare)
    t = CALL_TIMEOUT_S
    md = _md(token)
    ids8 = np.arange(1, 9, dtype="<i8")
    out: list[dict[str, Any]] = []
    stub.PushMany(ps_pb2.PushManyRequest(tables=[ps_pb2.TableGrads(  # some rows, so "unchanged" means something
        table=table, ids=ids8.tobytes(), grads=np.ones((8, dim), "<f4").tobytes(), dtype=ps_pb2.DTYPE_FP32)]),
        timeout=t, metadata=md)
    before = _ps_rows(stub, token)

    def tensor(shape: list[int], nbytes: int) -> ps_pb2.DenseTensor:
        return ps_pb2.DenseTensor(name="chaos_w", shape=shape, data=b"\0" * nbytes, dtype=ps_pb2.DTYPE_FP32)

    cases: list[tuple[str, Callable[[], Any]]] = [
        ("missing token", lambda: bare_stub.Stats(ps_pb2.StatsRequest(), timeout=t)),
        ("wrong token", lambda: bare_stub.Stats(ps_pb2.StatsRequest(), timeout=t, metadata=_md(token + "-wrong"))),
        ("NaN pause lease", lambda: stub.PauseWrites(ps_pb2.PauseRequest(paused=True, lease_s=math.nan), timeout=t,
                                                     metadata=md)),
        ("negative pause lease", lambda: stub.PauseWrites(ps_pb2.PauseRequest(paused=True, lease_s=-5.0), timeout=t,
                                                          metadata=md)),
        ("inf freeze lease", lambda: stub.FreezeVshards(ps_pb2.FreezeRequest(vshards=[0], frozen=True,
                                                                             lease_s=math.inf), timeout=t, metadata=md)),
        ("vshard -1 / 10**6", lambda: stub.FreezeVshards(ps_pb2.FreezeRequest(vshards=[-1, 10**6], frozen=True,
                                                                              lease_s=1.0), timeout=t, metadata=md)),
        ("NaN barrier timeout", lambda: stub.Barrier(ps_pb2.BarrierRequest(worker_id="chaos-ghost", step=10**9,
                                                                           timeout_s=math.nan), timeout=barrier_deadline_s, metadata=md)),
        ("huge barrier timeout (must be capped or refused)",
         lambda: stub.Barrier(ps_pb2.BarrierRequest(worker_id="chaos-ghost", step=10**9, timeout_s=1e9),
                              timeout=barrier_deadline_s, metadata=md)),
        ("negative dense shape", lambda: stub.RegisterDense(ps_pb2.RegisterDenseRequest(params=[tensor([-1, 4], 16)]),
                                                            timeout=t, metadata=md)),
        ("dense shape/bytes mismatch", lambda: stub.RegisterDense(
            ps_pb2.RegisterDenseRequest(params=[tensor([4, 4], 12)]), timeout=t, metadata=md)),
        ("negative step", lambda: stub.PullMany(ps_pb2.PullManyRequest(
            tables=[ps_pb2.TableIds(table=table, ids=ids8.tobytes())], step=-7, worker_id="chaos"),
            timeout=t, metadata=md)),
        ("unknown table", lambda: stub.PullMany(ps_pb2.PullManyRequest(
            tables=[ps_pb2.TableIds(table="chaos_no_such_table", ids=ids8.tobytes())]), timeout=t, metadata=md)),
        ("ids buffer not a multiple of 8", lambda: stub.PullMany(ps_pb2.PullManyRequest(
            tables=[ps_pb2.TableIds(table=table, ids=b"\1" * 12)]), timeout=t, metadata=md)),
        ("NaN gradients", lambda: stub.PushMany(ps_pb2.PushManyRequest(tables=[ps_pb2.TableGrads(
            table=table, ids=ids8.tobytes(), grads=np.full((8, dim), np.nan, "<f4").tobytes(),
            dtype=ps_pb2.DTYPE_FP32)]), timeout=t, metadata=md)),
        ("negative export chunk size", lambda: list(stub.ExportVshards(
            ps_pb2.ExportRequest(vshards=[0], max_chunk_bytes=-1), timeout=t, metadata=md))),
        ("checkpoint path outside the root", lambda: stub.Checkpoint(
            ps_pb2.CheckpointRequest(dir=outside_dir, step=1), timeout=t, metadata=md)),
        ("checkpoint path with ..", lambda: stub.Checkpoint(
            ps_pb2.CheckpointRequest(dir=outside_dir + "/../chaos-dotdot", step=1), timeout=t, metadata=md)),
        ("restore from /etc", lambda: stub.Restore(ps_pb2.RestoreRequest(dir="/etc"), timeout=t, metadata=md)),
    ]
    small = RpcConfig(token=token, timeout_s=CALL_TIMEOUT_S, max_message_bytes=small_limit_bytes)
    small_ch = make_channel(address, small)
    small_stub = ps_pb2_grpc.ParameterServerStub(small_ch)
    # 40k ids = 320 KiB request; the reply (40k x dim fp32) is larger than the client's limit:
    # the server should split it, or refuse with a status that says how much to ask for. The caller
    # states its receive limit in metadata, as ps.client.PsClient does on every call (a shard cannot
    # guess a smaller limit than its own)
    from ps.types import REPLY_LIMIT_KEY

    n_big = max(1024, (small_limit_bytes // (4 * dim)) + 8192)
    big_ids = np.arange(1, n_big + 1, dtype="<i8")
    small_md = md + ((REPLY_LIMIT_KEY, str(small_limit_bytes)),)
    cases.append(("oversized reply", lambda: small_stub.PullMany(ps_pb2.PullManyRequest(
        tables=[ps_pb2.TableIds(table=table, ids=big_ids.tobytes())]), timeout=t, metadata=small_md)))
    # a registered ghost worker far behind: a barrier / bounded wait has someone to wait for
    stub.RegisterWorker(ps_pb2.RegisterWorkerRequest(worker_id="chaos-behind", step=0), timeout=t, metadata=md)
    undos = (lambda: stub.PauseWrites(ps_pb2.PauseRequest(paused=False), timeout=t, metadata=md),
             lambda: stub.FreezeVshards(ps_pb2.FreezeRequest(vshards=[0], frozen=False), timeout=t, metadata=md))
    try:
        for name, call in cases:
            out.append(_judge(name, "ps", call))
            for undo in undos:  # a hostile pause / freeze that was accepted must not spoil the next case
                try:
                    undo()
                except grpc.RpcError:
                    pass
        try:
            stub.RegisterWorker(ps_pb2.RegisterWorkerRequest(worker_id="chaos-behind", leave=True), timeout=t,
                                metadata=md)
        except grpc.RpcError:
            pass
        after = _ps_rows(stub, token)
        out.append({"name": "ps_state_unchanged", "target": "ps", "code": "-",
                    "message": f"rows before {before}, after {after}", "clear": after == before})
    finally:
        for c in (ch, bare, small_ch):
            c.close()
    return out


def controller_battery(address: str, token: str) -> list[dict[str, Any]]:
    """Send every hostile controller request to ``address``; one result row per request.

    Args:
        address: a live controller, ``host:port``.
        token: the job's token.
    """
    ch = make_channel(address, RpcConfig(token=token, timeout_s=CALL_TIMEOUT_S))
    stub = controller_pb2_grpc.ControllerStub(ch)
    bare = grpc.insecure_channel(address)
    bare_stub = controller_pb2_grpc.ControllerStub(bare)
    t = CALL_TIMEOUT_S
    md = _md(token)
    ghost = controller_pb2.NodeRef(role="worker", index=77)
    # a registered worker 0, so the shard / metrics cases reach their own checks
    stub.RegisterNode(controller_pb2.RegisterNodeRequest(node=controller_pb2.NodeRef(role="worker", index=0), pid=1,
                                                         incarnation_id="chaos-0"),
                      timeout=t, metadata=md)
    cases: list[tuple[str, Callable[[], Any]]] = [
        ("missing token", lambda: bare_stub.GetStatus(controller_pb2.GetStatusRequest(), timeout=t)),
        ("checkpoint cut_id=-1", lambda: stub.CheckpointDone(
            controller_pb2.CheckpointDoneRequest(cut_id=-1, step=3, dir="/tmp/chaos-nowhere"), timeout=t, metadata=md)),
        ("checkpoint dir outside the run", lambda: stub.CheckpointDone(
            controller_pb2.CheckpointDoneRequest(cut_id=10**6, step=3, dir="/etc"), timeout=t, metadata=md)),
        ("unknown role", lambda: stub.RegisterNode(controller_pb2.RegisterNodeRequest(
            node=controller_pb2.NodeRef(role="chaos", index=0)), timeout=t, metadata=md)),
        ("negative node index", lambda: stub.RegisterNode(controller_pb2.RegisterNodeRequest(
            node=controller_pb2.NodeRef(role="worker", index=-3)), timeout=t, metadata=md)),
        ("process registration without an incarnation id", lambda: stub.RegisterNode(
            controller_pb2.RegisterNodeRequest(node=controller_pb2.NodeRef(role="worker", index=1), pid=1),
            timeout=t, metadata=md)),
        ("unknown dataset", lambda: stub.GetShard(controller_pb2.GetShardRequest(worker=0, dataset="chaos_nope"),
                                                  timeout=t, metadata=md)),
        ("negative worker shard request", lambda: stub.GetShard(controller_pb2.GetShardRequest(
            worker=-1, dataset="train"), timeout=t, metadata=md)),
        ("malformed shard id", lambda: stub.ReportShard(controller_pb2.ReportShardRequest(
            worker=0, shard_id="train:x:y:9-1", attempt=1, status="done"), timeout=t, metadata=md)),
        ("unknown report status", lambda: stub.ReportShard(controller_pb2.ReportShardRequest(
            worker=0, shard_id="train:0:0:0-4", attempt=1, status="chaos"), timeout=t, metadata=md)),
        ("NaN batch times", lambda: stub.ReportMetrics(controller_pb2.ReportMetricsRequest(
            node=controller_pb2.NodeRef(role="worker", index=0), batch_times_s=[math.nan, -1.0],
            samples_per_s=math.inf), timeout=t, metadata=md)),
        ("node down for an unknown node", lambda: stub.NodeDown(controller_pb2.NodeDownRequest(
            node=ghost, reason="chaos", exit_code=9), timeout=t, metadata=md)),
    ]
    out: list[dict[str, Any]] = []
    try:
        for name, call in cases:
            out.append(_judge(name, "controller", call))
    finally:
        ch.close()
        bare.close()
    return out


__all__ = ["controller_battery", "ps_battery"]
