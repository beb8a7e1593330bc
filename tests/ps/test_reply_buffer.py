"""ps.reply_buffer: PullMany replies written in place equal ps.wire.encode_pull_reply byte for byte,
and a real shard's pull gathers straight into them."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from ps import reply_buffer, wire
from ps.config import OptimizerConfig, OptimizerKind, TableConfig
from ps.shard_store import ShardStore


def test_in_place_on_this_interpreter() -> None:
    assert reply_buffer.IN_PLACE  # CPython: the tests below exercise the uninitialized-bytes path


@pytest.mark.parametrize("shapes", [
    [("user", 3, 2)],
    [("user", 0, 8)],
    [("a", 5, 3), ("bb", 0, 4), ("c" * 200, 130, 7), ("d", 1, 1)],  # odd offsets, 2-byte varints
])
def test_bytes_equal_encode_pull_reply(shapes: list[tuple[str, int, int]]) -> None:
    rng = np.random.default_rng(len(shapes))
    for dtype in (wire.DType.FP32, wire.DType.FP16):
        arrays = [rng.standard_normal((n, d)).astype(dtype.numpy) for _, n, d in shapes]
        buf = reply_buffer.PullReplyBuffer([(name, dtype, n, d) for name, n, d in shapes])
        for i, a in enumerate(arrays):
            region = buf.rows(i)
            assert region.shape == a.shape and region.dtype == a.dtype and region.flags.writeable
            torch.from_numpy(region).copy_(torch.from_numpy(a))
        got = buf.bytes()
        assert type(got) is bytes
        assert got == wire.encode_pull_reply([(name, dtype, a) for (name, _, _), a in zip(shapes, arrays)])
        parsed = wire.decode_pull_reply(got)
        for (name, n, d), a, tv in zip(shapes, arrays, parsed.tables):
            assert (tv.table, tv.rows, tv.dim) == (name, n, d)
            np.testing.assert_array_equal(wire.decode_rows(tv.values, dtype, n, d), a)


def test_store_pull_into_a_reply_region() -> None:
    """Known ids (one index_select into the region), unknown ids (initial values) and a mix."""
    cfg = TableConfig(name="t", dim=8, capacity=100, optimizer=OptimizerConfig(kind=OptimizerKind.ROWWISE_ADAGRAD))
    store = ShardStore([cfg], shard_id=0, num_vshards=4, seed=1)
    known = np.array([40, 7, 19], dtype=np.int64)
    store.push("t", known, np.ones((3, 8), np.float32))
    for ids in (known, np.array([1000, 2000], dtype=np.int64), np.array([7, 1000, 40], dtype=np.int64)):
        buf = reply_buffer.PullReplyBuffer([("t", wire.DType.FP32, ids.size, 8)])
        region = buf.rows(0)
        assert store.pull("t", ids, out=region) is region
        tv = wire.decode_pull_reply(buf.bytes()).tables[0]
        np.testing.assert_array_equal(wire.decode_rows(tv.values, wire.DType.FP32, ids.size, 8), store.pull("t", ids))
