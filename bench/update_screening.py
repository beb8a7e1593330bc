"""Cost of the PS update screening (in-process, no gRPC), side by side in one run.

Run::

    python -m bench.update_screening [--reps 25]
    python -m bench.update_screening --smoke   # 20K-row tables, 2 reps: seconds, figures meaningless

Per optimizer, on a 200K-row dim-64 table and 16K-id pushes (like
``bench.ps_storage --quick``), best of ``reps``:

* ``push_ms``: a whole ``EmbeddingTable.push`` (fast path: nothing near overflow);
* ``added_ms``: the work screening adds on that path, run alone: one
  ``amax(|g|)`` for the fused TBE kinds, one finite check of three [k, dim]
  tensors for Adam/FTRL; ``added_frac = added_ms / push_ms``;
* fused kinds only, ``exact_ms``: the same push forced onto the exact path
  (snapshot, apply, check, restore), as a push that could overflow takes it;
  ``exact_vs_push``.

The last line printed is a JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import time
from typing import Callable

import numpy as np
import torch

from ps.config import TABLE_OPTIMIZERS, InitKind, OptimizerConfig, OptimizerKind, TableConfig
from ps.embedding_table import EmbeddingTable
from ps.optimizers import SAFE_MAGNITUDE, TBE_KINDS, FusedTbeOptimizer, finite_rows

N_REQ = 16 * 1024
DIM = 64
CAPACITY = 200_000


def _best(fn: Callable[[], object], reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--reps", type=int, default=None,
                    help="best of this many pushes per figure (default 25; --smoke 2)")
    ap.add_argument("--smoke", action="store_true",
                    help="smallest size that runs every code path and prints the JSON line (seconds; figures "
                         "meaningless): 20K-row tables, 2 reps")
    args = ap.parse_args()
    if args.reps is None:
        args.reps = 2 if args.smoke else 25
    capacity = 20_000 if args.smoke else CAPACITY
    torch.set_num_threads(1)
    rng = np.random.default_rng(0)
    figures: dict = {"rows_per_request": N_REQ, "dim": DIM, "capacity": capacity}
    for kind in TABLE_OPTIMIZERS:  # a table optimizer each (adamw is dense-only)
        init = InitKind.ZEROS if kind == OptimizerKind.FTRL else InitKind.NORMAL
        t = EmbeddingTable(TableConfig(name="t", dim=DIM, capacity=capacity, optimizer=OptimizerConfig(kind=kind),
                                       init=init))
        for lo in range(0, capacity, 1 << 16):
            ids = np.arange(lo, min(lo + (1 << 16), capacity), dtype=np.int64)
            t.push(ids, np.zeros((ids.size, DIM), np.float32))
        ids = rng.integers(0, capacity, size=N_REQ).astype(np.int64)
        g = (rng.normal(size=(N_REQ, DIM)) * 1e-3).astype(np.float32)
        k = int(np.unique(ids).size)
        push_s = _best(lambda: t.push(ids, g), args.reps)
        if kind in TBE_KINDS:
            gu = torch.from_numpy(g[:k])
            added_s = _best(lambda: float(gu.abs().amax()), args.reps)
        else:
            a, b, c = (torch.from_numpy(g[:k]).clone() for _ in range(3))
            added_s = _best(lambda: finite_rows(a, b, c), args.reps)
        p = kind.value
        figures[f"{p}_push_ms"] = round(push_s * 1e3, 3)
        figures[f"{p}_added_ms"] = round(added_s * 1e3, 3)
        figures[f"{p}_added_frac"] = round(added_s / push_s, 4)
        opt = t.optimizer
        if isinstance(opt, FusedTbeOptimizer):
            def exact() -> None:
                saved = opt.bound_w
                opt.bound_w, opt._since_refresh = SAFE_MAGNITUDE, 0  # as after a near-overflow push
                t.push(ids, g)
                opt.bound_w = saved

            before = opt.exact_pushes
            exact_s = _best(exact, args.reps)
            assert opt.exact_pushes - before == args.reps
            figures[f"{p}_exact_ms"] = round(exact_s * 1e3, 3)
            figures[f"{p}_exact_vs_push"] = round(exact_s / push_s, 3)
        del t
    for key, v in figures.items():
        print(f"{key:34s} {v}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
