"""PS storage (in-process, no gRPC): pull/push rows/s per optimizer, bytes per row.

Run::

    python -m bench.ps_storage [--quick] [--device cpu|cuda]

Side by side in one run (this machine is noisy, so read the ratios):

* pull: ``ShardStore.pull`` of 16K known ids (dim 64) vs its floor, the fbgemm
  hash-map lookup plus ``index_select`` on the same table;
* push: ``ShardStore.push`` of 16K ids (with duplicates) per optimizer vs a bare
  TBE forward+backward (rowwise Adagrad) over the same rows;
* memory: ``ShardStore.memory_bytes()`` of a full 1M-row table vs the raw bytes of
  its rows + optimizer state, for dim 16 and 64.

The last line printed is a JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from ps.config import InitKind, OptimizerConfig, OptimizerKind, TableConfig
from ps.shard_store import ShardStore

N_REQ = 16 * 1024


def _best(fn, reps: int) -> float:
    """Best wall time of ``reps`` calls (seconds)."""
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _filled_store(kind: OptimizerKind, capacity: int, dim: int, fill: int, device: str) -> ShardStore:
    init = InitKind.ZEROS if kind == OptimizerKind.FTRL else InitKind.NORMAL  # ftrl rows start at w = 0
    cfg = TableConfig(name="t", dim=dim, capacity=capacity, optimizer=OptimizerConfig(kind=kind), init=init)
    s = ShardStore([cfg], shard_id=0, num_vshards=256, seed=0, device=device)
    chunk = 1 << 16
    for lo in range(0, fill, chunk):
        ids = np.arange(lo, min(lo + chunk, fill), dtype=np.int64)
        s.push("t", ids, np.zeros((ids.size, dim), np.float32))
    return s


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller tables (CI smoke)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the tables live")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cap = 200_000 if args.quick else 1_000_000
    reps = 3 if args.quick else 7
    dim = 64
    rng = np.random.default_rng(0)
    figures: dict = {"device": args.device, "capacity": cap, "rows_per_request": N_REQ, "dim": dim}

    # pull / push per optimizer on a table holding `fill` rows
    fill = min(cap, 200_000)
    for kind in OptimizerKind:
        s = _filled_store(kind, cap if kind == OptimizerKind.ROWWISE_ADAGRAD else fill, dim, fill, args.device)
        t = s.tables["t"]
        ids = rng.integers(0, fill, size=N_REQ).astype(np.int64)
        g = rng.normal(size=(N_REQ, dim)).astype(np.float32) * 1e-3
        push_s = _best(lambda: s.push("t", ids, g), reps)
        figures[f"push_rows_per_s_{kind.value}"] = round(N_REQ / push_s)
        if kind == OptimizerKind.ROWWISE_ADAGRAD:
            uniq = np.unique(ids)
            pull_s = _best(lambda: s.pull("t", uniq), reps)
            floor_s = _best(lambda: t.weights.index_select(0, t.id_map.lookup(uniq).to(t.device)).cpu().numpy(), reps)
            figures["pull_rows_per_s"] = round(uniq.size / pull_s)
            figures["pull_floor_rows_per_s"] = round(uniq.size / floor_s)
            figures["pull_vs_floor"] = round(floor_s / pull_s, 3)
            rows = torch.from_numpy(t.lookup_rows(uniq)).to(t.device)
            gu = torch.from_numpy(g[: uniq.size]).to(t.device)
            off = torch.arange(uniq.size + 1, device=t.device)
            bare_s = _best(lambda: t.tbe(rows, off).backward(gu), reps)
            figures["push_floor_rows_per_s"] = round(uniq.size / bare_s)
            figures["push_vs_floor_rowwise_adagrad"] = round(bare_s / push_s * N_REQ / uniq.size, 3)
        del s, t

    # memory per row at full capacity
    for mdim in (16, 64):
        s = _filled_store(OptimizerKind.ROWWISE_ADAGRAD, cap, mdim, cap, args.device)
        t = s.tables["t"]
        raw = cap * t.raw_bytes_per_row()
        used = s.memory_bytes()
        figures[f"bytes_per_row_dim{mdim}"] = round(used / cap, 1)
        figures[f"raw_bytes_per_row_dim{mdim}"] = t.raw_bytes_per_row()
        figures[f"memory_vs_raw_dim{mdim}"] = round(used / raw, 3)
        assert t.size == cap
        del s, t

    for k, v in figures.items():
        print(f"{k:34s} {v}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
