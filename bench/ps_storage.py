"""PS storage (in-process, no gRPC): pull/push rows/s per optimizer, bytes per row.

Run::

    python -m bench.ps_storage [--quick] [--device cpu|cuda] [--only new-ids]
    python -m bench.ps_storage --smoke   # 40K-row tables, 1 rep, 2 stream pushes: seconds, figures meaningless
    python -m bench.ps_storage --only fleet-step [--replay-rows 20000] [--replay-epochs 3] [--smoke]

Side by side in one run (this machine is noisy, so read the ratios):

* pull: ``ShardStore.pull`` of 16K known ids (dim 64) vs its floor, the fbgemm
  hash-map lookup plus ``index_select`` on the same table;
* push: ``ShardStore.push`` of 16K ids (with duplicates) per optimizer vs a bare
  TBE forward+backward (rowwise Adagrad) over the same rows;
* memory: ``ShardStore.memory_bytes()`` of a full 1M-row table vs the raw bytes of
  its rows + optimizer state, for dim 16 and 64;
* insert: ``ShardStore.push`` of 16K never-seen ids (dim 64, rowwise Adagrad,
  normal init) into an empty table (``insert_rows_per_s``), the same pushes
  once the ids are known (``insert_known_push_rows_per_s``: the gradient
  update every push pays), and the insertion stage alone
  (``insert_path_rows_per_s``: id-map lookup + ``EmbeddingTable.insert_new``:
  admission, allocation, initial rows, optimizer state, metadata, map insert),
  vs its floors on the same ids: the fbgemm hash-map insert alone and the
  deterministic initializer alone (``insert_vs_hashmap``, ``insert_vs_init``);
  ``*_cpu_rows_per_s`` are the same in thread CPU time (median), which the
  load of a shared box does not inflate;
* stream: steady state of a full table under a stream of new ids (admission
  ``min_count = 2``, LFU eviction): each 16K-id push carries 10% first
  sightings and the 10% seen in the previous push (admitted now, evicting
  rows), vs pushes of known ids only on the same table (``stream_push_rows_per_s``, ``stream_new_rows_per_s``,
  ``stream_vs_known``);
* fleet step (``--only fleet-step``, issue 36 item 4): one fleet step's store work
  replayed in process on a ``ShardStore`` built from the ``bench.train_throughput`` /
  ``bench.peers`` job (1 shard, 29 tables of dim 16, 200K rows each, rowwise
  Adagrad, the ``dnn`` model's dense parameters under Adam) on generated data, 256
  rows a batch, in the order a 1x1 fleet's PS runs it: ``push_many`` of batch t,
  ``pull_many`` of batch t+1 into reply buffers (the servicer's framed pull), then
  the dense push with its values returned (``DenseStore.push`` + ``pull``). CPU ms
  (thread time) per step for each, mean over the first epoch of a fresh process
  after its first step (``cold``: new ids) and over the later epochs (``warm``:
  every id known); the first step (``first``: the one-time work of first calls)
  and the store's construction (``store_build``) apart; ``--replay-rows`` sets the
  generated rows (20K = 79 batches);
* steady state beyond capacity (``steady_new10_*``, ``steady_new30_*``): the
  same kind of stream with 10% and 30% of each push's ids not in the table,
  measured only once eviction runs: rows/s, admitted rows/s, evictions per
  push, vs pushes of known ids on the same table at the same moment
  (``_vs_known``; ``_cpu_*`` the same in thread CPU time), and the invariants: ``_max_size_vs_capacity`` <= 1,
  ``_full_dropped`` 0, ``_memory_growth`` 0 (the store does not grow while new
  ids keep coming).

The last line printed is a JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import time

import numpy as np
import torch

from ps.config import (
    TABLE_OPTIMIZERS,
    AdmissionConfig,
    EvictionConfig,
    EvictionPolicy,
    InitKind,
    OptimizerConfig,
    OptimizerKind,
    TableConfig,
)
from ps.embedding_table import PushResult, TableRows
from ps.id_map import IdMap
from ps.initializer import RowInitializer, TablesInitializer
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


def _insert_figures(cap: int, dim: int, reps: int, figures: dict) -> None:
    """All-new pushes into an empty table vs the insertion stage, the hash-map insert and the
    initializer alone, on the same ids; wall time (best of ``reps``) and thread CPU time
    (median: the box is shared, CPU time is what the code costs)."""
    cfg = TableConfig(name="t", dim=dim, capacity=cap, optimizer=OptimizerConfig(kind=OptimizerKind.ROWWISE_ADAGRAD))
    base = np.random.default_rng(1).permutation(cap).astype(np.int64) * 7919 + 13
    g = np.zeros((N_REQ, dim), np.float32)
    batches = [base[lo : lo + N_REQ] for lo in range(0, min(cap, 8 * N_REQ), N_REQ)]
    sorted_batches = [torch.from_numpy(np.sort(b)) for b in batches]  # as torch.unique returns them
    n = sum(b.size for b in batches)
    wall: dict[str, list[float]] = {k: [] for k in ("push", "known", "path", "map")}
    cpu: dict[str, list[float]] = {k: [] for k in wall}

    def timed(key: str, fn) -> None:
        w0, c0 = time.perf_counter(), time.thread_time()
        fn()
        wall[key].append(time.perf_counter() - w0)
        cpu[key].append(time.thread_time() - c0)

    def fill() -> None:
        s = ShardStore([cfg], shard_id=0, num_vshards=256, seed=0)
        timed("push", lambda: [s.push("t", b, g[: b.size]) for b in batches])
        timed("known", lambda: [s.push("t", b, g[: b.size]) for b in batches])  # same ids, now known

    def insert_path() -> None:
        t = ShardStore([cfg], shard_id=0, num_vshards=256, seed=0).tables["t"]

        def run() -> None:
            for u in sorted_batches:  # what a push does for new ids, minus the gradient update
                with t.lock:
                    t.insert_new(u, t.id_map.lookup(u), PushResult())

        timed("path", run)

    def hashmap() -> None:
        m = IdMap(cap)

        def insert_all() -> None:
            for b in batches:
                m.insert(b, np.arange(b.size, dtype=np.int64), known_new=True)

        timed("map", insert_all)

    probe = ShardStore([cfg], shard_id=0, num_vshards=256, seed=0).tables["t"].init
    for _ in range(reps):  # interleaved
        fill()
        insert_path()
        hashmap()
    init_s = _best(lambda: [probe(b) for b in batches], reps)
    c0 = time.thread_time()
    for _ in range(reps):
        for b in batches:
            probe(b)
    init_cpu = (time.thread_time() - c0) / reps
    best = {k: min(v) for k, v in wall.items()}
    med_cpu = {k: float(np.median(v)) for k, v in cpu.items()}
    figures["insert_rows_per_s"] = round(n / best["push"])
    figures["insert_cpu_rows_per_s"] = round(n / med_cpu["push"])
    figures["insert_known_push_rows_per_s"] = round(n / best["known"])
    figures["insert_vs_known_push"] = round(best["known"] / best["push"], 3)
    figures["insert_path_rows_per_s"] = round(n / best["path"])
    figures["insert_path_cpu_rows_per_s"] = round(n / med_cpu["path"])
    figures["insert_hashmap_rows_per_s"] = round(n / best["map"])
    figures["insert_init_rows_per_s"] = round(n / init_s)
    figures["insert_init_cpu_rows_per_s"] = round(n / init_cpu)
    figures["insert_vs_hashmap"] = round(best["map"] / best["push"], 3)
    figures["insert_path_vs_hashmap"] = round(best["map"] / best["path"], 3)
    figures["insert_vs_init"] = round(init_s / best["push"], 3)
    figures["insert_path_profile_ms_per_16k"] = _insert_profile(cfg, sorted_batches)


def _insert_profile(cfg: TableConfig, batches: list[torch.Tensor]) -> dict[str, float]:
    """Where the insertion stage's thread CPU time goes (cProfile with a thread-time clock,
    one fill of a fresh table, after a warm-up fill built the initializer's tables):
    ms per 16K new ids for the initializer, the map insert, the map lookup, admission,
    and the rest of ``insert_new`` / ``_alloc`` (masks, free-list slice, weights copy,
    ``aminmax`` bound, optimizer-state fill, metadata)."""
    import cProfile
    import pstats

    def fill() -> None:
        t = ShardStore([cfg], shard_id=0, num_vshards=256, seed=0).tables["t"]
        for u in batches:
            with t.lock:
                t.insert_new(u, t.id_map.lookup(u), PushResult())

    fill()
    prof = cProfile.Profile(time.thread_time)
    prof.runcall(fill)
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    cum = {"init": 0.0, "map_insert": 0.0, "lookup": 0.0, "admission": 0.0, "total": 0.0}
    names = {("initializer.py", "__call__"): "init", ("id_map.py", "insert"): "map_insert",
             ("id_map.py", "lookup"): "lookup", ("admission.py", "observe"): "admission",
             ("embedding_table.py", "insert_new"): "total"}
    for (path, _line, func), (_cc, _nc, _tt, ct, _callers) in stats.items():
        key = names.get((path.rsplit("/", 1)[-1], func))
        if key:
            cum[key] += ct
    scale = 1e3 * N_REQ / sum(int(u.numel()) for u in batches)
    out = {k: round(v * scale, 3) for k, v in cum.items()}
    out["total"] = round(out["total"] + out["lookup"], 3)  # lookup is called by the loop, not insert_new
    out["other"] = round(out["total"] - out["init"] - out["map_insert"] - out["lookup"] - out["admission"], 3)
    return out


def _admitting_store(cap: int, dim: int) -> ShardStore:
    """One table ``t`` of ``cap`` rows with admission (``min_count = 2``) and LFU eviction."""
    cfg = TableConfig(
        name="t",
        dim=dim,
        capacity=cap,
        optimizer=OptimizerConfig(kind=OptimizerKind.ROWWISE_ADAGRAD),
        admission=AdmissionConfig(min_count=2),
        eviction=EvictionConfig(policy=EvictionPolicy.LFU, evict_fraction=0.05),
    )
    return ShardStore([cfg], shard_id=0, num_vshards=256, seed=0)


def _stream_figures(cap: int, dim: int, pushes: int, figures: dict) -> None:
    """Steady state of a full table: 20% never-seen ids per push (admission + eviction working)."""
    s = _admitting_store(cap, dim)
    t = s.tables["t"]
    rng = np.random.default_rng(2)
    known = np.arange(cap, dtype=np.int64)
    rows = _bulk_rows(known, dim)
    s.import_rows("t", rows)
    n_new = N_REQ // 5
    g = (rng.normal(size=(N_REQ, dim)) * 1e-3).astype(np.float32)
    next_new = cap
    prev_new = np.empty(0, np.int64)
    stream_t: list[float] = []
    known_t: list[float] = []
    admitted = 0
    for i in range(pushes + 2):
        fresh = np.arange(next_new, next_new + n_new // 2, dtype=np.int64)  # first sighting now, admitted next push
        next_new += fresh.size
        hot = t.row_ids[rng.integers(0, cap, N_REQ - fresh.size - prev_new.size)]
        hot = hot[hot >= 0]
        ids = np.concatenate([hot, prev_new, fresh])
        t0 = time.perf_counter()
        r = s.push("t", ids, g[: ids.size])
        dt = time.perf_counter() - t0
        known_ids = t.row_ids[rng.integers(0, cap, N_REQ)]
        known_ids = known_ids[known_ids >= 0]
        t1 = time.perf_counter()
        s.push("t", known_ids, g[: known_ids.size])
        dk = time.perf_counter() - t1
        if i >= 2:  # warm: the table is full and every push admits the previous push's new ids
            stream_t.append(dt / ids.size)
            known_t.append(dk / known_ids.size)
            admitted += r.admitted
        prev_new = fresh
    per_row = float(np.median(stream_t))
    figures["stream_push_rows_per_s"] = round(1.0 / per_row)
    figures["stream_new_rows_per_s"] = round(admitted / pushes / (per_row * N_REQ))
    figures["stream_new_fraction"] = round(admitted / pushes / N_REQ, 3)
    figures["stream_evictions"] = t.counters["evictions"]
    figures["stream_vs_known"] = round(float(np.median(known_t)) / per_row, 3)


def _steady_figures(cap: int, dim: int, pushes: int, frac: float, figures: dict) -> None:
    """Steady state beyond capacity: ``frac`` of each push's ids are not in the table.

    Half of them are first sightings (counted by admission, ``min_count = 2``, no
    row), half are the previous push's first sightings (admitted now: a new row,
    so LFU eviction frees rows). The table starts a few pushes short of full
    (bulk import), the stream runs until eviction has started, then ``pushes``
    pushes are measured, each followed by a push of known ids only (the
    baseline, same table, same moment). Checked on the way: the table never
    holds more than its capacity, nothing admitted is dropped for lack of room,
    and the store's memory does not grow while ids keep arriving.
    """
    s = _admitting_store(cap, dim)
    t = s.tables["t"]
    rng = np.random.default_rng(4)
    n_first = max(1, int(N_REQ * frac) // 2)
    start = max(0, cap - 3 * n_first)  # full after ~3 pushes: eviction starts right away
    s.import_rows("t", _bulk_rows(np.arange(start, dtype=np.int64), dim))
    g = (rng.normal(size=(N_REQ, dim)) * 1e-3).astype(np.float32)
    next_new = 1 << 40  # never-seen ids: far from the imported ones
    prev = np.empty(0, np.int64)
    rates: list[float] = []
    new_rates: list[float] = []
    known: list[float] = []
    rates_cpu: list[float] = []
    known_cpu: list[float] = []
    fractions: list[float] = []
    max_size = 0
    evict0 = mem0 = -1
    warm = 0
    for _ in range(pushes + 200):  # bounded: the table is full after ~3 pushes
        fresh = np.arange(next_new, next_new + n_first, dtype=np.int64)
        next_new += n_first
        hot = t.row_ids[rng.integers(0, cap, N_REQ - fresh.size - prev.size)]
        hot = hot[hot >= 0]
        ids = np.concatenate([hot, prev, fresh])
        t0, c0 = time.perf_counter(), time.thread_time()
        r = s.push("t", ids, g[: ids.size])
        dt, dc = time.perf_counter() - t0, time.thread_time() - c0
        max_size = max(max_size, t.size)
        kn = t.row_ids[rng.integers(0, cap, N_REQ)]
        kn = kn[kn >= 0]
        t1, c1 = time.perf_counter(), time.thread_time()
        s.push("t", kn, g[: kn.size])
        dk, dkc = time.perf_counter() - t1, time.thread_time() - c1
        prev = fresh
        if t.counters["evictions"] == 0:
            continue  # not full yet
        warm += 1
        if warm <= 2:
            continue
        if evict0 < 0:
            evict0, mem0 = t.counters["evictions"] - r.evicted, s.memory_bytes()
        rates.append(ids.size / dt)
        new_rates.append(r.admitted / dt)
        known.append(kn.size / dk)
        rates_cpu.append(ids.size / max(dc, 1e-9))
        known_cpu.append(kn.size / max(dkc, 1e-9))
        fractions.append((prev.size + fresh.size) / ids.size)
        if len(rates) == pushes:
            break
    key = f"steady_new{round(frac * 100)}"
    figures[f"{key}_rows_per_s"] = round(float(np.median(rates)))
    figures[f"{key}_admitted_rows_per_s"] = round(float(np.median(new_rates)))
    figures[f"{key}_new_fraction"] = round(float(np.mean(fractions)), 3)
    figures[f"{key}_evictions_per_push"] = round((t.counters["evictions"] - evict0) / len(rates))
    figures[f"{key}_known_rows_per_s"] = round(float(np.median(known)))
    figures[f"{key}_vs_known"] = round(float(np.median(rates)) / float(np.median(known)), 3)
    figures[f"{key}_cpu_rows_per_s"] = round(float(np.median(rates_cpu)))
    figures[f"{key}_cpu_vs_known"] = round(float(np.median(rates_cpu)) / float(np.median(known_cpu)), 3)
    figures[f"{key}_max_size_vs_capacity"] = round(max_size / cap, 4)
    figures[f"{key}_full_dropped"] = t.counters["full_dropped"]
    figures[f"{key}_memory_growth"] = round(s.memory_bytes() / mem0 - 1, 4)


def _fleet_step_figures(rows: int, epochs: int, figures: dict, capacity: int = 0) -> None:
    """One fleet step's store work (pull, push, dense) replayed in process: CPU ms per step.

    Args:
        rows: generated rows (256 a batch).
        epochs: passes over the batches (the first is ``cold``, the rest ``warm``).
        figures: filled with ``fleet_step_*`` figures.
        capacity: rows per table (0: the job's, 200K).
    """
    import dataclasses
    import tempfile
    from pathlib import Path

    from bench.train_throughput import make_data, write_job
    from meta_io.reader import MetaIODataset
    from metaps.job import load_job
    from workers.worker import build_model

    with tempfile.TemporaryDirectory(prefix="ps-storage-replay-") as tmp:
        root = Path(tmp)
        data = make_data(root, rows, "plain")
        job = load_job(write_job(root / "job.toml", data, root / "run", mode="plain", shards=1, workers=1,
                                 overlap=False, epochs=1))
        ds = MetaIODataset(data)
        steps = [{t: u.numpy().copy() for t, u in b.unique_ids.items()}
                 for f in range(ds.num_files) for b in ds.read_range(f, 0, ds.num_batches(f))]
        cfgs = job.table_configs()  # reads the schema from the data
        dense = {n: p.detach().numpy().copy() for n, p in build_model(job).named_parameters() if p.requires_grad}
    if capacity:
        cfgs = [dataclasses.replace(c, capacity=capacity) for c in cfgs]
    order = [c.name for c in cfgs]
    rng = np.random.default_rng(7)
    items = [[(t, st[t]) for t in order if t in st] for st in steps]
    grads = [[(rng.standard_normal((ids.size, c.dim)) * 1e-3).astype(np.float32) for (t, ids), c in
              zip(its, [cfgs[order.index(t)] for t, _ in its])] for its in items]
    dgrads = [{n: (rng.standard_normal(v.shape) * 1e-3).astype(np.float32) for n, v in dense.items()}
              for _ in range(4)]
    c0 = time.thread_time()
    s = ShardStore(cfgs, shard_id=0, num_vshards=job.ps.num_vshards, seed=job.ps.seed,
                   nonfinite_grads=job.ps.nonfinite_grads, dense_optimizer=job.ps.dense_optimizer)
    for n, v in dense.items():
        s.dense.register(n, v)
    build_ms = (time.thread_time() - c0) * 1e3
    cpu: dict[str, list[list[float]]] = {k: [[] for _ in range(epochs)] for k in ("pull", "push", "dense")}
    init_cpu, init_rows = [0.0] * epochs, [0] * epochs
    epoch = [0]
    originals = {cls: cls.__call__ for cls in (RowInitializer, TablesInitializer)}

    def counted(fn):  # the initializer's thread CPU time and rows, per epoch
        def call(self, *args):
            c = time.thread_time()
            out = fn(self, *args)
            init_cpu[epoch[0]] += time.thread_time() - c
            init_rows[epoch[0]] += out.shape[0]
            return out
        return call

    for cls, fn in originals.items():
        setattr(cls, "__call__", counted(fn))
    try:
        _replay(s, items, grads, dgrads, epoch, cpu)
    finally:
        for cls, fn in originals.items():
            setattr(cls, "__call__", fn)
    admitted = sum(t.counters["admissions"] for t in s.tables.values())
    figures["fleet_step_batches"] = len(items)
    figures["fleet_step_ids_per_batch"] = round(sum(ids.size for its in items for _, ids in its) / len(items), 1)
    figures["fleet_step_new_ids_per_batch"] = round(admitted / len(items), 1)  # each id new once, in epoch 1
    figures["fleet_step_cold_init_rows_per_batch"] = round(init_rows[0] / len(items), 1)
    figures["fleet_step_cold_init_cpu_ms"] = round(1e3 * init_cpu[0] / len(items), 3)
    figures["fleet_step_dense_params"] = int(sum(v.size for v in dense.values()))
    figures["fleet_step_store_build_cpu_ms"] = round(build_ms, 1)
    figures["fleet_step_first_cpu_ms"] = round(1e3 * sum(per[0][0] for per in cpu.values() if per[0]), 1)
    for k, per in cpu.items():  # cold: the first epoch after its first step (one-time work) and before the rest
        figures[f"fleet_step_cold_{k}_cpu_ms"] = round(1e3 * float(np.mean(per[0][1:])), 3)
        warm = [x for ep in per[1:] for x in ep]
        if warm:
            figures[f"fleet_step_warm_{k}_cpu_ms"] = round(1e3 * float(np.mean(warm)), 3)
    for phase in ("cold", "warm"):
        parts = [figures.get(f"fleet_step_{phase}_{k}_cpu_ms") for k in cpu]
        if all(p is not None for p in parts):
            figures[f"fleet_step_{phase}_total_cpu_ms"] = round(sum(parts), 3)  # type: ignore[arg-type]


def _replay(s: ShardStore, items: list[list[tuple[str, np.ndarray]]], grads: list[list[np.ndarray]],
            dgrads: list[dict[str, np.ndarray]], epoch: list[int], cpu: dict[str, list[list[float]]]) -> None:
    """The step loop of :func:`_fleet_step_figures`: push of batch t, pull of t+1, dense push + pull.

    Args:
        s: the store.
        items: per batch, (table, unique ids) in storage order.
        grads: per batch, the gradients of those rows.
        dgrads: dense gradients, used in turn.
        epoch: [the current epoch], set here (read by the initializer's counters).
        cpu: "pull" / "push" / "dense" -> per epoch, thread CPU seconds per step (appended).
    """
    prev: list[tuple[str, np.ndarray, np.ndarray]] | None = None
    for ep in range(len(cpu["pull"])):
        epoch[0] = ep
        for k, its in enumerate(items):
            outs = [np.empty((ids.size, s.tables[t].dim), np.float32) for t, ids in its]
            if prev is not None:
                c0 = time.thread_time()
                s.push_many(prev)
                cpu["push"][ep].append(time.thread_time() - c0)
            c0 = time.thread_time()
            s.pull_many(its, outs=outs)
            cpu["pull"][ep].append(time.thread_time() - c0)
            dg = dgrads[k % len(dgrads)]
            c0 = time.thread_time()
            s.dense.push(dg)
            s.dense.pull(list(dg))
            cpu["dense"][ep].append(time.thread_time() - c0)
            prev = [(t, ids, g) for (t, ids), g in zip(its, grads[k])]


def _bulk_rows(ids: np.ndarray, dim: int) -> TableRows:
    """Rows for a bulk fill: one random block (scale 0.01), tiled; zero momentum."""
    block = (np.random.default_rng(3).normal(size=(min(ids.size, 1 << 16), dim)) * 0.01).astype(np.float32)
    reps = -(-ids.size // block.shape[0])
    w = np.tile(block, (reps, 1))[: ids.size]
    return TableRows(ids=ids, weights=w, state={"momentum": np.zeros(ids.size, np.float32)})


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="smaller tables (CI smoke)")
    ap.add_argument("--device", default="cpu", choices=("cpu", "cuda"), help="where the tables live")
    ap.add_argument(
        "--only", default="all", choices=("all", "new-ids", "fleet-step"),
        help="new-ids: only the insert, stream and steady-state figures (issue 15 point 2); fleet-step: only "
             "the replay of a fleet step's pull, push and dense push (issue 36 item 4)",
    )
    ap.add_argument("--replay-rows", type=int, default=20_000,
                    help="fleet-step: generated rows (256 a batch)")
    ap.add_argument("--replay-epochs", type=int, default=3, help="fleet-step: passes (the first is cold)")
    ap.add_argument("--smoke", action="store_true",
                    help="smallest size that runs every code path and prints the JSON line (40K-row tables, 1 rep, "
                         "2 measured stream pushes; seconds, figures meaningless)")
    args = ap.parse_args()
    torch.set_num_threads(1)
    cap = 40_000 if args.smoke else 200_000 if args.quick else 1_000_000
    reps = 1 if args.smoke else 3 if args.quick else 7
    small = args.quick or args.smoke  # the stream and steady-state tables: a quarter of cap
    dim = 64
    rng = np.random.default_rng(0)
    figures: dict = {"device": args.device, "capacity": cap, "rows_per_request": N_REQ, "dim": dim}

    # pull / push per optimizer on a table holding `fill` rows
    fill = min(cap, 200_000)
    for kind in TABLE_OPTIMIZERS if args.only == "all" else ():  # adamw is dense-only
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
    for mdim in (16, 64) if args.only == "all" else ():
        s = _filled_store(OptimizerKind.ROWWISE_ADAGRAD, cap, mdim, cap, args.device)
        t = s.tables["t"]
        raw = cap * t.raw_bytes_per_row()
        used = s.memory_bytes()
        figures[f"bytes_per_row_dim{mdim}"] = round(used / cap, 1)
        figures[f"raw_bytes_per_row_dim{mdim}"] = t.raw_bytes_per_row()
        figures[f"memory_vs_raw_dim{mdim}"] = round(used / raw, 3)
        assert t.size == cap
        del s, t

    if args.only == "fleet-step":
        figures = {"device": args.device}
        _fleet_step_figures(2_000 if args.smoke else args.replay_rows, 2 if args.smoke else args.replay_epochs,
                            figures, capacity=20_000 if args.smoke else 0)
        for k, v in figures.items():
            print(f"{k:34s} {v}")
        print(json.dumps(figures))
        return

    _insert_figures(cap, dim, reps, figures)
    pushes = 2 if args.smoke else 8 if args.quick else 20
    _stream_figures(cap // 4 if small else cap, dim, pushes, figures)
    for frac in (0.1, 0.3):
        _steady_figures(cap // 4 if small else cap, dim, pushes, frac, figures)

    for k, v in figures.items():
        print(f"{k:34s} {v}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
