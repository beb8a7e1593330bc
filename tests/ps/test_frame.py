"""The framed data plane (ps/frame.py, PullFrame/PushFrame): round trips, malformed frames
refused with a precise message and no state change, and frame == protobuf bit for bit."""

from __future__ import annotations

import struct
import threading
import time

import grpc
import numpy as np
import pytest

from common.rpc import RpcConfig, make_channel
from ps import frame
from ps.config import OptimizerConfig, OptimizerKind, TableConfig
from ps.wire import DType, WireError

from .conftest import TOKEN

IDS = np.array([11, 2, 37, 4, 5, 60, 7, 8], dtype=np.int64)


# -- codec round trips (no server) ---------------------------------------------------------------
def test_pull_request_round_trip_with_positions_and_clock() -> None:
    ids = np.array([5, 3, 9, 1 << 40], dtype=np.int64)
    data = frame.encode_pull_request([("user", ids, None), ("item", ids, np.array([3, 0]))],
                                     map_version=7, fp16=True, worker_id="wörker-1", step=12)
    assert data[:4] == frame.MAGIC and len(data) % 8 == 0
    f = frame.decode_pull_request(data)
    assert (f.map_version, f.fp16, f.step, f.worker_id) == (7, True, 12, "wörker-1")
    assert [t.name for t in f.tables] == ["user", "item"]
    np.testing.assert_array_equal(f.tables[0].ids, ids)
    np.testing.assert_array_equal(f.tables[1].ids, [1 << 40, 5])
    g = frame.decode_pull_request(frame.encode_pull_request([("u", ids[:0], None)], map_version=0, fp16=False,
                                                            worker_id="", step=None))
    assert g.step is None and not g.fp16 and g.tables[0].n == 0 and g.tables[0].ids.size == 0


@pytest.mark.parametrize("dtype", [DType.FP32, DType.FP16])
def test_push_request_round_trip(dtype: DType) -> None:
    ids = np.array([4, 8, 15, 16, 23], dtype=np.int64)
    grads = np.random.default_rng(0).standard_normal((5, 3)).astype(np.float32)  # odd dim: fp16 padding
    grads[0, 0] = 1e6  # beyond fp16's range: saturated as wire.wire_rows does
    pos = np.array([4, 1, 2])
    f = frame.decode_push_request(frame.encode_push_request(
        [("user", ids, grads, None), ("item", ids, grads, pos)], grad_dtype=dtype, map_version=2, worker_id="w", step=0))
    assert f.step == 0 and f.map_version == 2
    from ps.wire import wire_rows

    for t, want_ids, want in ((f.tables[0], ids, grads), (f.tables[1], ids[pos], grads[pos])):
        assert t.dtype == dtype and t.dim == 3
        np.testing.assert_array_equal(t.ids, want_ids)
        assert t.values.tobytes() == wire_rows(want, dtype).tobytes()


def test_reply_round_trips() -> None:
    rows = np.arange(24, dtype=np.float32).reshape(4, 6)
    reply = frame.decode_pull_reply(frame.encode_pull_reply([("a", DType.FP32, rows), ("b", DType.FP16, rows[:1].astype(np.float16))]))
    assert [(t.table, t.rows, t.dim, t.dtype) for t in reply.tables] == [("a", 4, 6, DType.FP32.proto), ("b", 1, 6, DType.FP16.proto)]
    assert bytes(reply.tables[0].values) == rows.tobytes()
    from protos import ps_pb2

    from ps.embedding_table import PushResult

    counts = [ps_pb2.PushCounts(table="a", rows=3, applied=2, evicted=1), ps_pb2.PushCounts(table="b", rows=0)]
    sent = [("a", 3, PushResult(applied=2, evicted=1)), ("b", 0, PushResult())]
    assert frame.decode_push_reply(frame.encode_push_reply(sent)) == ps_pb2.PushManyResponse(tables=counts)
    assert frame.decode_push_reply(frame.encode_push_reply([])) == ps_pb2.PushManyResponse()  # a clock-only push


# -- malformed frames against a real shard --------------------------------------------------------
@pytest.fixture
def one(ps_fleet):
    """One shard, a client, raw frame methods, and the table's rows before the test."""
    fleet = ps_fleet(1)
    client = fleet.client()
    client.push({"user": (IDS, np.ones((IDS.size, 8), np.float32))})
    before = client.pull({"user": IDS})["user"]
    ch = make_channel(fleet.addresses[0], fleet.rpc)
    pull = ch.unary_unary(frame.PULL_PATH)
    push = ch.unary_unary(frame.PUSH_PATH)
    return fleet, client, pull, push, before


def _refused(call, data: bytes, code: grpc.StatusCode, *needles: str) -> str:
    with pytest.raises(grpc.RpcError) as err:
        call(data, timeout=10)
    assert err.value.code() == code, (err.value.code(), err.value.details())
    for n in needles:
        assert n in err.value.details(), (n, err.value.details())
    return err.value.details()


def _good_push(ids: np.ndarray = IDS, dim: int = 8, table: str = "user") -> bytes:
    g = np.full((ids.size, dim), 0.25, np.float32)
    return frame.encode_push_request([(table, ids, g, None)], grad_dtype=DType.FP32, map_version=0, worker_id="", step=None)


def _unchanged(fleet, client, before: np.ndarray) -> None:
    np.testing.assert_array_equal(client.pull({"user": IDS})["user"], before)
    assert fleet.servers[0].metrics.registry.get_sample_value("metaps_ps_rows_pushed_total", {"shard": "0", "table": "user"}) == IDS.size  # the fixture's push only


def test_good_frames_are_served(one) -> None:
    fleet, client, pull, push, before = one
    reply = frame.decode_push_reply(push(_good_push(), timeout=10))
    assert reply.tables[0].table == "user" and reply.tables[0].rows == IDS.size
    got = frame.decode_pull_reply(pull(frame.encode_pull_request([("user", IDS, None)], map_version=0, fp16=False,
                                                                 worker_id="", step=None), timeout=10))
    rows = np.frombuffer(got.tables[0].values, np.float32).reshape(IDS.size, 8)
    np.testing.assert_array_equal(rows, client.pull({"user": IDS})["user"])
    assert not np.array_equal(rows, before)  # the push above was applied


def test_short_header_and_wrong_magic(one) -> None:
    fleet, client, pull, push, before = one
    good = _good_push()
    _refused(push, good[:20], grpc.StatusCode.INVALID_ARGUMENT, "push request frame: short header: 20 bytes, expected at least 32")
    _refused(pull, b"", grpc.StatusCode.INVALID_ARGUMENT, "pull request frame: short header: 0 bytes")
    _refused(push, b"XXXX" + good[4:], grpc.StatusCode.INVALID_ARGUMENT, "magic b'XXXX', expected b'MPSF'")
    _refused(push, good[:4] + b"\x09" + good[5:], grpc.StatusCode.INVALID_ARGUMENT, "version 9, this side speaks version 1")
    _refused(pull, good, grpc.StatusCode.INVALID_ARGUMENT, "kind 2 (push request), expected 1 (pull request)")
    _unchanged(fleet, client, before)


def test_truncated_ids_and_grads_size_mismatch(one) -> None:
    fleet, client, pull, push, before = one
    req = frame.encode_pull_request([("user", IDS, None)], map_version=0, fp16=False, worker_id="", step=None)
    _refused(pull, req[:-8], grpc.StatusCode.INVALID_ARGUMENT,
             "table 'user': ids need 64 bytes (8 int64 ids) at offset 56, the frame has 56 left")
    good = _good_push()
    ids_end = len(good) - IDS.size * 8 * 4
    _refused(push, good[:ids_end - 3], grpc.StatusCode.INVALID_ARGUMENT, "table 'user': ids need 64 bytes")
    _refused(push, good[:-4], grpc.StatusCode.INVALID_ARGUMENT,
             "table 'user': grads need 256 bytes (8 ids x dim 8 x 4 bytes fp32)", "the frame has 252 left")
    _refused(push, good + b"\0" * 8, grpc.StatusCode.INVALID_ARGUMENT, f"{len(good) + 8} bytes, its header and tables say {len(good)}")
    # a frame whose grads agree with its own header but not with the table: dim 4 for a dim-8 table
    _refused(push, _good_push(dim=4), grpc.StatusCode.INVALID_ARGUMENT,
             "table 'user': push frame says grads dim 4, the table's dim is 8")
    _unchanged(fleet, client, before)


def test_unknown_table_bad_ids_and_flags(one) -> None:
    fleet, client, pull, push, before = one
    _refused(push, _good_push(table="nope"), grpc.StatusCode.INVALID_ARGUMENT, "unknown table 'nope'", "'user'")
    _refused(pull, frame.encode_pull_request([("nope", IDS, None)], map_version=0, fp16=False, worker_id="", step=None),
             grpc.StatusCode.INVALID_ARGUMENT, "unknown table 'nope'")
    # the second table is bad: the first (valid) one must not be applied either
    g = np.ones((IDS.size, 8), np.float32)
    two = frame.encode_push_request([("user", IDS, g, None), ("nope", IDS, g, None)], grad_dtype=DType.FP32,
                                    map_version=0, worker_id="", step=None)
    _refused(push, two, grpc.StatusCode.INVALID_ARGUMENT, "unknown table 'nope'")
    neg = _good_push(ids=np.array([1, -3], np.int64))
    _refused(push, neg, grpc.StatusCode.INVALID_ARGUMENT, "table 'user': ids must be >= 0, got -3 at position 1")
    flags = bytearray(_good_push())
    flags[6] = 0x80
    _refused(push, bytes(flags), grpc.StatusCode.INVALID_ARGUMENT, "unknown flag bits 0x80")
    nan = np.ones((IDS.size, 8), np.float32)
    nan[3, 1] = np.nan
    _refused(push, frame.encode_push_request([("user", IDS, nan, None)], grad_dtype=DType.FP32, map_version=0,
                                             worker_id="", step=None),
             grpc.StatusCode.INVALID_ARGUMENT, "1 gradient row(s) contain NaN/Inf (first: id 4 at position 3)")
    bad_map = frame.encode_push_request([("user", IDS, g, None)], grad_dtype=DType.FP32, map_version=5, worker_id="", step=None)
    _refused(push, bad_map, grpc.StatusCode.FAILED_PRECONDITION, "routed with partition map v5")
    errors = fleet.servers[0].metrics.errors.labels("0", "PushMany", "INVALID_ARGUMENT")._value.get()
    assert errors >= 5  # the frame methods count under the method they stand for
    _unchanged(fleet, client, before)


def test_frames_need_the_token(one) -> None:
    fleet, client, pull, push, before = one
    anon = make_channel(fleet.addresses[0], RpcConfig(timeout_s=10.0)).unary_unary(frame.PUSH_PATH)
    _refused(anon, _good_push(), grpc.StatusCode.UNAUTHENTICATED)
    _unchanged(fleet, client, before)


# -- frame path == protobuf path -----------------------------------------------------------------
def _adagrad_tables() -> list[TableConfig]:
    opt = OptimizerConfig(kind=OptimizerKind.ROWWISE_ADAGRAD, lr=0.05)
    return [TableConfig(name="user", dim=16, capacity=4096, optimizer=opt),
            TableConfig(name="item", dim=8, capacity=4096, optimizer=OptimizerConfig(kind=OptimizerKind.ADAM, lr=0.01))]


@pytest.mark.parametrize("dtype", ["fp32", "fp16"])
def test_frame_and_protobuf_paths_agree_bit_for_bit(ps_fleet, dtype: str) -> None:
    """Two identical 2-shard fleets, one client each (framed / protobuf): the same pushes
    (duplicate ids, several tables, requests split across shards and by a row cap) give
    the same counts and the same rows, bit for bit."""
    tables = _adagrad_tables()
    fleets = [ps_fleet(2, tables=tables, num_vshards=16) for _ in range(2)]
    clients = [f.client(framed=framed, value_dtype=dtype, grad_dtype=dtype, max_request_rows=300)
               for f, framed in zip(fleets, (True, False))]
    assert clients[0].framed and not clients[1].framed
    rng = np.random.default_rng(3)
    for step in range(4):
        u = rng.integers(0, 1500, 700).astype(np.int64)  # duplicates: summed client-side
        i = rng.permutation(900)[:500].astype(np.int64)  # unique: sent in request order
        batch = {"user": (u, rng.standard_normal((u.size, 16)).astype(np.float32)),
                 "item": (i, rng.standard_normal((i.size, 8)).astype(np.float32) * 100)}
        counts = [c.push(batch) for c in clients]
        assert counts[0] == counts[1]
        pulled = [c.pull({"user": u[::-1], "item": i}) for c in clients]
        for t in ("user", "item"):
            assert pulled[0][t].dtype == np.float32
            assert pulled[0][t].tobytes() == pulled[1][t].tobytes(), (step, t)
    # the framed client stayed on the frame methods (no fallback), the other on PullMany/PushMany;
    # both count in metrics under PullMany/PushMany
    assert clients[0].framed and not clients[1].framed
    for f in fleets:
        reg = f.servers[0].metrics.registry
        assert reg.get_sample_value("metaps_ps_rpc_seconds_count", {"shard": "0", "method": "PullMany"}) >= 4


def test_an_empty_pull_still_learns_the_dim(ps_fleet) -> None:
    fleet = ps_fleet(2)
    out = fleet.client().pull({"user": np.zeros(0, np.int64), "item": np.array([3, 3, 1], np.int64)})
    assert out["user"].shape == (0, 8) and out["item"].shape == (3, 4)
    np.testing.assert_array_equal(out["item"][0], out["item"][1])


def test_frame_pull_waits_for_a_slow_worker_and_agrees_with_protobuf(ps_fleet) -> None:
    """Bounded staleness on the frame path: the stale_wait answer and client-side wait are the same."""
    fleet = ps_fleet(2, max_staleness=1)
    fast = fleet.client(worker_id="fast", register=True)  # framed
    slow = fleet.client(worker_id="slow", register=True, framed=False)
    ids = np.arange(40, dtype=np.int64)
    g = np.ones((40, 8), np.float32)
    for step in range(2):
        fast.pull({"user": ids}, step=step)
        fast.push({"user": (ids, g)}, step=step)
    result: dict[str, np.ndarray] = {}
    done = threading.Event()

    def ahead() -> None:
        result["rows"] = fast.pull({"user": ids}, step=2)["user"]  # 2 ahead of slow's clock 0
        done.set()

    t = threading.Thread(target=ahead)
    t.start()
    answers = fleet.servers[0].metrics.wait_answers.labels("0", "PullMany", "stale_wait")
    deadline = time.monotonic() + 30  # poll until the shard told the framed pull to wait (no fixed sleep)
    while not answers._value.get() and time.monotonic() < deadline:
        time.sleep(0.01)
    assert answers._value.get() >= 1, "the framed pull was not told to wait"
    assert not done.is_set()
    slow.pull({"user": ids}, step=0)
    slow.push({"user": (ids, g)}, step=0)
    assert done.wait(30)
    t.join(10)
    assert fast.stale_wait_s > 0
    np.testing.assert_array_equal(result["rows"], slow.pull({"user": ids}, step=1)["user"])


def test_frame_header_layout_is_fixed() -> None:
    """The header is 32 bytes, little-endian, fields where the module doc says."""
    data = frame.encode_pull_request([("t", np.array([1], np.int64), None)], map_version=0x0102, fp16=True,
                                     worker_id="ab", step=5)
    magic, version, kind, flags, _, mv, step, wlen, ntables, _ = struct.unpack_from("<4sBBBBqqHHI", data)
    assert (magic, version, kind, flags, mv, step, wlen, ntables) == (b"MPSF", 1, 1, 3, 0x0102, 5, 2, 1)
    assert frame.HEADER_BYTES == 32
    with pytest.raises(WireError, match="n must be >= 0, got -1"):
        bad = bytearray(data)
        struct.pack_into("<q", bad, 40, -1)
        frame.decode_pull_request(bytes(bad))


@pytest.mark.parametrize("offset, fmt, value, message", [
    (24, "<H", 1000, "pull request frame: worker id of 1000 bytes at offset 32 runs past the end"),
    (32, "<B", 0xFF, "pull request frame: worker id is not UTF-8"),
    (52, "<H", 5000, "pull request frame: table 0 of 1: name of 5000 bytes at offset 56 runs past the end"),
    (56, "<B", 0xFF, "pull request frame: table 0 of 1: name is not UTF-8"),
])
def test_worker_id_and_table_name_are_bounded_and_utf8(offset: int, fmt: str, value: int, message: str) -> None:
    # header 32 B, worker "ab" padded to 8 (32..39), table descriptor 40..55 (name length at 52), name "t" at 56
    data = bytearray(frame.encode_pull_request([("t", np.array([1], np.int64), None)], map_version=1, fp16=False,
                                               worker_id="ab", step=None))
    struct.pack_into(fmt, data, offset, value)
    with pytest.raises(WireError) as err:
        frame.decode_pull_request(bytes(data))
    assert str(err.value).startswith(message), str(err.value)


def test_framed_pull_rows_are_writable_views_of_the_reply(ps_fleet) -> None:
    """A whole reply's rows come back without the 4 MiB copy that made them writable: a
    writable view of the received frame, kept alive by the array, independent of later pulls."""
    import gc

    fleet = ps_fleet(1)
    ids = np.arange(300, dtype=np.int64)
    framed, plain = fleet.client(), fleet.client(framed=False)
    framed.push({"user": (ids, np.full((ids.size, 8), 0.5, np.float32))})
    rows = framed.pull({"user": ids})["user"]
    assert rows.flags.writeable and not rows.flags.owndata  # a view, not a copy
    want = plain.pull({"user": ids})["user"]
    assert want.flags.writeable
    gc.collect()
    np.testing.assert_array_equal(rows, want)
    rows[:] = 7.0  # the caller owns it: writing changes neither the PS nor the next pull
    again = framed.pull({"user": ids})["user"]
    np.testing.assert_array_equal(again, want)
    assert not np.shares_memory(again, rows)


def test_push_request_views_are_writable_only_when_asked() -> None:
    """The shard decodes its (exclusively held) request with writable views, so the store
    takes the gradients without copying them; by default the views are read-only."""
    ids = np.arange(6, dtype=np.int64)
    data = frame.encode_push_request([("u", ids, np.ones((6, 8), np.float32), None)], grad_dtype=DType.FP32,
                                     map_version=0, worker_id="", step=None)
    ro = frame.decode_push_request(data).tables[0]
    assert not ro.values.flags.writeable and not ro.ids.flags.writeable
    rw = frame.decode_push_request(data, writable=True).tables[0]
    assert rw.values.flags.writeable and np.shares_memory(rw.values, ro.values)
    np.testing.assert_array_equal(rw.values, 1.0)


def test_a_client_falls_back_to_protobuf_on_a_shard_without_frames(ps_fleet) -> None:
    """A shard of an older build (no PullFrame/PushFrame: UNIMPLEMENTED) is served through
    PullMany/PushMany: the framed client switches once, nothing is applied twice."""
    from common.rpc import add_port, make_server
    from ps.servicer import _add_servicer, _Handlers

    fleet = ps_fleet(1)
    cap = _Handlers()
    _add_servicer(fleet.servers[0], cap)  # the shard's handlers, as registered
    old_handlers = {m: h for m, h in cap.handlers.items() if m not in (frame.PULL_METHOD, frame.PUSH_METHOD)}
    old = make_server(fleet.rpc, max_workers=4)
    old.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(cap.service, old_handlers),))
    port = add_port(old, "127.0.0.1:0", fleet.rpc)
    old.start()
    try:
        from ps.client import PsClient

        client = PsClient([f"127.0.0.1:{port}"], fleet.rpc, worker_id="w", register=True)
        assert client.framed
        ids = np.array([5, 1, 5, 9], np.int64)
        counts = client.push({"user": (ids, np.ones((4, 8), np.float32))}, step=0)
        assert not client.framed and counts["user"]["rows"] == 3
        rows = client.pull({"user": ids})["user"]
        np.testing.assert_array_equal(rows, fleet.client(framed=False).pull({"user": ids})["user"])
        assert fleet.servers[0].metrics.registry.get_sample_value("metaps_ps_rows_pushed_total", {"shard": "0", "table": "user"}) == 3  # applied once
        client.close()
    finally:
        old.stop(0)
