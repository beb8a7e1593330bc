"""Delta checkpoints through the real service: checkpoint_all over gRPC, Restore, full fallback.

Real in-process shard servers on 127.0.0.1 (tests/ps/conftest.py) and real files.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

import numpy as np
import torch

from ps.checkpoint import checkpoint_chain, read_changes, read_manifest
from ps.config import OptimizerConfig, OptimizerKind, TableConfig
from ps.coordinator import checkpoint_all, restore_shard_checkpoint

from .conftest import Fleet

torch.set_num_threads(1)

OPT = OptimizerConfig(kind=OptimizerKind.ROWWISE_ADAGRAD, lr=0.1)
TABLES = [TableConfig(name="user", dim=8, capacity=1024, optimizer=OPT),
          TableConfig(name="item", dim=4, capacity=1024, optimizer=OPT)]
V = 32


def _push(fleet: Fleet, ids: np.ndarray, seed: int) -> None:
    rng = np.random.default_rng(seed)
    fleet.client().push({"user": (ids, rng.standard_normal((ids.size, 8)).astype(np.float32))})


def _rows(fleet: Fleet) -> dict[str, bytes]:
    out = {}
    for name in ("user", "item"):
        parts = [s.store.all_rows(name) for s in fleet.servers]
        ids = np.concatenate([p.ids for p in parts])
        o = np.argsort(ids)
        out[name] = ids[o].tobytes() + np.concatenate([p.weights for p in parts])[o].tobytes() + \
            np.concatenate([p.state["momentum"] for p in parts])[o].tobytes()
    return out


def test_fleet_deltas_restore_and_fall_back_to_full(ps_fleet: Callable[..., Fleet], tmp_path: Path) -> None:
    fleet = ps_fleet(2, tables=TABLES, num_vshards=V)
    root = tmp_path / "ckpt"
    _push(fleet, np.arange(300, dtype=np.int64), seed=0)
    c1 = checkpoint_all(fleet.addresses, root, 1, rpc_cfg=fleet.rpc, full_every=3)
    _push(fleet, np.arange(20, dtype=np.int64), seed=1)
    c2 = checkpoint_all(fleet.addresses, root, 2, rpc_cfg=fleet.rpc, full_every=3)
    assert [read_manifest(c)["kind"] for c in (c1, c2)] == ["full", "delta"]
    assert sorted(read_changes(c2, "user")[0].ids.tolist()) == list(range(20))
    want = _rows(fleet)

    # the live shards move on; a restore of the delta brings back exactly the state at ckpt-2
    _push(fleet, np.arange(500, 600, dtype=np.int64), seed=2)
    for s in fleet.servers:
        restore_shard_checkpoint(s, c2)
    assert _rows(fleet) == want

    # after the restore the shards know ckpt-2: the next checkpoint is a delta holding only new changes
    _push(fleet, np.array([7, 8], dtype=np.int64), seed=3)
    c3 = checkpoint_all(fleet.addresses, root, 3, rpc_cfg=fleet.rpc, full_every=4)
    assert read_manifest(c3)["kind"] == "delta"
    assert sorted(read_changes(c3, "user")[0].ids.tolist()) == [7, 8]
    assert [p.name for p, _ in checkpoint_chain(c3)] == ["ckpt-1", "ckpt-2", "ckpt-3"]

    # a shard that lost its cuts (restarted empty-handed) cannot write the delta: the same cut is retaken full
    fleet.servers[1].store._cuts.clear()
    c4 = checkpoint_all(fleet.addresses, root, 4, rpc_cfg=fleet.rpc, full_every=8)
    assert read_manifest(c4)["kind"] == "full"
    want = _rows(fleet)
    _push(fleet, np.arange(900, 950, dtype=np.int64), seed=4)
    for s in fleet.servers:
        restore_shard_checkpoint(s, c4)
    assert _rows(fleet) == want
