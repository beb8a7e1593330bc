"""Ids spread over several shards behave exactly like one shard; ``ps/routing.py`` unit-tested without gRPC."""

from __future__ import annotations

import numpy as np
import pytest

from common.hashing import vshard_of
from protos import ps_pb2
from ps import routing, wire
from ps.config import OptimizerConfig, OptimizerKind, TableConfig
from ps.partition_map import PartitionMap


def _tables() -> list[TableConfig]:
    # Rowwise Adagrad: non-linear, so any misrouted or doubled update shows.
    opt = OptimizerConfig(kind=OptimizerKind.ROWWISE_ADAGRAD, lr=0.1)
    return [TableConfig(name="user", dim=8, capacity=4096, optimizer=opt),
            TableConfig(name="item", dim=4, capacity=4096, optimizer=opt)]


def test_partition_map_routing_is_vectorized_and_versioned() -> None:
    pmap = PartitionMap.initial(3, 12)
    assert pmap.owners.tolist() == [0, 1, 2] * 4
    ids = np.arange(10_000, dtype=np.int64)
    shards = pmap.shard_of(ids)
    assert set(np.unique(shards).tolist()) == {0, 1, 2}
    moved = pmap.moved({0: 2})
    assert moved.version == 1 and moved.owners[0] == 2 and pmap.owners[0] == 0
    assert PartitionMap.from_proto(moved.to_proto()).same_assignment(moved)
    assert PartitionMap.from_dict(moved.to_dict()).version == 1


def test_three_shards_equal_one_shard(ps_fleet) -> None:
    one = ps_fleet(1, tables=_tables()).client()
    three = ps_fleet(3, tables=_tables()).client()
    rng = np.random.default_rng(0)
    users = rng.integers(0, 1 << 40, 600)
    items = rng.integers(0, 50, 300)  # many duplicates
    assert len(np.unique(three.pmap.shard_of(users))) == 3

    a, b = one.pull({"user": users, "item": items}), three.pull({"user": users, "item": items})
    for t in ("user", "item"):
        np.testing.assert_array_equal(a[t], b[t])

    for step in range(4):
        idx_u = rng.integers(0, users.size, 400)
        idx_i = rng.integers(0, items.size, 200)
        grads = {
            "user": (users[idx_u], rng.standard_normal((400, 8)).astype(np.float32)),
            "item": (items[idx_i], rng.standard_normal((200, 4)).astype(np.float32)),
        }
        ca, cb = one.push(grads), three.push(grads)
        assert ca == cb
        a, b = one.pull({"user": users, "item": items}), three.pull({"user": users, "item": items})
        for t in ("user", "item"):
            np.testing.assert_allclose(a[t], b[t], rtol=0, atol=1e-6)
    assert not np.allclose(a["user"], one.pull({"user": users + 1})["user"])  # rows really changed


def test_every_shard_gets_a_request_only_for_its_ids(ps_fleet) -> None:
    fleet = ps_fleet(3, tables=_tables())
    client = fleet.client()
    ids = np.arange(3000, dtype=np.int64)
    client.pull({"user": ids})
    per_shard = [s.metrics.registry.get_sample_value("metaps_ps_rows_pulled_total", {"shard": str(s.shard_id), "table": "user"})
                 for s in fleet.servers]
    expected = np.bincount(client.pmap.shard_of(ids), minlength=3)
    assert per_shard == expected.tolist()


# -- ps/routing.py without gRPC -------------------------------------------------------------------

DIM = 3


def _row_of(ids: np.ndarray) -> np.ndarray:
    """What a fake shard answers for an id: a row that names it."""
    return np.stack([ids.astype(np.float32), ids.astype(np.float32) * 2, np.full(ids.size, 7.0, np.float32)], axis=1)


def _answer(req: ps_pb2.PullManyRequest) -> ps_pb2.PullManyResponse:
    resp = ps_pb2.PullManyResponse()
    for t in req.tables:
        ids = wire.decode_ids(t.ids, table=t.table)
        resp.tables.add(table=t.table, values=wire.encode_rows(_row_of(ids)), dtype=wire.DType.FP32.proto, dim=DIM,
                        rows=int(ids.size))
    return resp


def _pull(ids: dict[str, np.ndarray], pmap: PartitionMap, cap: int, reverse: bool = False) -> dict[str, np.ndarray]:
    """The client's pull path, every step pure: dedup, plan, build, (fake) answer, scatter, gather."""
    jobs, inverse = [], []
    for table, t_ids in ids.items():
        uniq, inv = np.unique(t_ids, return_inverse=True)
        jobs.append(routing.Job(table, uniq))
        inverse.append(inv)
    planned = routing.plan(jobs, routing.everything(jobs), pmap, cap, probe=range(len(jobs)))
    dims: dict[str, int] = {}
    for p in (planned[::-1] if reverse else planned):
        req = routing.pull_request(jobs, p.pieces, map_version=pmap.version, fp16=False, worker_id="w", step=None)
        routing.scatter_pull(jobs, p.pieces, _answer(req), dims)
    routing.finish_pull(jobs, dims)
    return {j.table: j.out[inv] for j, inv in zip(jobs, inverse)}


def test_split_by_owner_sends_each_id_to_its_owner_once_in_order() -> None:
    pmap = PartitionMap.initial(3, 12).moved({0: 2, 5: 0})
    ids = np.unique(np.random.default_rng(1).integers(0, 1 << 50, 2000))
    pos = np.arange(ids.size)[::2]  # a subset, as after a partial refusal
    parts = routing.split_by_owner(ids, pos, pmap)
    assert set(parts) == {0, 1, 2}
    for s, part in parts.items():
        assert (pmap.owners[vshard_of(ids[part], pmap.num_vshards)] == s).all()
        assert (np.diff(part) > 0).all()  # order kept within a shard
    assert sorted(np.concatenate(list(parts.values())).tolist()) == pos.tolist()  # each exactly once
    assert routing.split_by_owner(ids, pos[:0], pmap) == {}


def test_chunks_cut_at_the_cap_and_pack_tables_together() -> None:
    a, b = np.arange(5), np.arange(10, 13)
    out = list(routing.chunks([(0, a), (1, b)], cap=3))
    assert [[(j, p.tolist()) for j, p in c] for c in out] == [
        [(0, [0, 1, 2])], [(0, [3, 4]), (1, [10])], [(1, [11, 12])]]
    exact = list(routing.chunks([(0, np.arange(6))], cap=3))
    assert [[p.tolist() for _, p in c] for c in exact] == [[[0, 1, 2]], [[3, 4, 5]]]  # no empty tail request
    assert list(routing.chunks([], cap=3)) == [[]]  # a clock-only shard still gets one (empty) request
    empty = list(routing.chunks([(0, np.arange(0))], cap=3))
    assert len(empty) == 1 and empty[0][0][1].size == 0


def test_plan_respects_cap_and_covers_every_row() -> None:
    pmap = PartitionMap.initial(2, 8)
    jobs = [routing.Job("user", np.arange(1000, dtype=np.int64)), routing.Job("item", np.arange(37, dtype=np.int64))]
    planned = routing.plan(jobs, routing.everything(jobs), pmap, cap=64)
    assert all(p.rows <= 64 for p in planned)
    for j, job in enumerate(jobs):
        got = np.concatenate([pos for p in planned for jj, pos in p.pieces if jj == j])
        assert sorted(got.tolist()) == list(range(job.ids.size))
    for p in planned:
        for j, pos in p.pieces:
            assert (pmap.shard_of(jobs[j].ids[pos]) == p.shard).all()


def test_empty_input_plans_no_rows_but_probes_and_clocks() -> None:
    pmap = PartitionMap.initial(3, 12)
    jobs = [routing.Job("user", np.zeros(0, dtype=np.int64))]
    assert routing.plan(jobs, routing.everything(jobs), pmap, cap=8) == []
    probe = routing.plan(jobs, routing.everything(jobs), pmap, cap=8, probe=[0])
    assert [(p.shard, p.rows, len(p.pieces)) for p in probe] == [(0, 0, 1)]  # asks shard 0 for the dim
    clocks = routing.plan(jobs, routing.everything(jobs), pmap, cap=8, every_shard=range(3))
    assert sorted(p.shard for p in clocks) == [0, 1, 2] and all(p.rows == 0 for p in clocks)
    out = _pull({"user": np.zeros(0, dtype=np.int64)}, pmap, cap=8)
    assert out["user"].shape == (0, DIM)


def test_scatter_puts_rows_back_in_request_order_with_duplicates() -> None:
    pmap = PartitionMap.initial(3, 12)
    rng = np.random.default_rng(2)
    ids = {"user": rng.integers(0, 1 << 40, 500), "item": rng.integers(0, 20, 300)}  # item: many duplicates
    for cap in (1, 7, 64, 10_000):
        for reverse in (False, True):  # shards answering in any order
            out = _pull(ids, pmap, cap, reverse)
            for t, t_ids in ids.items():
                np.testing.assert_array_equal(out[t], _row_of(t_ids))


def test_scatter_refuses_a_reply_that_does_not_match_the_request() -> None:
    jobs = [routing.Job("user", np.array([1, 2], dtype=np.int64))]
    pieces = [(0, np.arange(2))]
    wrong = ps_pb2.PullManyResponse()
    wrong.tables.add(table="item", values=wire.encode_rows(_row_of(np.array([1, 2]))), dtype=wire.DType.FP32.proto,
                     dim=DIM, rows=2)
    try:
        routing.scatter_pull(jobs, pieces, wrong, {})
    except wire.WireError as exc:
        assert "'item'" in str(exc) and "'user'" in str(exc)
    else:
        raise AssertionError("a reply for another table was accepted")


def test_requests_carry_map_version_clock_and_aggregated_grads() -> None:
    grads = np.arange(12, dtype=np.float32).reshape(4, 3)
    jobs = [routing.Job("user", np.array([3, 5, 8, 13], dtype=np.int64), grads=grads)]
    pieces = [(0, np.array([1, 3]))]
    push = routing.push_request(jobs, pieces, map_version=4, grad_dtype=wire.DType.FP32, worker_id="w1", step=9)
    assert (push.map_version, push.worker_id, push.step) == (4, "w1", 9)
    t = push.tables[0]
    assert wire.decode_ids(t.ids).tolist() == [5, 13]
    np.testing.assert_array_equal(wire.decode_rows(t.grads, wire.DType.FP32, 2, 3), grads[[1, 3]])
    pull = routing.pull_request(jobs, pieces, map_version=4, fp16=True, worker_id="w1", step=None)
    assert pull.want_fp16 and not pull.HasField("step")
    counts = routing.new_counts(jobs)
    reply = ps_pb2.PushManyResponse()
    reply.tables.add(table="user", rows=2, applied=2)
    routing.add_push_counts(counts, reply)
    routing.add_push_counts(counts, reply)
    assert counts["user"]["rows"] == 4 and counts["user"]["applied"] == 4


# -- the PullMany reply codec (ps/wire.py): protobuf's format, without its copies ----------------
def _proto_reply(tables: list[tuple[str, np.ndarray, int]]) -> bytes:
    return ps_pb2.PullManyResponse(tables=[
        ps_pb2.TableValues(table=t, values=a.tobytes(), dtype=d, dim=a.shape[1], rows=a.shape[0]) for t, a, d in tables
    ]).SerializeToString()


def test_pull_reply_codec_speaks_protobuf_both_ways() -> None:
    rows = np.random.default_rng(3).standard_normal((300, 64)).astype(np.float32)
    half = wire.wire_rows(rows[:5, :8], wire.DType.FP16)
    empty = np.zeros((0, 4), np.float32)
    ours = wire.encode_pull_reply([("user", wire.DType.FP32, rows), ("item", wire.DType.FP16, half),
                                   ("none", wire.DType.FP32, empty)])
    theirs = _proto_reply([("user", rows, wire.DType.FP32.proto), ("item", half, wire.DType.FP16.proto),
                           ("none", empty, wire.DType.FP32.proto)])
    assert ps_pb2.PullManyResponse.FromString(ours) == ps_pb2.PullManyResponse.FromString(theirs)
    for buf in (ours, theirs):
        got = wire.decode_pull_reply(buf).tables
        assert [(t.table, t.dtype, t.dim, t.rows) for t in got] == [
            ("user", wire.DType.FP32.proto, 64, 300), ("item", wire.DType.FP16.proto, 8, 5), ("none", wire.DType.FP32.proto, 4, 0)]
        np.testing.assert_array_equal(wire.decode_rows(got[0].values, wire.DType.FP32, 300, 64), rows)
        np.testing.assert_array_equal(wire.decode_rows(got[1].values, wire.DType.FP16, 5, 8), half)
        assert got[2].values.nbytes == 0


def test_pull_reply_decoder_skips_unknown_fields_and_refuses_truncation() -> None:
    rows = np.arange(6, dtype=np.float32).reshape(2, 3)
    good = _proto_reply([("user", rows, wire.DType.FP32.proto)])
    # an unknown varint field (7) inside the table entry and an unknown bytes field (9) at the top
    entry = ps_pb2.TableValues(table="user", values=rows.tobytes(), dtype=1, dim=3, rows=2).SerializeToString() + b"\x38\x05"
    extra = b"\x0a" + bytes([len(entry)]) + entry + b"\x4a\x02\x0a\x00"  # field 9 holds what looks like a table
    got = wire.decode_pull_reply(extra).tables
    assert len(got) == 1 and got[0].table == "user" and got[0].rows == 2
    np.testing.assert_array_equal(wire.decode_rows(got[0].values, wire.DType.FP32, 2, 3), rows)
    # a fixed64 field (wire type 1) inside a table entry that runs past the entry's length
    overrun = b"\x0a\x04\x0a\x01u\x09" + b"\x4a\x08" + bytes(8)
    for i, bad_reply in enumerate([good[:1], good[:5], good[:-1], overrun]):
        try:
            wire.decode_pull_reply(bad_reply)
        except wire.WireError as exc:
            assert "pull reply" in str(exc)
        else:
            raise AssertionError(f"bad reply {i} was accepted")


# -- PushMany serialized without protobuf copies (routing.push_request_bytes) ---------------------
@pytest.mark.parametrize("dtype", [wire.DType.FP32, wire.DType.FP16])
@pytest.mark.parametrize("step", [None, 0, 12])
def test_push_request_bytes_parse_as_push_request(dtype: wire.DType, step: int | None) -> None:
    rng = np.random.default_rng(1)
    jobs = [
        routing.Job("user", np.array([9, -3, 5, 1 << 60], dtype=np.int64), grads=rng.standard_normal((4, 3)).astype(np.float32)),
        routing.Job("item", np.array([7], dtype=np.int64), grads=rng.standard_normal((1, 2)).astype(np.float32)),
        routing.Job("none", np.empty(0, dtype=np.int64), grads=np.empty((0, 5), np.float32)),
    ]
    for pieces in ([(0, np.arange(4)), (1, np.arange(1)), (2, np.arange(0))], [(0, np.array([3, 1]))]):
        kw = dict(map_version=7, grad_dtype=dtype, worker_id="w9", step=step)
        got = ps_pb2.PushManyRequest.FromString(routing.push_request_bytes(jobs, pieces, **kw))
        assert got == routing.push_request(jobs, pieces, **kw)
