"""Meta-IO: read throughput vs a naive group-at-read-time reader, reader overhead, generator speed.

Run::

    python -m bench.meta_io [--quick]

Figures, each against a baseline measured in the same run:

* **read throughput** (tasks/s, rows/s): ``MetaIODataset.iter_all()`` (memory-
  mapped IPC -> MetaBatch tensors) vs a naive reader over the same normalized
  rows held in memory: per meta-batch it picks T task keys, filters the table
  for them (``pc.is_in``), sorts by (task, time) and cuts each task into
  support/query tensors (a Python loop over tasks, numpy per column). The naive
  reader's one-off table load is not counted (generous to it). Ratio:
  ``read_speedup_vs_naive`` (target >= 20).
* **reader overhead inside training** (``reader_overhead``, target <= 0.05): the
  consumer is a real G-Meta step (``models.meta.meta_step``, DNN, one inner
  step, rows from fixed random tables standing in for the PS) fed by
  ``prefetch(reader)`` vs the same steps over the same batches already
  materialized in memory; the arms alternate order per round and the figure is
  the median of the per-round time ratios, minus 1 (``reader_overhead_best``:
  fastest round of each side).
* **raw reader cost** (``reader_overhead_fixed_5ms``): the same comparison with a
  synthetic ~5 ms consumer (sums + 384x384 matmuls). It shows the reader's own
  Python cost (~0.1-0.3k tensor views per batch competing for the GIL), which a
  consumer this small cannot hide; the figure is sensitive to machine load.
* **generator**: rows/s and peak RSS of ``generate`` in a fresh subprocess
  (quick: 200k rows; full: 10M rows).
* **build**: rows/s of ``build`` and the fill ratio with and without buckets.

Threads are set on purpose: torch 1 thread (the consumer), Arrow I/O pool 1
thread; the prefetch thread gets the second core. The last line printed is a
JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import torch

S, Q = 8, 4
ROWS_PER_BATCH = 768  # 64 tasks of 12 slots


def _progress(msg: str) -> None:
    print(msg, flush=True)


# --------------------------------------------------------------------------- generator


def bench_generator(out: Path, rows: int, users: int, items: int) -> dict[str, Any]:
    """Generate in a fresh process so its peak RSS is the generator's own."""
    code = (
        "import json,sys; from meta_io.synth import GeneratorConfig, generate; "
        f"d = generate(sys.argv[1], GeneratorConfig(rows={rows}, users={users}, items={items}, seed=1), progress=False); "
        "print(json.dumps(dict(rows=d.rows, rows_per_s=d.rows_per_s, peak_rss_mb=d.peak_rss_mb, "
        "oracle_auc=d.oracle_auc)))"
    )
    res = subprocess.run([sys.executable, "-c", code, str(out)], capture_output=True, text=True, check=True)
    return json.loads(res.stdout.strip().splitlines()[-1])


# --------------------------------------------------------------------------- naive reader


def naive_meta_batches(table: pa.Table, schema: Any, keys: np.ndarray, T: int, n_batches: int):
    """Group at read time: filter T tasks, sort, split support/query per task."""
    id_cols = [c for c in schema.id_columns]
    dense_cols = [c.name for c in schema.dense_columns]
    vec_cols = [c.name for c in schema.vector_columns]
    key, ts = schema.task_key, schema.timestamp
    for b in range(n_batches):
        chosen = keys[b * T : (b + 1) * T]
        sub = table.filter(pc.is_in(table.column(key), value_set=pa.array(chosen)))
        sub = sub.sort_by([(key, "ascending"), (ts, "ascending")])
        uid = sub.column(key).to_numpy()
        starts = np.flatnonzero(np.r_[True, uid[1:] != uid[:-1]])
        ends = np.r_[starts[1:], uid.size]
        out = {half: {} for half in ("support", "query")}
        shapes = {"support": S, "query": Q}
        for half, width in shapes.items():
            for c in id_cols:
                w = c.max_len if c.max_len else 1
                out[half][c.name] = np.full((T, width, w), -1, np.int64)
            out[half]["dense"] = np.zeros((T, width, len(dense_cols)), np.float32)
            for v in vec_cols:
                out[half][v] = np.zeros((T, width, schema.column(v).dim), np.float32)
            for lab in schema.labels:
                out[half][lab] = np.zeros((T, width), np.float32)
            out[half]["mask"] = np.zeros((T, width), bool)
        rows = 0
        for t, (s0, e0) in enumerate(zip(starts.tolist(), ends.tolist())):  # the naive part: per task
            n = min(e0 - s0, S + Q)
            nq = min(max(int(np.floor(n * Q / (S + Q) + 0.5)), 1), n - 1) if n > 1 else 0
            ns = n - nq
            task = sub.slice(s0, n)
            for half, lo, cnt in (("support", 0, ns), ("query", ns, nq)):
                part = task.slice(lo, cnt)
                o = out[half]
                for c in id_cols:
                    col = part.column(c.name).combine_chunks()
                    vals = col.flatten().to_numpy() if c.max_len else col.to_numpy()
                    o[c.name][t, :cnt] = vals.reshape(cnt, -1)
                for j, d in enumerate(dense_cols):
                    o["dense"][t, :cnt, j] = part.column(d).to_numpy()
                for v in vec_cols:
                    o[v][t, :cnt] = part.column(v).combine_chunks().flatten().to_numpy().reshape(cnt, -1)
                for lab in schema.labels:
                    o[lab][t, :cnt] = part.column(lab).to_numpy()
                o["mask"][t, :cnt] = True
            rows += n
        yield {h: {k: torch.from_numpy(v) for k, v in d.items()} for h, d in out.items()}, len(starts), rows


# --------------------------------------------------------------------------- consumer


def consume(batch: Any, w: torch.Tensor, reps: int) -> float:
    """Fixed work per meta-batch: touch the batch, then ``reps`` matmuls."""
    x = batch.support.dense.reshape(-1, batch.support.dense.shape[-1]).float()
    acc = float(x.sum()) + float(batch.query.labels["click"].sum())
    h = w
    for _ in range(reps):
        h = torch.tanh(h @ w)
    return acc + float(h[0, 0])


def calibrate_reps(w: torch.Tensor, target_s: float) -> int:
    t0 = time.perf_counter()
    for _ in range(20):
        torch.tanh(w @ w)
    per = (time.perf_counter() - t0) / 20
    return max(1, int(target_s / per))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="small sizes, about a minute on 2 cores")
    ap.add_argument("--keep", default="", help="keep the generated data and dataset in this folder")
    args = ap.parse_args(argv)
    torch.set_num_threads(1)
    pa.set_io_thread_count(1)
    pa.set_cpu_count(1)
    logging.basicConfig(level=logging.WARNING)

    from meta_io.build import MetaIOBuildConfig, build
    from meta_io.prefetch import prefetch
    from meta_io.reader import MetaIODataset
    from meta_io.schema import load_schema
    from meta_io.source import iter_source

    rows, users, items = (200_000, 20_000, 5_000) if args.quick else (1_000_000, 100_000, 20_000)
    gen_rows = 200_000 if args.quick else 10_000_000
    naive_batches = 8 if args.quick else 20
    rounds = 3 if args.quick else 5
    work = Path(args.keep) if args.keep else Path(tempfile.mkdtemp(prefix="bench-metaio-"))
    out: dict[str, Any] = {"quick": args.quick, "rows": rows}
    try:
        # -- generator (subprocess, peak RSS) ------------------------------------------
        _progress(f"[1/5] generator: {gen_rows:,} rows in a subprocess")
        g = bench_generator(work / "gen", gen_rows, max(users, gen_rows // 50), max(items, gen_rows // 200))
        out.update(gen_rows=g["rows"], gen_rows_per_s=round(g["rows_per_s"]), gen_peak_rss_mb=round(g["peak_rss_mb"]))
        _progress(f"      {g['rows_per_s']:,.0f} rows/s, peak RSS {g['peak_rss_mb']:.0f} MiB")
        data = work / "gen"
        if gen_rows != rows:
            shutil.rmtree(data, ignore_errors=True)
            data = work / "data"
            _progress(f"      generating the {rows:,}-row bench input")
            bench_generator(data, rows, users, items)

        # -- build --------------------------------------------------------------------------
        _progress(f"[2/5] meta-io build: {rows:,} rows, S={S} Q={Q}")
        ds_dir = work / "metaio"
        res = build(data, data / "schema.json", ds_dir,
                    MetaIOBuildConfig(support=S, query=Q, rows_per_batch=ROWS_PER_BATCH, overwrite=True))
        t = res.manifest["totals"]
        out.update(build_rows_per_s=t["rows_per_s"], fill_ratio=t["fill_ratio"],
                   fill_ratio_without_buckets=t["fill_ratio_without_buckets"])
        _progress(f"      {t['rows_per_s']:,} rows/s; fill {t['fill_ratio']:.3f} "
                  f"(without buckets {t['fill_ratio_without_buckets']:.3f})")

        # -- Meta-IO read -------------------------------------------------------------------
        _progress("[3/6] Meta-IO read: every batch -> MetaBatch")
        ds = MetaIODataset(ds_dir)
        for _ in ds.read_range(0, 0, min(2, ds.num_batches(0))):  # warm the page cache and mmap
            pass
        best = None
        for _ in range(2):
            t0 = time.perf_counter()
            tasks = n_rows = 0
            for mb in ds.iter_all():
                tasks += mb.num_tasks
                n_rows += int(mb.support.mask.sum()) + int(mb.query.mask.sum())
            dt = time.perf_counter() - t0
            best = dt if best is None else min(best, dt)
        out.update(metaio_tasks_per_s=round(tasks / best), metaio_rows_per_s=round(n_rows / best))
        _progress(f"      {tasks / best:,.0f} tasks/s, {n_rows / best:,.0f} rows/s ({ds.total_batches} batches)")

        # -- naive read ---------------------------------------------------------------------
        _progress(f"[4/5] naive reader: {naive_batches} meta-batches of 64 tasks, grouped at read time")
        schema = load_schema(data / "schema.json")
        table = pa.concat_tables([b.table for b in iter_source(data, schema, 65_536)]).combine_chunks()
        uid = table.column(schema.task_key).to_numpy()
        keys, counts = np.unique(uid, return_counts=True)
        keys = np.random.default_rng(0).permutation(keys[counts >= 2])
        t0 = time.perf_counter()
        n_tasks = n_rows = 0
        for _, nt, nr in naive_meta_batches(table, schema, keys, 64, naive_batches):
            n_tasks += nt
            n_rows += nr
        dt = time.perf_counter() - t0
        out.update(naive_tasks_per_s=round(n_tasks / dt), naive_rows_per_s=round(n_rows / dt))
        out["read_speedup_vs_naive"] = round(out["metaio_tasks_per_s"] / out["naive_tasks_per_s"], 2)
        _progress(f"      {n_tasks / dt:,.0f} tasks/s, {n_rows / dt:,.0f} rows/s -> Meta-IO is "
                  f"{out['read_speedup_vs_naive']:.1f}x faster")
        del table

        # -- reader overhead ------------------------------------------------------------------
        _progress("[5/6] reader overhead: fixed ~5 ms consumer, prefetched reader vs in-memory batches")
        w = torch.randn(384, 384) / 20  # a few ~0.5 ms ops, like a dense tower's layers
        reps = calibrate_reps(w, 0.005)
        n_b = min(ds.total_batches, 120 if args.quick else 400)
        shards = []
        left = n_b
        for f in range(ds.num_files):
            k = min(left, ds.num_batches(f))
            if k:
                shards.append((f, k))
            left -= k

        def reader_feed():
            for f, k in shards:
                yield from ds.read_range(f, 0, k)

        memory = [type(mb)(support=mb.support.map(torch.clone), query=mb.query.map(torch.clone),
                           task_keys=mb.task_keys.clone(), task_mask=mb.task_mask.clone(),
                           unique_ids={k: v.clone() for k, v in mb.unique_ids.items()})
                  for mb in reader_feed()]
        t_reader, t_memory, t_serial = [], [], []
        for r in range(rounds):
            t0 = time.perf_counter()
            for mb in memory:
                consume(mb, w, reps)
            t_memory.append((time.perf_counter() - t0) / n_b)
            t0 = time.perf_counter()
            for mb in prefetch(reader_feed(), depth=4):
                consume(mb, w, reps)
            t_reader.append((time.perf_counter() - t0) / n_b)
            t0 = time.perf_counter()
            for mb in reader_feed():  # no prefetch: the reader in the consumer's thread
                consume(mb, w, reps)
            t_serial.append((time.perf_counter() - t0) / n_b)
            _progress(f"      round {r + 1}/{rounds}: in-memory {t_memory[-1] * 1e3:.2f} ms/batch, "
                      f"prefetched reader {t_reader[-1] * 1e3:.2f}, same-thread reader {t_serial[-1] * 1e3:.2f}")
        tm, tr, ts = statistics.median(t_memory), statistics.median(t_reader), statistics.median(t_serial)
        out.update(consumer_ms_per_batch=round(tm * 1e3, 3), reader_ms_per_batch=round(tr * 1e3, 3),
                   reader_overhead_fixed_5ms=round(tr / tm - 1, 4),
                   reader_overhead_fixed_5ms_without_prefetch=round(ts / tm - 1, 4),
                   # least-loaded round of each side: the machine is shared, so also report the best case
                   reader_overhead_fixed_5ms_best=round(min(t_reader) / min(t_memory) - 1, 4))
        _progress(f"      overhead {out['reader_overhead_fixed_5ms'] * 100:+.1f}% ({n_b} batches, median of {rounds})")

        # -- reader overhead inside training: the consumer is a real G-Meta step -----------------
        _progress("[6/6] reader overhead inside training: meta_step (DNN, 1 inner step) per batch")
        from models.factory import build_model
        from models.config import ModelConfig
        from models.meta import MetaConfig, meta_step

        torch.manual_seed(0)
        model = build_model(ds.schema, ModelConfig(hidden=[128, 64]))
        dims = model.dims
        meta_cfg = MetaConfig()
        n_t = min(n_b, 12 if args.quick else 40)
        tables = {}  # fixed random rows per table (the PS's role): same work in both arms

        def train_consume(mb: Any) -> None:
            rows = {t: tables.setdefault((t, len(u)), torch.randn(len(u), dims[t]) * 0.01) for t, u in mb.unique_ids.items()}
            meta_step(model, mb, rows, meta_cfg)

        mem_t = memory[:n_t]
        for mb in mem_t[:2]:
            train_consume(mb)  # warm up
        tt_reader, tt_memory = [], []
        train_rounds = 5 if args.quick else 7
        for r in range(train_rounds):
            # alternate which arm goes first, so drift in machine load hits both alike
            arms = ("memory", "reader") if r % 2 == 0 else ("reader", "memory")
            for arm in arms:
                t0 = time.perf_counter()
                if arm == "memory":
                    for mb in mem_t:
                        train_consume(mb)
                    tt_memory.append((time.perf_counter() - t0) / n_t)
                else:
                    for i, mb in enumerate(prefetch(reader_feed(), depth=4)):
                        if i >= n_t:
                            break
                        train_consume(mb)
                    tt_reader.append((time.perf_counter() - t0) / n_t)
            _progress(f"      round {r + 1}: in-memory {tt_memory[-1] * 1e3:.1f} ms/step, "
                      f"prefetched reader {tt_reader[-1] * 1e3:.1f} ms/step")
        tm2 = statistics.median(tt_memory)
        paired = statistics.median(b / a for a, b in zip(tt_memory, tt_reader))  # per-round ratio, median
        out.update(train_step_ms=round(tm2 * 1e3, 2), reader_overhead=round(paired - 1, 4),
                   reader_overhead_best=round(min(tt_reader) / min(tt_memory) - 1, 4))
        _progress(f"      overhead inside training {out['reader_overhead'] * 100:+.1f}% "
                  f"(median of {train_rounds} paired rounds of {n_t} steps)")
    finally:
        if not args.keep:
            shutil.rmtree(work, ignore_errors=True)
    print(json.dumps(out), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
