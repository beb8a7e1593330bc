"""The DD row-gradient combine (``workers.dd.combine_row_grads``): one optimizer update per row per step.

Two real processes join a gloo group, as DD workers do, and for 4 steps each one
hands the combine its own share-scaled row gradients (uneven shares 0.7/0.3,
overlapping ids, rank 1 idle on one step: rank 0 then pushes every id; tables of
dims 8 and 4, interleaved), then pushes what the combine gives it to
two real PS shards over gRPC on 127.0.0.1. One table per row optimizer the PS offers
(``ps.config.OptimizerKind``). Checked against a single-process reference
(an in-process ``ShardStore`` with the same tables) that applies, per step, the
global batch's gradient (each id's share-weighted sum over the ranks) in ONE push:

* every row equals the reference, for every optimizer (rtol 1e-5);
* most rows moved from their initial values (a run that updates nothing cannot pass);
* the test has teeth: applying each rank's scaled gradient as its own update (what
  the DD loop did before the combine) differs from the reference for every
  optimizer but SGD.
"""

from __future__ import annotations

import dataclasses
import multiprocessing as mp
import os
from pathlib import Path

import numpy as np
import pytest
import torch

from common.rpc import RpcConfig
from ps.client import PsClient
from ps.config import InitKind, OptimizerConfig, OptimizerKind, PsConfig, TableConfig
from tests.ports import pick_port
from tests.workers.procs import TOKEN

DIMS = {OptimizerKind.SGD: 8, OptimizerKind.ADAGRAD: 4, OptimizerKind.ROWWISE_ADAGRAD: 8, OptimizerKind.ADAM: 4,
        OptimizerKind.FTRL: 8}  # two dims, interleaved: the combine sums each dim's tables together
WORLD = 2
STEPS = 4
SHARES = (0.7, 0.3)
ID_SPACE = 64
OPTS = {
    OptimizerKind.SGD: OptimizerConfig(kind=OptimizerKind.SGD, lr=0.1),
    OptimizerKind.ADAGRAD: OptimizerConfig(kind=OptimizerKind.ADAGRAD, lr=0.1),
    OptimizerKind.ROWWISE_ADAGRAD: OptimizerConfig(kind=OptimizerKind.ROWWISE_ADAGRAD, lr=0.1),
    OptimizerKind.ADAM: OptimizerConfig(kind=OptimizerKind.ADAM, lr=0.05),
    OptimizerKind.FTRL: OptimizerConfig(kind=OptimizerKind.FTRL, ftrl_alpha=0.1, ftrl_l1=0.001, ftrl_l2=0.01),
}


def _tables() -> list[TableConfig]:
    return [TableConfig(name=k.value, dim=DIMS[k], capacity=256, optimizer=opt,
                        init=InitKind.ZEROS if k is OptimizerKind.FTRL else InitKind.NORMAL)
            for k, opt in OPTS.items()]


def _ps_cfg() -> PsConfig:
    return PsConfig(shards=2, num_vshards=16, device="cpu")


def _active(rank: int, step: int) -> bool:
    return not (rank == 1 and step == 1)


def _rank_grads(rank: int, step: int) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """Rank ``rank``'s unique ids and share-scaled gradients per table at ``step`` ({} when idle)."""
    if not _active(rank, step):
        return {}
    out = {}
    for k, t in enumerate(OPTS):
        g = np.random.default_rng([rank, step, k])
        # table t draws from [16 j, 16 j + 16], j = its place among the tables of its dim, and always holds
        # both ends: the next table of its dim starts with this one's last id (the sum must not merge
        # them). Both ranks draw from the same 17 ids: most ids are shared.
        j = [u for u in OPTS if DIMS[u] == DIMS[t]].index(t)
        inner = g.choice(np.arange(16 * j + 1, 16 * j + 16), size=10, replace=False)
        ids = np.sort(np.concatenate([[16 * j, 16 * j + 16], inner])).astype(np.int64)
        grads = (g.standard_normal((ids.size, DIMS[t])) * SHARES[rank]).astype(np.float32)
        out[t.value] = (ids, grads)
    return out


def _rank_main(rank: int, addr: str, ps_addrs: list[str]) -> None:
    """One DD rank: collective A's counts, the combine, the push, then a barrier (collective B)."""
    import torch.distributed as dist

    from workers.dd import combine_row_grads

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://{addr}", rank=rank, world_size=WORLD)
    client = PsClient(ps_addrs, RpcConfig(token=TOKEN))
    tables = [(t.name, t.dim) for t in _tables()]
    try:
        for step in range(STEPS):
            grads = _rank_grads(rank, step)
            head = torch.zeros(WORLD, 1 + len(tables), dtype=torch.float64)
            head[rank, 0] = float(bool(grads))
            head[rank, 1:] = torch.tensor([float(len(grads[t][0])) if t in grads else 0.0 for t, _ in tables])
            dist.all_reduce(head)
            pushers = [r for r in range(WORLD) if head[r, 0] > 0]
            mine = combine_row_grads(grads, tables, head[:, 1:].to(torch.int64), pushers, rank)
            if grads:
                client.push(mine)
            dist.barrier()  # every step-t update is applied before any rank pushes step t+1
    finally:
        client.close()
        dist.destroy_process_group()


def _reference(per_rank: bool) -> dict[str, np.ndarray]:
    """A single process: per step, the summed gradient in one push (or, per_rank, one push per rank).

    Returns every id's final row per table."""
    from ps.shard_store import ShardStore
    from workers.row_source import LocalRowSource

    store = LocalRowSource(ShardStore([dataclasses.replace(t, capacity=512) for t in _tables()], shard_id=0,
                                      num_vshards=16, seed=_ps_cfg().seed))
    store.pull(_every())
    for step in range(STEPS):
        by_rank = [_rank_grads(r, step) for r in range(WORLD)]
        if per_rank:
            for grads in by_rank:
                if grads:
                    store.push(grads, step)
            continue
        merged = {}
        for k in OPTS:
            t = k.value
            ids = np.concatenate([g[t][0] for g in by_rank if g])
            grads = np.concatenate([g[t][1] for g in by_rank if g])
            uniq, inv = np.unique(ids, return_inverse=True)
            summed = torch.zeros((uniq.size, DIMS[k])).index_add_(0, torch.from_numpy(inv), torch.from_numpy(grads))
            merged[t] = (uniq, summed.numpy())
        store.push(merged, step)
    return store.pull(_every())


def _every() -> dict[str, np.ndarray]:
    return {k.value: np.arange(ID_SPACE, dtype=np.int64) for k in OPTS}


def test_dd_combine_gives_one_global_batch_update_for_every_optimizer(tmp_path: Path) -> None:
    from ps.factory import build_server  # here, not at the top: the rank processes import this module

    cfg, rpc = _ps_cfg(), RpcConfig(token=TOKEN)
    servers = [build_server(cfg, rpc, _tables(), k, wait_timeout_s=10.0) for k in range(cfg.shards)]
    addrs = [f"127.0.0.1:{s.start('127.0.0.1:0')}" for s in servers]
    every = _every()
    client = PsClient(addrs, rpc)
    try:
        init = client.pull(every)  # rows exist before any push, as a DD step pulls before it pushes
        ctx = mp.get_context("spawn")
        addr = f"127.0.0.1:{pick_port()}"
        os.environ.setdefault("OMP_NUM_THREADS", "1")
        procs = [ctx.Process(target=_rank_main, args=(r, addr, addrs)) for r in range(WORLD)]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=120)
        codes = [p.exitcode for p in procs]
        for p in procs:
            if p.is_alive():
                p.kill()
        assert codes == [0] * WORLD, f"rank exit codes {codes}"
        got = client.pull(every)
    finally:
        client.close()
        for s in servers:
            s.stop(0)

    want = _reference(per_rank=False)
    naive = _reference(per_rank=True)
    for k in OPTS:
        t = k.value
        w, g, n0 = want[t], got[t], init[t]
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-6, err_msg=f"optimizer {t}: DD rows != global-batch step")
        touched = np.unique(np.concatenate([_rank_grads(r, s)[t][0] for r in range(WORLD) for s in range(STEPS)
                                            if _active(r, s)]))
        moved = np.abs(g - n0).max(axis=1)[touched] > 1e-6
        assert moved.mean() > 0.9, f"optimizer {t}: only {moved.mean():.0%} of the touched rows moved"
        assert np.array_equal(g[np.setdiff1d(every[t], touched)], n0[np.setdiff1d(every[t], touched)]), t
        gap = float(np.abs(naive[t] - w).max())
        if k is OptimizerKind.SGD:
            assert gap < 1e-5, f"sgd: per-rank pushes should add up (gap {gap})"
        else:
            assert gap > 1e-3, f"optimizer {t}: per-rank pushes match the global step too (gap {gap}): no teeth"


@pytest.fixture(autouse=True)
def _no_cuda(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
