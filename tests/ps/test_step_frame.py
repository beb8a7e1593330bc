"""StepFrame: a worker step's push, dense exchange and next pull in one message per shard.

Judged on what the shards hold, against a second fleet fed by the ordinary calls (PushFrame,
PushDense, PullFrame in that order): the same rows and dense values, bit for bit, on one shard
and on three (the ids and dense parameters split across them). A refused message changes
nothing on the shard (a NaN row gradient, an unknown dense name); a pull the shard cannot serve
after applying the push is deferred, and the client pulls by the ordinary path without pushing
twice. The codec refuses malformed messages with one line naming the field.
"""

from __future__ import annotations

import grpc
import numpy as np
import pytest
import torch

from ps import group_frame, step_frame
from ps.config import NonfiniteMode, OptimizerConfig, OptimizerKind, TableConfig
from ps.partition_map import dense_owner
from ps.wire import DType, WireError

DIM = 8
TABLES = [TableConfig(name=n, dim=DIM, capacity=4096, optimizer=OptimizerConfig(kind=OptimizerKind.ROWWISE_ADAGRAD))
          for n in ("user", "item", "tag")]
NAMES = ("user", "item", "tag")
DENSE = {"w1": np.linspace(-1, 1, 12, dtype=np.float32).reshape(3, 4), "b1": np.zeros(4, np.float32),
         "w2": np.ones((4, 2), np.float32), "b2": np.full(2, 0.5, np.float32)}
SIZES = [int(v.size) for v in DENSE.values()]


def _batch(rng: np.random.Generator) -> tuple[np.ndarray, torch.Tensor]:
    sizes = [int(rng.integers(1, 60)) for _ in NAMES]
    ids = [np.sort(rng.choice(3000, size=n, replace=False)).astype(np.int64) for n in sizes]
    return np.array(sizes, dtype=np.int64), torch.from_numpy(np.concatenate(ids))


def _dense_grads(rng: np.random.Generator) -> np.ndarray:
    return rng.standard_normal(sum(SIZES)).astype(np.float32)


def _held(servers) -> tuple[dict[str, tuple[np.ndarray, np.ndarray]], dict[str, np.ndarray]]:
    rows: dict[str, tuple[np.ndarray, np.ndarray]] = {}
    dense: dict[str, np.ndarray] = {}
    for s in servers:
        for t in NAMES:
            r = s.store.all_rows(t)
            ids, w = rows.get(t, (np.empty(0, np.int64), np.empty((0, DIM), np.float32)))
            rows[t] = (np.concatenate([ids, r.ids]), np.concatenate([w, r.weights]))
        dense.update(s.store.dense.pull(s.store.dense.names()))
    return {t: (i[np.argsort(i)], w[np.argsort(i)]) for t, (i, w) in rows.items()}, dense


@pytest.mark.parametrize("shards", [1, 3])
def test_a_step_message_equals_the_ordinary_calls(ps_fleet, shards: int) -> None:
    stepped, ref = ps_fleet(shards, tables=TABLES), ps_fleet(shards, tables=TABLES)
    cs, cr = stepped.client(worker_id="w0", register=True), ref.client(worker_id="w0", register=True)
    for c in (cs, cr):
        c.register_dense(DENSE)
    rng = np.random.default_rng(7)
    counts, ids = _batch(rng)
    rows = cs.pull_groups([NAMES], [counts], [ids], [DIM], step=0)[0]
    np.testing.assert_array_equal(rows.numpy(), cr.pull_groups([NAMES], [counts], [ids], [DIM], step=0)[0].numpy())
    names = list(DENSE)
    for step in range(5):
        grads = torch.randn(ids.numel(), DIM)
        dense = _dense_grads(rng)
        nxt_counts, nxt_ids = _batch(rng)
        got = cs.step_groups(push=([NAMES], [counts], [ids], [grads]), dense=(names, dense, SIZES),
                             pull=([NAMES], [nxt_counts], [nxt_ids], [DIM]), step=step)
        # the reference: push, dense (values back), then pull, each its own call
        want_counts = cr.push_groups([NAMES], [counts], [ids], [grads], step=step)
        offs = np.cumsum([0] + SIZES)
        want_dense = cr.push_dense({n: dense[offs[i]:offs[i + 1]] for i, n in enumerate(names)}, return_values=True)
        want_rows = cr.pull_groups([NAMES], [nxt_counts], [nxt_ids], [DIM], step=step + 1)[0]
        assert got.rows is not None and got.dense is not None
        np.testing.assert_array_equal(got.rows[0].numpy(), want_rows.numpy())
        np.testing.assert_array_equal(got.dense, np.concatenate([want_dense[n].reshape(-1) for n in names]))
        assert got.counts == want_counts
        counts, ids = nxt_counts, nxt_ids
    a, b = _held(stepped.servers), _held(ref.servers)
    for t in NAMES:
        np.testing.assert_array_equal(a[0][t][0], b[0][t][0])
        np.testing.assert_array_equal(a[0][t][1], b[0][t][1])
    for n in names:
        np.testing.assert_array_equal(a[1][n], b[1][n])
    # one message per shard per step: the stepped fleet served no ordinary push, pull or dense push
    for s in stepped.servers:
        served = {m for m in ("PushMany", "PushDense") if s.metrics.latency.labels(str(s.shard_id), m)._sum.get() > 0}
        assert not served, f"shard {s.shard_id} served {served} besides StepFrame"


def _message(client, counts: np.ndarray, ids: torch.Tensor, grads: torch.Tensor, dense: np.ndarray | None,
             names: list[str] | None = None, pull_step: int = 1) -> bytes:
    pmap = client.pmap
    push = group_frame.encode_push([(NAMES, counts, ids.numpy(), grads.numpy(), None)], grad_dtype=client.grad_dtype,
                                   map_version=pmap.version, worker_id="w0", step=0)
    pull = group_frame.encode_pull([(NAMES, counts, ids.numpy(), None)], fp16=False, map_version=pmap.version,
                                   worker_id="w0", step=pull_step)
    d = step_frame.encode_dense(names or list(DENSE), dense, SIZES) if dense is not None else None
    return step_frame.encode_step(step_frame.REQUEST, push=push, dense=d, pull=pull, flags=step_frame.FLAG_WANT_VALUES)


@pytest.mark.parametrize("bad", ["nan_rows", "nan_dense", "unknown_dense", "bad_dense_size"])
def test_a_refused_message_changes_nothing(ps_fleet, bad: str) -> None:
    fleet = ps_fleet(1, tables=TABLES, nonfinite_grads=NonfiniteMode.REJECT)
    client = fleet.client(worker_id="w0", register=True)
    client.register_dense(DENSE)
    rng = np.random.default_rng(3)
    counts, ids = _batch(rng)
    client.pull_groups([NAMES], [counts], [ids], [DIM], step=0)
    before = _held(fleet.servers)
    grads, dense, names = torch.randn(ids.numel(), DIM), _dense_grads(rng), None
    if bad == "nan_rows":
        grads[-1, 3] = float("nan")
    elif bad == "nan_dense":
        dense[-1] = float("inf")
    elif bad == "unknown_dense":
        names = ["w1", "b1", "w2", "b9"]
    msg = _message(client, counts, ids, grads, dense, names)
    if bad == "bad_dense_size":  # a descriptor that disagrees with the parameter's registered size
        d = step_frame.encode_dense(["w1", "b1", "w2", "b2"], np.zeros(sum(SIZES), np.float32), [11, 5, 8, 2])
        msg = step_frame.encode_step(step_frame.REQUEST, push=None, dense=d, pull=None)
    with pytest.raises(grpc.RpcError) as err:
        client._step_frame[0](msg, timeout=10)
    assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT, err.value.details()
    want = {"nan_rows": "NaN/Inf", "nan_dense": "dense 'b2'", "unknown_dense": "dense 'b9': unknown",
            "bad_dense_size": "dense 'w1': gradient of 11 values, the parameter has 12"}[bad]
    assert want in err.value.details(), err.value.details()
    after = _held(fleet.servers)
    for t in NAMES:
        np.testing.assert_array_equal(before[0][t][1], after[0][t][1])
    for n in DENSE:
        np.testing.assert_array_equal(before[1][n], after[1][n])


def test_a_deferred_pull_is_pulled_after_the_push_once(ps_fleet) -> None:
    """The pull is for a step the shard will not serve yet (another worker is slower): the push and
    dense parts are applied once, the reply says "deferred", and the client's ordinary pull (which
    waits) gets the rows; nothing is pushed twice."""
    fleet = ps_fleet(1, tables=TABLES, max_staleness=0)
    slow = fleet.client(worker_id="slow", register=True)
    fast = fleet.client(worker_id="fast", register=True, wait_timeout_s=10.0)
    fast.register_dense(DENSE)
    rng = np.random.default_rng(5)
    counts, ids = _batch(rng)
    grads, dense = torch.ones(ids.numel(), DIM), _dense_grads(rng)
    reply = step_frame.decode_step(fast._step_frame[0](_message(fast, counts, ids, grads, dense), timeout=10),
                                   step_frame.REPLY)
    assert reply.pull_deferred and "stale_wait" in reply.deferred_reason, reply.deferred_reason
    assert reply.dense is not None and reply.push is not None
    # the client does the same through step_groups: its pull waits until the slow worker catches up
    import threading

    def catch_up() -> None:
        slow.push_groups([NAMES], [counts], [ids], [torch.zeros(ids.numel(), DIM)], step=0)
        slow.push_groups([NAMES], [counts], [ids], [torch.zeros(ids.numel(), DIM)], step=1)

    threading.Timer(0.3, catch_up).start()
    got = fast.step_groups(push=([NAMES], [counts], [ids], [grads]), dense=(list(DENSE), dense, SIZES),
                           pull=([NAMES], [counts], [ids], [DIM]), step=1)
    assert got.rows is not None
    np.testing.assert_array_equal(got.rows[0].numpy(), fast.pull_groups([NAMES], [counts], [ids], [DIM])[0].numpy())
    stats = fleet.servers[0].store.all_rows("user")
    # two pushes of all-ones gradients (steps 0 and 1) and two of zeros: each row updated by the
    # optimizer exactly as two ones-pushes (rowwise Adagrad is not additive, so compare with a replay)
    replay = ps_fleet(1, tables=TABLES).client()
    for g in (torch.ones(ids.numel(), DIM), torch.zeros(ids.numel(), DIM), torch.zeros(ids.numel(), DIM),
              torch.ones(ids.numel(), DIM)):
        replay.push_groups([NAMES], [counts], [ids], [g])
    want = replay.pull_groups([NAMES], [counts], [ids], [DIM])[0].numpy()
    np.testing.assert_array_equal(got.rows[0].numpy(), want)
    assert stats.ids.size > 0


def test_the_codec_refuses_malformed_messages() -> None:
    d = step_frame.encode_dense(["a", "bb"], np.arange(5, dtype=np.float32), [2, 3])
    sec = step_frame.decode_dense(d)
    assert sec.names == ["a", "bb"] and sec.sizes == [2, 3]
    np.testing.assert_array_equal(sec.split()["bb"], [2, 3, 4])
    msg = step_frame.encode_step(step_frame.REQUEST, dense=d, pull=b"xyz", flags=step_frame.FLAG_WANT_VALUES)
    parts = step_frame.decode_step(msg, step_frame.REQUEST)
    assert parts.push is None and bytes(parts.pull or b"") == b"xyz" and parts.want_values
    with pytest.raises(WireError, match="step request: short envelope: 3 bytes"):
        step_frame.decode_step(b"abc", step_frame.REQUEST)
    with pytest.raises(WireError, match="step request: .* bytes, its envelope says"):
        step_frame.decode_step(msg + b"\0" * 8, step_frame.REQUEST)
    with pytest.raises(WireError, match="kind 1 .*expected 2"):
        step_frame.decode_step(msg, step_frame.REPLY)
    with pytest.raises(WireError, match="magic"):
        step_frame.decode_step(b"XXXX" + msg[4:], step_frame.REQUEST)
    with pytest.raises(WireError, match="dense part: .* bytes, its header and descriptors say"):
        step_frame.decode_dense(d[:-4])
    with pytest.raises(WireError, match="dense part: 4 floats for parameters of 5"):
        step_frame.encode_dense(["a", "bb"], np.arange(4, dtype=np.float32), [2, 3])


def test_dense_owners_split_the_message(ps_fleet) -> None:
    """With three shards each gets only the dense parameters it owns (and their values come back)."""
    fleet = ps_fleet(3, tables=TABLES)
    client = fleet.client(worker_id="w0", register=True)
    client.register_dense(DENSE)
    parts = client._dense_parts(list(DENSE), SIZES)
    assert {s: p.names for s, p in parts.items()} == {
        s: [n for n in DENSE if dense_owner(n, 3) == s] for s in {dense_owner(n, 3) for n in DENSE}}
    flat = np.concatenate([v.reshape(-1) for v in DENSE.values()])
    got = client.step_groups(dense=(list(DENSE), np.zeros_like(flat), SIZES))
    assert got.dense is not None
    np.testing.assert_allclose(got.dense, flat)  # a zero gradient leaves Adam's parameters where they were


def test_the_group_codec_refuses_malformed_frames() -> None:
    ids = np.array([5, 6, 7, 1, 2], np.int64)
    counts = np.array([3, 0, 2], np.int64)
    grads = np.arange(10, dtype=np.float32).reshape(5, 2)
    data = group_frame.encode_push([(("a", "b", "c"), counts, ids, grads, np.array([0, 1, 2, 3, 4]))],
                                   grad_dtype=DType.FP32, map_version=3, worker_id="w", step=4)
    fr = group_frame.decode(data, group_frame.PUSH_REQUEST)
    g = fr.groups[0]
    assert (fr.map_version, fr.step, fr.worker_id, g.names) == (3, 4, "w", ("a", "b", "c"))
    np.testing.assert_array_equal(g.counts, counts)
    np.testing.assert_array_equal(g.ids, ids)
    np.testing.assert_array_equal(g.values, grads)
    part = group_frame.decode(group_frame.encode_pull([(("a", "b", "c"), np.array([1, 0, 1]), ids, np.array([0, 4]))],
                                                      fp16=True, map_version=1, worker_id="", step=None),
                              group_frame.PULL_REQUEST)
    assert part.fp16 and part.step is None
    np.testing.assert_array_equal(part.groups[0].ids, [5, 2])
    with pytest.raises(WireError, match="group push request: short header"):
        group_frame.decode(data[:20], group_frame.PUSH_REQUEST)
    with pytest.raises(WireError, match="kind 1 .*expected 2"):
        group_frame.decode(data, group_frame.PULL_REQUEST)
    with pytest.raises(WireError, match=r"grads \(5 x dim 2\) needs 40 bytes"):
        group_frame.decode(data[:-8], group_frame.PUSH_REQUEST)
    with pytest.raises(WireError, match="bytes, its header and groups say"):
        group_frame.decode(data + b"\0" * 8, group_frame.PUSH_REQUEST)
    bad = bytearray(data)
    off = 32 + 8 + 24 + 8  # header, worker id, descriptor, names: the counts vector
    bad[off:off + 8] = np.array([4], np.int64).tobytes()
    with pytest.raises(WireError, match=r"counts \[4, 0, 2\] do not add up to its 5 rows"):
        group_frame.decode(bytes(bad), group_frame.PUSH_REQUEST)
    with pytest.raises(WireError, match="table names must be non-empty without newlines"):
        group_frame.encode_pull([(("a\nb",), np.array([1]), ids[:1], None)], fp16=False, map_version=1,
                                worker_id="", step=None)


def test_a_remote_step_push_sums_repeated_ids_as_a_push_does(ps_fleet) -> None:
    """A StepFrame is untrusted: a table's repeated ids are summed, as PushFrame sums them."""
    stepped, ref = ps_fleet(1, tables=TABLES), ps_fleet(1, tables=TABLES)
    cs, cr = stepped.client(), ref.client()
    ids = np.array([3, 3, 9, 4, 4, 4, 11], np.int64)
    counts = np.array([3, 3, 1], np.int64)
    grads = np.random.default_rng(2).standard_normal((7, DIM)).astype(np.float32)
    msg = step_frame.encode_step(step_frame.REQUEST, push=group_frame.encode_push(
        [(NAMES, counts, ids, grads, None)], grad_dtype=DType.FP32, map_version=cs.pmap.version, worker_id="", step=None))
    step_frame.decode_step(cs._step_frame[0](msg, timeout=10), step_frame.REPLY)
    parts = np.split(np.arange(7), np.cumsum(counts)[:-1])
    cr.push({t: (ids[p], grads[p]) for t, p in zip(NAMES, parts)})
    a, b = _held(stepped.servers), _held(ref.servers)
    for t in NAMES:
        np.testing.assert_array_equal(a[0][t][0], b[0][t][0])
        np.testing.assert_array_equal(a[0][t][1], b[0][t][1])
