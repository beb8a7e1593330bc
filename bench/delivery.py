"""Delivery benchmark: full export, incremental export vs changed fraction, serving lookups.

Run::

    python -m bench.delivery            # 1M-row item table
    python -m bench.delivery --quick    # 200K rows, about a minute
    python -m bench.delivery --smoke    # 4K rows, 1-16 tasks: seconds, every path once, figures meaningless

What it measures, each against a baseline in the same run:

* ``export_rows_per_s``: checkpoint (real PS ShardStore, 2 shards) -> full bundle
  (sha256 verify, read + sort, fingerprint, LMDB putmulti, TorchScript trace).
  Its LMDB write alone (``write_bulk_rows_per_s``, putmulti + fingerprints + index)
  is compared with the same rows written one ``txn.put`` per row.
* ``delta_cost_vs_fraction``: (incremental export time / full export time) /
  changed fraction, for 1%, 10%, 50% of rows changed (1.0 = perfectly
  proportional; above 1 = fixed costs). The checkpoints after the (full) base
  are PS delta checkpoints (``full_every=8``), so an incremental export reads
  only their changed rows; ``delta_cost_vs_fraction_full_ckpts`` is the same
  measured on full checkpoints of the same moments (every row read, verified,
  decoded and fingerprinted: the old path, kept as the baseline). Both time the
  export alone in a process that has reused nothing (publish excluded).
* ``delta_cost_vs_fraction_job``: the same ratio for what the periodic delivery
  job does (``delivery.job.PeriodicDelivery``, one long-lived process): its
  :class:`~delivery.reuse.ExportCache` has seen the parent (the full bundle
  was exported through it just before), and the time is export **plus publish**
  (the fsyncs), for the full export in the denominator as well. The gate is not
  timed (it is the same in both paths).
* ``lookup_rows_per_s``: ``ServingModel.lookup`` on batches of 4096 random ids.
  Baseline: one ``txn.get`` + ``np.frombuffer`` per id.
* ``adapt.ms_per_task``: per-task adaptation latency of a bundle
  (``adapt(support).predict(rows)``, 8 support + 16 scored rows per task, vmapped
  over 1/16/256 tasks). Baseline ``adapt.loop_ms_per_task``: one task at a time.

The last line printed is a JSON object of the figures.
"""

from __future__ import annotations

import argparse
import json
import logging
import shutil
import sys
import tempfile
import time
from pathlib import Path

import lmdb
import numpy as np
import torch

from delivery.bundle import EMBEDDINGS, EmbeddingWriter, encode_keys
from delivery.config import DeliveryConfig, RowDtype
from delivery.export import CheckpointSource, export_bundle, parent_state
from delivery.loader import bundle_chain, load_bundle
from delivery.publish import Publisher
from delivery.reuse import ExportCache
from meta_io.schema import ColumnKind, ColumnSpec, Schema
from common.config import to_dict
from common.hashing import vshard_of
from models.config import ModelConfig
from models.factory import build_model

DIM = 16
LOOKUP_BATCH = 4096


def _say(msg: str) -> None:
    print(msg, flush=True)


def _schema() -> Schema:
    return Schema(
        columns=[
            ColumnSpec("user_id", ColumnKind.SPARSE, table="user"),
            ColumnSpec("item_id", ColumnKind.SPARSE, table="item"),
            ColumnSpec("price", ColumnKind.DENSE),
            ColumnSpec("click", ColumnKind.LABEL),
        ],
        task_key="user_id",
        labels=["click"],
    )


class _Fleet:
    """Two real ShardStores; ids routed by vshard."""

    def __init__(self, rows: int, schema: Schema, cfg: ModelConfig) -> None:
        from ps.config import TableConfig
        from ps.shard_store import ShardStore

        cap = rows // 2 + rows // 8
        tables = [TableConfig(name="item", dim=DIM, capacity=cap), TableConfig(name="user", dim=DIM, capacity=4096)]
        self.stores = [ShardStore(tables, shard_id=i, num_vshards=64, seed=0) for i in range(2)]
        model = build_model(schema, cfg)
        for n, p in model.named_parameters():
            self.stores[0].dense.register(n, p.detach().numpy().copy())
        self.schema, self.cfg = schema, cfg

    def push(self, table: str, ids: np.ndarray, seed: int, chunk: int = 1 << 17) -> None:
        rng = np.random.default_rng(seed)
        sh = vshard_of(ids, 64) % 2
        for i, store in enumerate(self.stores):
            mine = ids[sh == i]
            for lo in range(0, mine.size, chunk):
                part = mine[lo : lo + chunk]
                store.push(table, part, rng.normal(size=(part.size, DIM)).astype(np.float32))

    def checkpoint(self, root: Path, step: int, full_every: int = 1) -> Path:
        """A committed checkpoint: full, or a delta over the last one (``full_every`` > 1)."""
        from ps.checkpoint import begin_checkpoint, commit_checkpoint, save_shard

        tmp, _plan = begin_checkpoint(root, step, full_every)
        for i, s in enumerate(self.stores):
            save_shard(s, tmp, i)
        info = {"schema": self.schema.to_dict(), "model": to_dict(self.cfg), "step": step}
        return commit_checkpoint(tmp, info)


def _timed_export(ckpt: Path, root: Path, cfg: DeliveryConfig, incremental: bool,
                  cache: ExportCache | None = None) -> float:
    """Seconds for one export (opening + verifying the checkpoint included).

    Without ``cache``: publish excluded (the old measure). With ``cache`` (the
    periodic job's reuse path): publish, i.e. every fsync, included.
    """
    pub = Publisher(root)
    t0 = time.perf_counter()
    src = CheckpointSource.open(ckpt, cache=cache)
    parent = None
    if incremental:
        latest = pub.latest()
        assert latest is not None
        parent = parent_state(bundle_chain(root / latest), cache)
    version = pub.next_version()
    staging = pub.staging_dir(version)
    export_bundle(src, staging, version, cfg, parent, cache)
    dt = time.perf_counter() - t0
    pub.publish(staging, version)
    return time.perf_counter() - t0 if cache is not None else dt


def adaptation_latency(bundle: Path, item_ids: np.ndarray, support: int = 8, query: int = 16,
                       tasks: tuple[int, ...] = (1, 16, 256), reps: int = 3) -> dict[str, object]:
    """Per-task adaptation latency of ``load_bundle(b).adapt(support).predict(rows)`` (eval16).

    For ``T`` tasks of ``support`` labeled rows and ``query`` rows each: wall time of
    adapting every task (the bundle's recipe, vmapped over tasks) and scoring its
    rows, divided by ``T``. Baseline: the same tasks one at a time
    (``tasks_per_batch=1``: a Python loop over tasks). Min of ``reps`` runs each.

    Args:
        bundle: a published bundle directory.
        item_ids: ids to draw items from.
        support: support rows per task.
        query: rows scored per task.
        tasks: task counts to measure.
        reps: timed runs per figure (the minimum is reported).
    """
    from meta_io.batch import FeatureBatch

    served = load_bundle(bundle, verify=False)
    rng = np.random.default_rng(7)
    out: dict[str, object] = {"support": support, "query": query}
    per_task: dict[str, float] = {}
    loop: dict[str, float] = {}

    def rows(n: int, keys: np.ndarray) -> FeatureBatch:
        return FeatureBatch(
            ids={"user_id": torch.from_numpy(keys).reshape(-1, 1),
                 "item_id": torch.from_numpy(rng.choice(item_ids, n)).reshape(-1, 1)},
            dense=torch.from_numpy(rng.normal(size=(n, 1)).astype(np.float32)), vectors={},
            labels={"click": torch.from_numpy((rng.random(n) < 0.3).astype(np.float32))},
            mask=torch.ones(n, dtype=torch.bool), scenario=torch.zeros(n, dtype=torch.int64))

    try:
        for t in tasks:
            keys = np.arange(t, dtype=np.int64)
            s_keys, q_keys = np.repeat(keys, support), np.repeat(keys, query)
            sup, qry = rows(t * support, s_keys), rows(t * query, q_keys)
            served.adapt(sup, s_keys).predict(qry, q_keys)  # warm-up (model build, first vmap)
            best = min(_timed(lambda: served.adapt(sup, s_keys, tasks_per_batch=256).predict(qry, q_keys))
                       for _ in range(reps))
            per_task[str(t)] = round(1000 * best / t, 3)
            if t <= 16:
                base = min(_timed(lambda: served.adapt(sup, s_keys, tasks_per_batch=1).predict(qry, q_keys))
                           for _ in range(reps))
                loop[str(t)] = round(1000 * base / t, 3)
            _say(f"  adapt {t} tasks: {per_task[str(t)]:.2f} ms/task" +
                 (f" vs one task at a time {loop[str(t)]:.2f} ms/task" if str(t) in loop else ""))
    finally:
        served.close()
    out["ms_per_task"] = per_task
    out["loop_ms_per_task"] = loop
    return out


def _timed(fn: object) -> float:
    t0 = time.perf_counter()
    fn()  # type: ignore[operator]
    return time.perf_counter() - t0


def _baseline_put(rows: np.ndarray, ids: np.ndarray, path: Path) -> float:
    """rows/s writing one txn.put per row (what a naive exporter does)."""
    env = lmdb.open(str(path), subdir=False, map_size=1 << 32, lock=False, sync=False)
    keys = encode_keys("item", ids)
    t0 = time.perf_counter()
    with env.begin(write=True) as txn:
        for k, r in zip(keys, rows):
            txn.put(k, r.tobytes())
    dt = time.perf_counter() - t0
    env.close()
    return ids.size / dt


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m bench.delivery")
    ap.add_argument("--quick", action="store_true", help="200K rows instead of 1M (about a minute)")
    ap.add_argument("--rows", type=int, default=0, help="item table rows (overrides the default)")
    ap.add_argument("--smoke", action="store_true",
                    help="smallest size that runs every code path and prints the JSON line (4K rows, one timed "
                         "run per figure, 1 and 16 adapted tasks; seconds, figures meaningless)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    torch.set_num_threads(1)
    rows = args.rows or (4_000 if args.smoke else 200_000 if args.quick else 1_000_000)
    reps = 1 if args.smoke else 2  # min of `reps` timed exports (the machine is shared and noisy)
    work = Path(tempfile.mkdtemp(prefix="bench-delivery-"))
    try:
        schema = _schema()
        mcfg = ModelConfig(kind="dnn", hidden=[32, 16], default_dim=DIM)
        _say(f"building a 2-shard PS with {rows:,} item rows ...")
        fleet = _Fleet(rows, schema, mcfg)
        ids = np.random.default_rng(0).choice(1 << 40, rows, replace=False).astype(np.int64)
        fleet.push("item", ids, seed=1)
        fleet.push("user", np.arange(1000, dtype=np.int64), seed=2)
        base_ckpt = fleet.checkpoint(work / "ckpts", 1, full_every=8)
        cfg = DeliveryConfig(out=work / "out", dtype=RowDtype.FP32)

        _say("full export ...")
        full_s = min(_timed_export(base_ckpt, work / f"full{i}", cfg, False) for i in range(reps + 1))
        export_rps = (rows + 1000) / full_s
        _say(f"  full export {full_s:.2f}s = {export_rps:,.0f} rows/s")
        n_base = min(rows, 100_000)
        base_rows = np.random.default_rng(3).normal(size=(n_base, DIM)).astype(np.float32)
        baseline_rps = _baseline_put(base_rows, np.sort(ids[:n_base]), work / "baseline.lmdb")
        w = EmbeddingWriter(work / "bulk.lmdb", RowDtype.FP32, map_size_gb=4)
        t0 = time.perf_counter()
        w.write_table("item", np.sort(ids[:n_base]), base_rows)
        w.close()
        bulk_rps = n_base / (time.perf_counter() - t0)
        _say(f"  LMDB write alone: bulk writer {bulk_rps:,.0f} rows/s vs txn.put per row {baseline_rps:,.0f} rows/s")

        # Incremental: disjoint id sets so the k-th checkpoint differs from the base by exactly `frac`.
        perm = np.random.default_rng(4).permutation(ids)
        fractions = [0.01, 0.10, 0.50]
        delta: dict[str, dict[str, float]] = {}
        delta_full: dict[str, float] = {}
        delta_job: dict[str, dict[str, float]] = {}
        job_full_s: list[float] = []
        done = 0
        for step, frac in enumerate(fractions, start=2):
            upto = int(frac * rows)
            fleet.push("item", perm[done:upto], seed=10 + step)
            done = upto
            ckpt = fleet.checkpoint(work / "ckpts", step, full_every=8)  # delta over the previous one
            full_ckpt = fleet.checkpoint(work / "ckpts-full", step)  # same moment, full
            job_times = []
            for rep in range(reps):  # the job: its previous delivery (the full base) went through the same cache
                root = work / f"inc{step}-job-{rep}"
                cache = ExportCache()
                job_full_s.append(_timed_export(base_ckpt, root, DeliveryConfig(out=root), False, cache))
                job_times.append(_timed_export(ckpt, root, DeliveryConfig(out=root, incremental=True), True, cache))
                assert cache.hits.get("dense") and cache.hits.get("live"), (cache.hits, cache.misses)
            delta_job[f"{frac:g}"] = {"seconds": min(job_times)}
            for kind, ck in (("delta", ckpt), ("full", full_ckpt)):
                times = []
                for rep in range(reps):
                    root = work / f"inc{step}-{kind}-{rep}"
                    shutil.copytree(work / "full0", root)
                    times.append(_timed_export(ck, root, DeliveryConfig(out=root, incremental=True), True))
                t = min(times)
                m = json.loads((work / f"inc{step}-{kind}-0" / "v000002" / "manifest.json").read_text())
                written = m["tables"]["item"]["written"]
                if kind == "full":
                    delta_full[f"{frac:g}"] = round((t / full_s) / frac, 2)
                    _say(f"  delta {frac:.0%} from full checkpoints: {t:.2f}s, (delta/full)/fraction "
                         f"{(t / full_s) / frac:.2f}")
                    continue
                assert m["source"]["read"] == "changes", m["source"]
                delta[f"{frac:g}"] = {"seconds": round(t, 3), "delta_over_full": round(t / full_s, 3),
                                      "cost_vs_fraction": round((t / full_s) / frac, 2), "rows_written": written}
                _say(f"  delta {frac:.0%}: {t:.2f}s, delta/full {t / full_s:.3f}, "
                     f"(delta/full)/fraction {(t / full_s) / frac:.2f}, rows written {written:,}")

        job_full = min(job_full_s)
        for frac_s, d in delta_job.items():
            t = d["seconds"]
            d.update(full_seconds=round(job_full, 3), cost_vs_fraction=round((t / job_full) / float(frac_s), 2))
            d["seconds"] = round(t, 3)
            _say(f"  job path (reuse + publish) delta {float(frac_s):.0%}: {t:.3f}s vs full {job_full:.3f}s, "
                 f"(delta/full)/fraction {d['cost_vs_fraction']:.2f}")

        _say("serving lookups ...")
        served = load_bundle(work / "full0", verify=False)
        rng = np.random.default_rng(5)
        batches = [rng.choice(ids, LOOKUP_BATCH) for _ in range(10 if args.smoke else 40)]
        served.lookup("item", batches[0])
        t0 = time.perf_counter()
        for b in batches:
            served.lookup("item", b)
        lookup_rps = len(batches) * LOOKUP_BATCH / (time.perf_counter() - t0)
        served.close()
        env = lmdb.open(str(work / "full0" / "v000001" / EMBEDDINGS), subdir=False, readonly=True, lock=False)
        t0 = time.perf_counter()
        with env.begin() as txn:
            for b in batches[:10]:
                out = np.zeros((b.size, DIM), np.float32)
                for i, k in enumerate(encode_keys("item", b)):
                    v = txn.get(k)
                    if v is not None:
                        out[i] = np.frombuffer(v, np.float32)
        lookup_base = 10 * LOOKUP_BATCH / (time.perf_counter() - t0)
        env.close()
        _say(f"  lookup {lookup_rps:,.0f} rows/s vs per-id get loop {lookup_base:,.0f} rows/s")
        _say("per-task adaptation ...")
        adapt_fig = adaptation_latency(work / "full0" / "v000001", ids, tasks=(1, 16) if args.smoke else (1, 16, 256),
                                       reps=1 if args.smoke else 3)

        figures = {
            "bench": "delivery",
            "rows": rows,
            "dim": DIM,
            "export_rows_per_s": round(export_rps),
            "export_full_s": round(full_s, 3),
            "write_bulk_rows_per_s": round(bulk_rps),
            "write_baseline_put_rows_per_s": round(baseline_rps),
            "write_speedup": round(bulk_rps / baseline_rps, 2),
            "delta_cost_vs_fraction": {k: v["cost_vs_fraction"] for k, v in delta.items()},
            "delta_cost_vs_fraction_full_ckpts": delta_full,
            "delta_cost_vs_fraction_job": {k: v["cost_vs_fraction"] for k, v in delta_job.items()},
            "delta": delta,
            "delta_job": delta_job,
            "lookup_rows_per_s": round(lookup_rps),
            "lookup_baseline_rows_per_s": round(lookup_base),
            "lookup_speedup": round(lookup_rps / lookup_base, 2),
            "lookup_batch": LOOKUP_BATCH,
            "adapt": adapt_fig,
        }
        print(json.dumps(figures), flush=True)
        return 0
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    sys.exit(main())
