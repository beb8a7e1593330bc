"""PS storage at scale: one shard's table (dim 64, rowwise Adagrad) at 1M rows and at 50M.

Run::

    python -m bench.ps_scale [--quick] [--rows N] [--ckpt-dir DIR]
    python -m bench.ps_scale --gather-order [--quick] [--rows N]   (only the gather-order comparison)
    python -m bench.ps_scale --page-sizes [--quick] [--rows N]     (only the page-size comparison)
    python -m bench.ps_scale --smoke   (64K and 256K rows, 3 reps: seconds, every path once, figures meaningless)

Side by side in one run (the machine is shared and noisy: read the ratios):

* pull / push of 16K random known ids (best of ``reps``, the two sizes
  interleaved rep by rep, both stores alive) on a full table of ``BASE`` = 1M
  rows and on a full table of ``--rows`` (50M; ``--quick``: 4M),
  ratios ``pull_50m_vs_1m`` / ``push_50m_vs_1m`` (the keys keep their names
  in quick mode; ``big_rows`` says what was measured);
* insert: pushes of 16K never-seen ids into the big table when it is nearly
  full (big hash map, new rows at the end), ``insert_rows_per_s``;
* memory: ``ShardStore.memory_bytes()`` and the process's anonymous RSS per row
  vs the raw bytes of a row (weights + optimizer state), ``bytes_per_row_ratio``;
* checkpoint of the big table (``save_shard``, streaming) and its recovery after
  the original is freed (``restore_shard_checkpoint`` on a just-started shard,
  sha256 verified, filled in place; see :func:`recover`): rows/s, GB/s of
  the shard file, and the peak *extra* anonymous memory while each runs
  (RssAnon sampled from /proc/self/status every 10 ms, minus its value before);
* a recovery (``restore_shard_checkpoint`` on a shard that just started: its pristine
  store is filled in place) at the 1M size: its peak extra memory vs the store's
  size, ``recovery_restore_extra_vs_store``;
* the restore of the PS service (``empty_like`` + load while the old store is
  alive, then swap) at the 1M size: its peak extra memory vs the store's size.

Bulk fills use ``import_rows`` (1M-row chunks of tiled random rows), not the
push path, so a 50M-row table fills in about a minute. The last line printed is
a JSON object of the figures.
"""

from __future__ import annotations

import argparse
import gc
import json
import mmap
import shutil
import tempfile
import threading
import time
from pathlib import Path

import numpy as np
import torch

from ps import checkpoint as ckpt
from ps import hugepages, intra_op
from ps.config import OptimizerConfig, OptimizerKind, TableConfig
from ps.embedding_table import TableRows
from ps.shard_store import ShardStore

N_REQ = 16 * 1024
DIM = 64
BASE = 1_000_000
V = 256
FILL_CHUNK = 1 << 20
ID_MULT = 0x9E3779B1  # spreads ids over int64 (odd: distinct rows -> distinct ids)


def rss_anon() -> int:
    """Anonymous resident bytes of this process (heap, tensors; not file pages)."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("RssAnon:"):
                return int(line.split()[1]) * 1024
    return 0


class PeakRss:
    """Samples RssAnon every ``every`` s in a thread; ``extra`` = peak - value at start."""

    def __init__(self, every: float = 0.01) -> None:
        self.every = every
        self.start = rss_anon()
        self.peak = self.start
        self._stop = threading.Event()
        self._t = threading.Thread(target=self._run, daemon=True)

    def _run(self) -> None:
        while not self._stop.is_set():
            self.peak = max(self.peak, rss_anon())
            self._stop.wait(self.every)

    def __enter__(self) -> "PeakRss":
        self._t.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._t.join()
        self.peak = max(self.peak, rss_anon())

    @property
    def extra(self) -> int:
        return self.peak - self.start


def _best(fn, reps: int) -> float:
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t0)
    return best


def _cfg(rows: int) -> TableConfig:
    return TableConfig(name="t", dim=DIM, capacity=rows, optimizer=OptimizerConfig(kind=OptimizerKind.ROWWISE_ADAGRAD))


def _ids(lo: int, hi: int) -> np.ndarray:
    with np.errstate(over="ignore"):
        return np.arange(lo, hi, dtype=np.int64) * np.int64(ID_MULT) + 1


def _fill(store: ShardStore, rows: int) -> float:
    """Import ``rows`` rows in chunks; returns rows/s."""
    small = (np.random.default_rng(3).normal(size=(1 << 14, DIM)) * 0.01).astype(np.float32)
    chunk = min(FILL_CHUNK, -(-rows // small.shape[0]) * small.shape[0])  # no bigger than the table needs
    block = np.tile(small, (max(1, chunk // small.shape[0]), 1))
    mom = np.full(FILL_CHUNK, 1e-3, np.float32)
    t0 = time.perf_counter()
    for lo in range(0, rows, FILL_CHUNK):
        hi = min(rows, lo + FILL_CHUNK)
        n = hi - lo
        store.import_rows("t", TableRows(ids=_ids(lo, hi), weights=block[:n], state={"momentum": mom[:n]}))
    return rows / (time.perf_counter() - t0)


def _pull_push(stores: dict[str, ShardStore], reps: int, figures: dict) -> None:
    """Best rows/s of pull and push of 16K random known ids per store, interleaved rep by rep
    (fresh ids every rep) so that load from other processes hits every size alike."""
    rng = np.random.default_rng(7)
    g = (rng.normal(size=(N_REQ, DIM)) * 1e-4).astype(np.float32)
    times: dict[str, list[float]] = {f"{op}_{tag}": [] for tag in stores for op in ("pull", "push")}
    for _ in range(reps):
        for tag, s in stores.items():
            b = _ids(0, 1)[0] + np.int64(ID_MULT) * rng.integers(0, s.tables["t"].capacity, N_REQ)
            t0 = time.perf_counter()
            s.pull("t", b)
            times[f"pull_{tag}"].append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            s.push("t", b, g)
            times[f"push_{tag}"].append(time.perf_counter() - t0)
    for k, v in times.items():
        op, tag = k.split("_", 1)
        figures[f"{op}_rows_per_s_{tag}"] = round(N_REQ / min(v))


def _gather_order(big: int, reps: int, figures: dict) -> None:
    """Does gathering 16K random rows in ascending row order help at scale? (issue 15 point 3)

    Two float32 [rows, 64] tables on 2 MiB pages (``BASE`` and ``big`` rows, random
    values), 16K fresh random rows per rep, the two sizes interleaved rep by rep; best
    wall time of ``reps`` of each way to fill a [16K, 64] reply (every way is checked
    bit-identical to the plain gather):

    * ``plain``: one ``index_select(out=)`` in request order (what ``EmbeddingTable`` does);
    * ``sorted``: ``np.argsort`` of the rows, ``index_select`` in ascending row order
      into a buffer, then the inverse permutation (``index_select`` from the
      cache-resident buffer) into the reply;
    * ``sorted_chunked``: the same, the sorted gather in chunks of 2048 rows;
    * ``presorted``: the ascending-order gather alone (its own gain, without the
      sort and the placement back; not a way to answer a pull).
    """
    rng = np.random.default_rng(11)
    tabs = {"base": hugepages.full((BASE, DIM), 0.0, torch.float32), "big": hugepages.full((big, DIM), 0.0, torch.float32)}
    for t in tabs.values():
        t.normal_(generator=torch.Generator().manual_seed(5))
    out = torch.empty((N_REQ, DIM), dtype=torch.float32)
    buf = torch.empty_like(out)
    inv = torch.empty(N_REQ, dtype=torch.int64)
    ar = np.arange(N_REQ, dtype=np.int64)

    def plain(w: torch.Tensor, r: np.ndarray) -> None:
        torch.index_select(w, 0, torch.from_numpy(r), out=out)

    def sorted_(w: torch.Tensor, r: np.ndarray, chunk: int = N_REQ) -> None:
        perm = np.argsort(r)
        srt = torch.from_numpy(r[perm])
        for lo in range(0, N_REQ, chunk):
            torch.index_select(w, 0, srt[lo : lo + chunk], out=buf[lo : lo + chunk])
        inv.numpy()[perm] = ar
        torch.index_select(buf, 0, inv, out=out)

    def presorted(w: torch.Tensor, r: np.ndarray) -> None:
        torch.index_select(w, 0, torch.from_numpy(r), out=buf)

    ways = {"plain": plain, "sorted": sorted_, "sorted_chunked": lambda w, r: sorted_(w, r, 2048),
            "presorted": presorted}
    best = {(tag, k): float("inf") for tag in tabs for k in ways}
    for _ in range(reps):
        for tag, w in tabs.items():
            r = rng.integers(0, w.shape[0], N_REQ).astype(np.int64)
            ref = w.index_select(0, torch.from_numpy(r))
            for k, fn in ways.items():
                arg = np.sort(r) if k == "presorted" else r
                t0 = time.perf_counter()
                fn(w, arg)
                best[tag, k] = min(best[tag, k], time.perf_counter() - t0)
                if k != "presorted" and not torch.equal(out, ref):
                    raise AssertionError(f"gather order '{k}' differs from the plain gather")
    for (tag, k), dt in best.items():
        figures[f"gather_{k}_rows_per_s_{tag}"] = round(N_REQ / dt)
    for k in ways:
        figures[f"gather_{k}_big_vs_base"] = round(best["base", k] / best["big", k], 3)
        figures[f"gather_{k}_vs_plain_big"] = round(best["big", "plain"] / best["big", k], 3)


GIGANTIC = 1 << 30
_MAP_HUGETLB = 0x40000
_MAP_HUGE_1GB = 30 << 26  # log2(1 GiB) << MAP_HUGE_SHIFT
_NR_GIGANTIC = Path("/sys/kernel/mm/hugepages/hugepages-1048576kB/nr_hugepages")


def _gigantic_table(rows: int) -> tuple[torch.Tensor, mmap.mmap] | None:
    """A float32 [rows, DIM] table on 1 GiB hugetlbfs pages, or None when the kernel has too few.

    1 GiB pages come only from a reserved pool (``nr_hugepages`` under
    /sys/kernel/mm/hugepages/hugepages-1048576kB, root; at run time a fragmented
    machine may reserve fewer than asked), so this is a measurement, not a PS option.
    """
    size = -(-rows * DIM * 4 // GIGANTIC) * GIGANTIC
    try:
        m = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS | _MAP_HUGETLB | _MAP_HUGE_1GB)
    except OSError:
        return None
    t = torch.from_numpy(np.frombuffer(m, dtype=np.float32, count=rows * DIM).reshape(rows, DIM))
    return t, m


def _page_sizes(big: int, reps: int, figures: dict) -> None:
    """Is the pull's fall with table size a TLB effect? (issue 15 point 3)

    The same plain 16K-row random gather (``index_select(out=)``, what
    ``EmbeddingTable._gather`` does) from a 1M-row table and a ``big``-row table on
    4 KiB pages, 2 MiB transparent huge pages (``ps.hugepages``) and, where the
    kernel's reserved pool holds them, 1 GiB pages (``big`` is cut to what the pool
    holds; ``page_big_rows`` says what was measured). With 1 GiB pages the big table
    spans a handful of TLB entries (Zen 4's L1 DTLB holds 64 of them): if the big/1M
    ratio stays where it is on 2 MiB pages, translation is not what limits it. Best
    wall time of ``reps`` per way; each size and page kind lives alone (one table at
    a time), 16K fresh random rows per rep.
    """
    figures["gigantic_pages_reserved"] = int(_NR_GIGANTIC.read_text()) if _NR_GIGANTIC.exists() else 0
    if figures["gigantic_pages_reserved"]:  # one table at a time: the big one may take the whole pool
        big = min(big, figures["gigantic_pages_reserved"] * GIGANTIC // (DIM * 4))
    figures["page_big_rows"] = big
    rng = np.random.default_rng(13)
    out = torch.empty((N_REQ, DIM), dtype=torch.float32)
    got: tuple[torch.Tensor, mmap.mmap] | None = None
    w: torch.Tensor | None = None

    def best_rate(table: torch.Tensor) -> float:
        best = float("inf")
        for _ in range(reps):
            r = torch.from_numpy(rng.integers(0, table.shape[0], N_REQ).astype(np.int64))
            t0 = time.perf_counter()
            torch.index_select(table, 0, r, out=out)
            best = min(best, time.perf_counter() - t0)
        return N_REQ / best

    for tag, rows in (("base", BASE), ("big", big)):
        for kind in ("4k", "2m", "1g"):
            if kind == "1g":
                got = _gigantic_table(rows)
                if got is None:
                    continue
                w = got[0]
            else:
                hugepages.ENABLED = kind == "2m"
                w = hugepages.empty((rows, DIM), torch.float32)
            w.normal_(generator=torch.Generator().manual_seed(5))  # touch every page first
            figures[f"page_{kind}_rows_per_s_{tag}"] = round(best_rate(w))
            w = got = None  # the last reference to a 1 GiB mapping unmaps it (back to the pool)
            gc.collect()
    hugepages.ENABLED = True
    for kind in ("4k", "2m", "1g"):
        if f"page_{kind}_rows_per_s_big" in figures and f"page_{kind}_rows_per_s_base" in figures:
            figures[f"page_{kind}_big_vs_base"] = round(
                figures[f"page_{kind}_rows_per_s_big"] / figures[f"page_{kind}_rows_per_s_base"], 3)


def build(rows: int, figures: dict, tag: str, new_rows: int) -> ShardStore:
    """Fill a ``rows``-capacity table (all but ``new_rows`` by import, the rest by push); memory figures."""
    before = rss_anon()
    s = ShardStore([_cfg(rows)], shard_id=0, num_vshards=V, seed=0)
    t = s.tables["t"]
    figures[f"fill_rows_per_s_{tag}"] = round(_fill(s, rows - new_rows))
    if new_rows:  # insert path: never-seen ids into a nearly full table
        g = np.zeros((N_REQ, DIM), np.float32)
        t0 = time.perf_counter()
        for lo in range(rows - new_rows, rows, N_REQ):
            ids = _ids(lo, min(rows, lo + N_REQ))
            s.push("t", ids, g[: ids.size])
        figures["insert_rows_per_s"] = round(new_rows / (time.perf_counter() - t0))
    assert t.size == rows, (t.size, rows)
    raw = t.raw_bytes_per_row()
    figures[f"bytes_per_row_{tag}"] = round(s.memory_bytes() / rows, 1)
    figures[f"rss_bytes_per_row_{tag}"] = round((rss_anon() - before) / rows, 1)
    figures["raw_bytes_per_row"] = raw
    return s


def _committed(store: ShardStore, work: Path, step: int) -> Path:
    """``store`` saved as a committed one-shard checkpoint under ``work`` (untimed)."""
    tmp = ckpt.checkpoint_tmp_dir(work, step=step)
    ckpt.save_shard(store, tmp, shard_id=0)
    return ckpt.commit_checkpoint(tmp, {"step": step})


def service_restore_extra(store: ShardStore, work: Path) -> float:
    """Peak extra RssAnon of the service's restore (fresh store + load, old one alive) / store bytes."""
    final = _committed(store, work, step=1)
    gc.collect()
    with PeakRss() as p:
        fresh = store.empty_like()
        ckpt.load_shard(fresh, final, range(V))
    extra = p.extra / store.memory_bytes()
    del fresh
    shutil.rmtree(final)
    return extra


def recover(final: Path, cfg: TableConfig) -> tuple[float, int, int]:
    """A *recovery*: ``restore_shard_checkpoint`` of ``final`` on a shard that just started (a
    pristine store, filled in place: ``ps.coordinator``), as a restarted ``metaps ps`` does.

    A real (not started) PsServer with the checkpoint's table; the caller has freed the store
    the checkpoint came from, as in a restarted process. Returns (seconds, peak extra RssAnon
    bytes while it ran, rows the shard then holds).
    """
    from common.rpc import RpcConfig
    from ps.config import PsConfig
    from ps.coordinator import restore_shard_checkpoint
    from ps.factory import build_server

    server = build_server(PsConfig(shards=1, num_vshards=V), RpcConfig(token="bench-token"), [cfg], 0)
    gc.collect()
    with PeakRss() as p:
        t0 = time.perf_counter()
        restore_shard_checkpoint(server, final)  # verifies every file's sha256 first
        dt = time.perf_counter() - t0
    rows = sum(t.size for t in server.store.tables.values())
    del server
    gc.collect()
    return dt, p.extra, rows


class _Done(Exception):
    """--no-ckpt: stop after the size measurements."""


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true", help="big table of 4M rows (about a minute)")
    ap.add_argument("--rows", type=int, default=0, help="rows of the big table (default 50M, quick 4M)")
    ap.add_argument("--ckpt-dir", default="", help="where the checkpoint is written (default: a temp dir)")
    ap.add_argument("--no-hugepages", action="store_true", help="tables on 4 KiB pages (A/B of ps.hugepages)")
    ap.add_argument("--no-ckpt", action="store_true", help="skip checkpoint and restore")
    ap.add_argument("--intra-op-threads", type=int, default=1,
                    help="[ps] intra_op_threads for the pulls and pushes (default 1, the PS default)")
    ap.add_argument("--page-sizes", action="store_true",
                    help="only compare the plain gather on 4 KiB, 2 MiB and (if reserved) 1 GiB pages")
    ap.add_argument("--gather-order", action="store_true",
                    help="only compare gathers in request order vs ascending row order (1M vs --rows)")
    ap.add_argument("--smoke", action="store_true",
                    help="smallest size that runs every code path and prints the JSON line (base table 64K rows, "
                         "big 256K, 3 reps; seconds, figures meaningless; the keys keep their names)")
    args = ap.parse_args()
    if args.smoke:
        global BASE
        BASE = 1 << 16
    hugepages.ENABLED = not args.no_hugepages
    torch.set_num_threads(1)
    intra_op.set_threads(args.intra_op_threads)
    big = args.rows or (1 << 18 if args.smoke else 4_000_000 if args.quick else 50_000_000)
    reps = 3 if args.smoke else 15 if args.quick else 25
    work = Path(args.ckpt_dir or tempfile.mkdtemp(prefix="ps_scale_"))
    work.mkdir(parents=True, exist_ok=True)
    figures: dict = {"base_rows": BASE, "big_rows": big, "dim": DIM, "rows_per_request": N_REQ,
                     "hugepages": hugepages.ENABLED, "intra_op_threads": args.intra_op_threads}
    try:
        if args.gather_order:
            _gather_order(big, reps, figures)
            raise _Done
        if args.page_sizes:
            _page_sizes(big, reps * 3, figures)
            raise _Done
        base = build(BASE, figures, "base", new_rows=0)
        figures["service_restore_extra_vs_store"] = round(service_restore_extra(base, work), 3)
        gc.collect()
        final = _committed(base, work, step=3)
        nbytes, cfg = base.memory_bytes(), base.tables["t"].cfg
        del base  # a restarted process: the old store is gone
        gc.collect()
        figures["recovery_restore_extra_vs_store"] = round(recover(final, cfg)[1] / nbytes, 3)
        shutil.rmtree(final)
        base = build(BASE, {}, "base", new_rows=0)  # the same table again, for the pull/push figures
        gc.collect()
        s = build(big, figures, "big", new_rows=min(big // 8, 32 * N_REQ))
        _pull_push({"base": base, "big": s}, reps, figures)
        del base
        gc.collect()
        figures["pull_50m_vs_1m"] = round(figures["pull_rows_per_s_big"] / figures["pull_rows_per_s_base"], 3)
        figures["push_50m_vs_1m"] = round(figures["push_rows_per_s_big"] / figures["push_rows_per_s_base"], 3)
        raw = figures["raw_bytes_per_row"]
        figures["bytes_per_row_ratio"] = round(figures["bytes_per_row_big"] / raw, 3)
        figures["rss_per_row_ratio"] = round(figures["rss_bytes_per_row_big"] / raw, 3)
        store_bytes = s.memory_bytes()
        figures["hugepage_bytes_vs_store"] = round(hugepages.huge_bytes() / store_bytes, 3)
        if args.no_ckpt:
            raise _Done

        tmp = ckpt.checkpoint_tmp_dir(work, step=2)
        gc.collect()
        with PeakRss() as p:
            t0 = time.perf_counter()
            ckpt.save_shard(s, tmp, shard_id=0)
            dt = time.perf_counter() - t0
        final = ckpt.commit_checkpoint(tmp, {"step": 2})
        size = ckpt.shard_path(final, 0).stat().st_size
        figures["ckpt_rows_per_s"] = round(big / dt)
        figures["ckpt_gb_per_s"] = round(size / dt / 1e9, 3)
        figures["ckpt_file_gb"] = round(size / 1e9, 2)
        figures["ckpt_peak_extra_mb"] = round(p.extra / 1e6, 1)
        figures["ckpt_peak_extra_vs_store"] = round(p.extra / store_bytes, 4)

        del s
        gc.collect()
        dt, extra, rows = recover(final, _cfg(big))
        assert rows == big, (rows, big)
        figures["restore_rows_per_s"] = round(big / dt)
        figures["restore_gb_per_s"] = round(size / dt / 1e9, 3)
        # the empty store is allocated up front (capacity rows): extra = what filling it adds
        figures["restore_peak_extra_vs_store"] = round(extra / store_bytes, 4)
    except _Done:
        pass
    finally:
        if not args.ckpt_dir:
            shutil.rmtree(work, ignore_errors=True)
    for k, v in figures.items():
        print(f"{k:34s} {v}")
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
