"""metaps's training step against what a user would run instead: same model, data, batches and threads, one run.

Run::

    python -m bench.peers [--quick] [--smoke] [--rows N] [--pairs N] [--window N] [--meta-window N]
                          [--fleet-pairs N] [--no-fleet]

Data and model are those of ``bench.train_throughput`` (its ``make_data`` and
``write_job``, imported): generated AntM2C-like rows built as a plain Meta-IO set
(256 rows a batch) and as a meta set (support 8, query 4, 768 rows a batch = 64
tasks); the ``dnn`` model (29 tables of dim 16, one per id column; hidden [128, 64],
heads click and conversion with target click * conversion); one torch thread
everywhere (``torch.set_num_threads(1)``; ``OMP_NUM_THREADS=1`` before torch is
imported when run as a script).

Equal terms. Every in-process arm has the same two threads: a loader thread
(``meta_io.prefetch.prefetch(..., depth=2)`` over ``read_range`` of each window
segment, as ``Worker.train``; a user's DataLoader with one worker) that reads each
batch and does the per-batch input work that needs no model state, and the step
thread. metaps runs at the job's own defaults: ``write_job``'s job with its ``[train]
log_every`` (2, for the fleet's report history) removed, so ``log_every`` and
``tb_every_steps`` are the job defaults (progress lines, live TensorBoard scalars,
report snapshots and the meta step's logged-step diagnostic all as in a real run;
the JSON's ``metaps_logging`` says which).

In-process arms (one object each: ``setup()``, then ``run(window)`` -> wall and CPU
seconds, steps, real rows and losses of the window; a warm-up is an untimed ``run``):

* ``metaps_plain``: ``metaps train-local``'s own loop, in this process: a
  ``workers.worker.Worker`` over a ``LocalRowSource(local_store(job))`` with no
  controller, and per window exactly the inner loop of ``Worker.train``:
  ``for stats in w.trainer.run(prefetch(w.read(f, a, b), depth=2)): w._after_step(stats)``
  (``w.dataset.read_range`` where the Worker has no ``read``). All else is
  train-local's default (rowwise Adagrad lr 0.05 on the rows in fbgemm TBE, Adam lr
  1e-3 on the dense parameters in the store's DenseStore).
* ``metaps_meta``: the same on the meta set with ``[train] mode = "meta"`` and
  ``[meta] inner_steps = 1, first_order = true, adapt = "both"`` (inner lr: the
  default ``[meta] inner_lr``).
* ``torch``: a plain PyTorch loop written here: one
  ``nn.EmbeddingBag(N + 1, 16, mode="mean", sparse=True, padding_idx=N)`` per table
  (N = the job's table capacity, rows initialised N(0, 0.01) like the PS's
  default), the same dense network as ``models/dnn.py`` (flat = cat(pooled rows per
  id column in the model's table order, Linear(vector_dim -> 16) per vector column,
  sign(x) * log1p(|x|) of the dense columns); wide Linear(in, 2) + MLP [128, 64] ->
  Linear(64, 2)), loss = the sum of the two heads' mean BCE-with-logits over real
  rows, ``torch.optim.Adagrad(rows, lr=0.05)`` (sparse gradients) and
  ``torch.optim.Adam(dense, lr=1e-3)``. Loader thread: the ids mapped
  ``where(ids < 0, N, ids % N)``, the head targets.
* ``torch_rowwise``: the same loop with a hand-written rowwise Adagrad on the
  embedding weights (metaps's default optimizer): per touched row of the coalesced
  sparse gradient ``m += mean(g^2)``, ``w -= 0.05 * g / (sqrt(m) + 1e-8)``.
* ``floor``: the kernel-only step: fbgemm's ``SplitTableBatchedEmbeddingBagsCodegen``
  on CPU over the same 29 tables (N rows each, mean pooling, ``EXACT_ROWWISE_ADAGRAD``
  lr 0.05 fused in its backward), the same dense net and Adam. Loader thread: the
  jagged ids (padding dropped, ``% N``) and their offsets.
* ``torchrec`` (only where ``import torchrec`` works; not in this project's venv:
  the JSON then holds ``local_vs_torchrec*: null`` and ``local_vs_torchrec_reason``):
  a ``FusedEmbeddingBagCollection`` of the 29 tables (``RowWiseAdagrad``, i.e.
  fbgemm's EXACT_ROWWISE_ADAGRAD, lr 0.05, updated inside the backward), the same
  dense net and Adam. Loader thread: the batch's ``KeyedJaggedTensor`` (padding ids
  dropped). See docs/peers.md for a venv where it runs.
* ``torchfunc``: a torch.func MAML reference written here, on the meta set, grad
  inside vmap: per meta batch the unique rows of each table (``batch.unique_ids``)
  are gathered from plain per-table weight tensors (``index_select``) into one
  ``[U, 16]`` tensor, each task's ids re-indexed onto its own rows (a per-task sort,
  vectorized), then ``vmap`` over the 64 tasks of: ``torch.func.grad`` of the support
  loss w.r.t. (dense params, task rows), one inner SGD step at the job's
  ``inner_lr`` (first order: inner grads detached), the query loss; the outer
  gradient (``torch.func.grad_and_value`` of the mean query loss over real tasks,
  w.r.t. the dense params and the gathered rows) is applied with Adam (dense, lr
  1e-3) and a rowwise Adagrad (rows, lr 0.05, ``index_add_`` into the tables). The
  dense part is this file's ``DenseNet`` (called with
  ``torch.func.functional_call``); id columns are pooled per id-list width group (3
  groups: single ids, multi-hot, text) by a gather and a weighted sum, which permutes
  the flat input's columns (same network up to that order). Padded rows (``mask``)
  and padded or query-less tasks (``task_mask``) are masked as in ``models/meta.py``.
  Loader thread: the positions, pooling weights, per-task re-index and task weights
  (everything but the gather of the current rows).
* ``torchfunc_bag``: the same with ``F.embedding_bag(mode="mean")`` pooling (padding
  to an appended zero row). torch has no vmap batching rule for ``embedding_bag``, so
  it runs torch's per-task fallback: slower than ``torchfunc`` here, which is why the
  headline ``meta_vs_torchfunc`` is against ``torchfunc`` (the faster reference) and
  ``meta_vs_torchfunc_bag`` is beside it.

How the arms are measured: every arm first trains untimed on a few warm-up
batches. Then ``--pairs`` rounds; in round ``i`` every arm trains on the same window
``i`` of W batches (W = ``--window`` plain batches, ``--meta-window`` meta batches;
windows walk through the data set, wrapping around), one arm after the other, the
order reversed every other round (metaps first in even rounds, last in odd ones).
Per window: real rows (``mask``) over its wall clock, and over the process's CPU
time (``time.process_time``: every thread, loader included). Per arm: the median,
min and max of each (``samples_per_s``, ``samples_per_cpu_s``); every ratio is a
ratio of medians, in wall clock (``local_vs_torch``) and per CPU-second
(``local_vs_torch_per_cpu``) (``paired``: the min and max of the per-round ratio).
``cpu_per_wall`` is the window's CPU over its wall clock: how many cores an arm kept
busy; ``cpu_ms_per_batch`` the median CPU per step.

Fleet (separate processes, after the in-process rounds): five configurations of
``bench.train_throughput``'s plain job, one epoch each, fresh processes every run:
``train-local`` (``metaps train-local``, overlap off: the baseline), and with
``metaps launch`` (launcher, controller, one agent per PS and per worker, the PS
shards, the workers; overlap ``auto``, async PS) ``1x1`` (1 PS, 1 worker), ``2x2``,
``2x1`` and ``4x1``. The configurations run one at a time in ``--fleet-pairs``
interleaved rounds (order reversed every other round). A run's figures come from
its steady window, from the latest first to the earliest last worker history
record (``[train] log_every = 2`` in these job files, in train-local too): batches
trained in it (each worker's step count interpolated at its ends) and the CPU of
every process of the run's tree in it (utime + stime + reaped children's, from
``/proc/<pid>/stat``, sampled every 50 ms by role and interpolated: see
``bench.procstat``). ``cpu_per_batch_ms`` = that CPU / those batches; samples/s over
the same window is the wall figure. Process start-up, step 1, evaluation, the final
checkpoint and shutdown fall outside the window (``run_wall_s``, ``run_cpu_s``: the
whole run's, from ``getrusage(RUSAGE_CHILDREN)``). Per round: efficiency = train-local
CPU per batch / the configuration's, wall = its samples/s / train-local's; the JSON
has their medians over rounds (``paired``: min and max).

Profile of metaps's plain step: the mean ms per phase over every timed
``metaps_plain`` step (``StepStats.pull_s``, ``compute_s``, ``push_s``,
``total_s``, as ``Worker._after_step`` receives them; ``data_wait``, the worker's
own figure of the wait for the next batch; ``wall``, the window's wall clock per
step; ``loop`` = wall - total - data_wait: ``_after_step`` and the loop itself),
the same for ``metaps_meta``, and a cProfile of one more ``metaps_plain`` window (untimed)
with each function's own time put in a bucket by module: ``ps/`` (store path:
rows and the dense optimizer), ``models/`` (forward and loss), ``workers/``
(loop), ``meta_io/`` (reader: the prefetch thread itself is not profiled, only
the step thread's wait for it), torch autograd backward (the engine's
``run_backward``, unless the ``ps/`` store called it), other (``metaps/``'s ground
floor, this file). Time spent in torch or other library code goes to the bucket of
the repository code that called it (split by the time of each call edge,
recursively; the venv's site-packages never count as repository code).

Sizes: default 130k rows (so that no window wraps around to ids the tables already
hold), 15 rounds of 30 plain / 8 meta batches, fleet 5 pairs on the same 130k rows
(25 fleet runs of 508 batches: expect 15-25 minutes on 2 cores, not yet timed);
``--quick`` 40k rows, 6 rounds of 10 / 3 batches, fleet 2 pairs on 20k rows (about 4
minutes on a loaded 2-core box: 20 s in process, then 10 fleet runs of 7-38 s, mostly
process start-up); ``--smoke`` 2,000 rows, tables of 20k rows for a fast set-up, 2 rounds of
2 / 1-batch windows (seconds), then every fleet configuration once on 6,000 rows
(about two minutes; figures meaningless: it checks that everything runs).
``--rows``, ``--pairs``, ``--window``, ``--meta-window``, ``--fleet-pairs`` override
the sizes; ``--no-fleet`` skips the fleet.

The last line printed is one JSON object. In-process, each as ``KEY`` (wall clock)
and ``KEY_per_cpu`` (samples per CPU-second), metaps / reference, > 1: metaps does
more: ``local_vs_torch``, ``local_vs_torch_rowwise``, ``local_vs_floor`` (= the
kernel-only step's CPU per batch / metaps's, per CPU), ``local_vs_torchrec`` (null
with ``local_vs_torchrec_reason`` when not measured; ``torchrec`` says why),
``meta_vs_torchfunc``, ``meta_vs_torchfunc_bag``; ``samples_per_s``,
``samples_per_cpu_s`` (per arm: median, min, max), ``steps_per_s``,
``cpu_ms_per_batch``, ``cpu_per_wall`` (medians), ``loss`` (per arm: mean loss of
the first and last window, a check that every arm trains), ``metaps_logging``,
``profile`` (``phases_ms`` per metaps arm; ``cprofile``: ``ms_per_step`` and ``share``
per bucket). Fleet: ``dist_1x1_cpu_efficiency``, ``dist_2x2_cpu_efficiency``,
``dist_2ps_cpu_efficiency`` (2 PS, 1 worker), ``dist_4ps_cpu_efficiency`` (4 PS, 1
worker) (train-local CPU per batch / the fleet's, every process), each with its wall
figure ``dist_*_vs_local`` (fleet samples/s / train-local's); ``ps_cpu_per_batch_ms``
(the PS processes' CPU per batch at 1, 2 and 4 shards, one worker); ``fleet``
(``configs``: per configuration ``cpu_per_batch_ms`` and ``samples_per_s`` (median,
min, max), ``by_role_ms`` (launch, controller, agent, ps, worker, train-local,
other), ``cores_busy``, ``steady_batches``, ``run_wall_s``, ``run_cpu_s``,
``run_batches``). Also ``paired`` (per ratio: min and max over rounds), ``pairs``,
``window``, ``rows``, ``batches``, ``load`` (1-min load average before/after),
``elapsed_s``, ``smoke``, ``quick``.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # before torch is imported anywhere
    os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import bisect
import cProfile
import json
import pstats
import resource
import statistics
import subprocess
import tempfile
import threading
import time
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bench.procstat import process_tree, stat_cpu_s
from bench.train_throughput import _env, make_data, write_job

REPO = Path(__file__).resolve().parents[1]
LR_ROWS = 0.05
LR_DENSE = 1e-3
EPS = 1e-8
INIT_STD = 0.01  # the PS's default initial rows: normal, std 0.01
Segment = tuple[int, int, int]  # (file, start, stop) of one read_range
Window = list[Segment]


_T0 = time.perf_counter()


def _progress(msg: str) -> None:
    stamp = f"{time.perf_counter() - _T0:6.1f}s " if msg.startswith("[") else " " * 8
    print(stamp + msg, flush=True)


# -- data windows ------------------------------------------------------------------------------
class Windows:
    """Batch positions of a data set, cut into consecutive windows that wrap around.

    Args:
        dataset: a ``MetaIODataset``.
    """

    def __init__(self, dataset: Any) -> None:
        self.pos = [(f, b) for f in range(dataset.num_files) for b in range(dataset.num_batches(f))]
        self.cursor = 0

    def take(self, n: int) -> Window:
        """The next ``n`` batches as read_range segments (consecutive batches of one file merge)."""
        segs: Window = []
        for _ in range(n):
            f, b = self.pos[self.cursor % len(self.pos)]
            self.cursor += 1
            if segs and segs[-1][0] == f and segs[-1][2] == b:
                segs[-1] = (f, segs[-1][1], b + 1)
            else:
                segs.append((f, b, b + 1))
        return segs


@dataclass
class WindowResult:
    seconds: float  # wall clock
    cpu_s: float  # this process's CPU time (every thread: metaps's prefetch thread too)
    steps: int
    samples: int
    losses: list[float]


# -- the dense network of models/dnn.py, written again -------------------------------------------
class DenseNet(nn.Module):
    """``flat = cat(pooled, proj(vectors), signed_log1p(dense))``; wide + deep -> logits ``[*L, H]``.

    Args:
        n_id_cols: id columns (each pooled to ``dim``).
        dim: embedding dim (also the vector projection width).
        vector_dims: input width of each vector column.
        n_dense: dense columns.
        hidden: MLP widths.
        heads: output heads.
    """

    def __init__(self, n_id_cols: int, dim: int, vector_dims: Sequence[int], n_dense: int, hidden: Sequence[int],
                 heads: int) -> None:
        super().__init__()
        self.proj = nn.ModuleList(nn.Linear(d, dim) for d in vector_dims)
        d_in = n_id_cols * dim + dim * len(vector_dims) + n_dense
        self.wide = nn.Linear(d_in, heads)
        layers: list[nn.Module] = []
        w_in = d_in
        for w in hidden:
            layers += [nn.Linear(w_in, w), nn.ReLU()]
            w_in = w
        self.deep = nn.Sequential(*layers)
        self.out = nn.Linear(w_in, heads)

    def forward(self, pooled: Tensor, vectors: list[Tensor], dense: Tensor) -> Tensor:
        parts = [pooled] + [p(v) for p, v in zip(self.proj, vectors)]
        parts.append(torch.sign(dense) * torch.log1p(torch.abs(dense)))
        x = torch.cat(parts, dim=-1)
        return self.wide(x) + self.out(self.deep(x))


def masked_bce(logits: Tensor, target: Tensor, mask: Tensor) -> Tensor:
    """Mean BCE-with-logits over rows where ``mask`` (0 when none)."""
    target = torch.where(mask, target, torch.zeros_like(target))
    per_row = F.binary_cross_entropy_with_logits(logits, target, reduction="none")
    per_row = torch.where(mask, per_row, torch.zeros_like(per_row))
    return per_row.sum() / mask.sum().clamp_min(1).to(per_row.dtype)


def head_targets(labels: dict[str, Tensor], names: Sequence[str]) -> list[Tensor]:
    """click, then click * label for every later label (the CTR -> CTCVR heads)."""
    first = labels[names[0]]
    return [first] + [labels[n] * first for n in names[1:]]


class _Spec:
    """What every torch arm needs from the job: schema order, capacity, dims."""

    def __init__(self, job: Any) -> None:
        self.schema = job.schema()
        s = self.schema
        # the dnn model's flat order: tables in schema order, each table's id columns in schema order
        self.cols = [c for t in s.tables for c in s.id_columns if c.table_name == t]
        self.tables = list(s.tables)
        self.vec_cols = [c.name for c in s.vector_columns]
        self.vec_dims = [c.dim for c in s.vector_columns]
        self.n_dense = len(s.dense_columns)
        self.labels = list(s.labels)
        self.dim = int(job.model.default_dim)
        self.hidden = list(job.model.hidden)
        self.capacity = int(job.table_configs()[0].capacity) * int(job.ps.shards)
        dims = {t.dim for t in job.table_configs()}
        if dims != {self.dim}:
            raise SystemExit(f"bench.peers assumes every table has dim {self.dim}, got {sorted(dims)}")

    def net(self) -> DenseNet:
        torch.manual_seed(0)
        return DenseNet(len(self.cols), self.dim, self.vec_dims, self.n_dense, self.hidden, len(self.labels))


def _rowwise_adagrad(weight: Tensor, state: Tensor, idx: Tensor, grad: Tensor, lr: float = LR_ROWS) -> None:
    """``m[i] += mean(g_i^2)``; ``w[i] -= lr * g_i / (sqrt(m[i]) + eps)`` (repeated ``idx`` accumulate)."""
    state.index_add_(0, idx, grad.pow(2).mean(1))
    weight.index_add_(0, idx, grad * (-lr / (state[idx].sqrt() + EPS)).unsqueeze(1))


# -- arms ----------------------------------------------------------------------------------------
class Arm:
    """One way to train: ``setup()`` once, then ``run(window)`` per window (timed)."""

    name = ""
    mode = "plain"

    def setup(self) -> None:
        raise NotImplementedError

    def steps(self, window: Window) -> Iterator[tuple[float, int]]:
        """Train on the window's batches; yield ``(loss, real rows)`` per step."""
        raise NotImplementedError

    def run(self, window: Window) -> WindowResult:
        losses: list[float] = []
        samples = 0
        c0, t0 = time.process_time(), time.perf_counter()
        for loss, k in self.steps(window):
            losses.append(loss)
            samples += k
        return WindowResult(time.perf_counter() - t0, time.process_time() - c0, len(losses), samples, losses)


class _Loader(Arm):
    """The references: a loader thread reads each batch and ``prepare``s it, the step thread ``step``s.

    The loader is ``meta_io.prefetch.prefetch(..., depth=2)`` over ``ds.read_range`` of each
    window segment, the same thread and depth as metaps's ``Worker.train`` (a user's
    DataLoader with one worker, as a thread).
    """

    ds: Any

    def prepare(self, batch: Any) -> Any:
        """Per-batch input work that needs no model state (runs on the loader thread)."""
        return batch

    def step(self, prepared: Any) -> tuple[float, int]:
        raise NotImplementedError

    def _read(self, f: int, a: int, b: int) -> Iterator[Any]:
        src = self.ds.read_range(f, a, b)
        try:
            for batch in src:
                yield self.prepare(batch)
        finally:
            close = getattr(src, "close", None)
            if close is not None:
                close()

    def steps(self, window: Window) -> Iterator[tuple[float, int]]:
        from meta_io.prefetch import prefetch

        for f, a, b in window:
            for prepared in prefetch(self._read(f, a, b), depth=2):
                yield self.step(prepared)


def _default_logging(src: Path, dst: Path) -> Path:
    """``write_job``'s job without its ``[train] log_every`` / ``tb_every_steps``: the job's own defaults."""
    import tomllib

    from common.toml_writer import dumps

    job = tomllib.loads(src.read_text())
    for key in ("log_every", "tb_every_steps"):
        job.get("train", {}).pop(key, None)
    dst.write_text(dumps(job))
    return dst


class MetapsArm(Arm):
    """metaps train-local's loop in this process (see the module docstring)."""

    def __init__(self, name: str, job_path: Path, run_dir: Path, mode: str, capacity: int = 0) -> None:
        self.name, self.mode, self.job_path, self.run_dir = name, mode, job_path, run_dir
        self.capacity = capacity  # 0: write_job's table capacity; --smoke: smaller (a faster set-up)
        self.stats: list[Any] = []
        self.waits: list[float] = []  # Worker._after_step's data wait of each recorded step
        self.record = True

    def setup(self) -> None:
        from metaps.job import load_job
        from workers.local import local_store
        from workers.row_source import LocalRowSource
        from workers.worker import Worker

        overrides: dict[str, dict[str, Any]] = {}  # logging and TensorBoard: the job's defaults
        if self.capacity:
            overrides["ps"] = {"table_defaults": {"dim": 16, "capacity": self.capacity}}
        if self.mode == "meta":
            overrides["meta"] = {"inner_steps": 1, "first_order": True, "adapt": "both"}
        self.job = load_job(self.job_path, overrides)
        self.worker = Worker(self.job, 0, LocalRowSource(local_store(self.job)), controller=None,
                             run_dir=self.run_dir, world=1)

    def steps(self, window: Window) -> Iterator[tuple[float, int]]:
        from meta_io.prefetch import prefetch

        w = self.worker
        # Worker.train's source of batches: Worker.read where the worker has it (read_range plus the
        # trainer's per-batch preparation, on the prefetch thread), else the dataset's read_range
        read = getattr(w, "read", None) or w.dataset.read_range
        w._last_step_end = time.perf_counter()  # as Worker.train at its start: the first data wait is this window's
        for f, a, b in window:
            for stats in w.trainer.run(prefetch(read(f, a, b), depth=2)):
                w._after_step(stats)
                if self.record:
                    self.stats.append(stats)
                    rec = w._last_rec or {}
                    self.waits.append(float(rec.get("data_wait_s", 0.0)))
                yield stats.loss, stats.samples


def _dense_inputs(sp: _Spec, f: Any) -> tuple[list[Tensor], Tensor, list[Tensor], Tensor]:
    """``(vectors, dense, head targets, mask)`` of a plain batch's features."""
    return [f.vectors[v] for v in sp.vec_cols], f.dense, head_targets(f.labels, sp.labels), f.mask


def _loss(z: Tensor, targets: list[Tensor], mask: Tensor) -> Tensor:
    return sum((masked_bce(z[:, h], y, mask) for h, y in enumerate(targets)), torch.zeros(()))


class TorchArm(_Loader):
    """The plain PyTorch loop: EmbeddingBag per table, Adagrad (or rowwise Adagrad) + Adam."""

    def __init__(self, name: str, job: Any, data: Path, rowwise: bool) -> None:
        self.name, self.job, self.data, self.rowwise = name, job, data, rowwise

    def setup(self) -> None:
        from meta_io.reader import MetaIODataset

        self.spec = sp = _Spec(self.job)
        self.ds = MetaIODataset(self.data)
        n = sp.capacity
        torch.manual_seed(0)
        weights = [torch.empty(n + 1, sp.dim).normal_(0.0, INIT_STD) for _ in sp.cols]
        for w in weights:
            w[n] = 0.0
        self.bags = [nn.EmbeddingBag.from_pretrained(w, freeze=False, mode="mean", sparse=True, padding_idx=n)
                     for w in weights]
        self.embs = nn.ModuleList(self.bags)
        self.net = sp.net()
        self.dopt = torch.optim.Adam(self.net.parameters(), lr=LR_DENSE)
        if self.rowwise:
            self.acc = [torch.zeros(n + 1) for _ in sp.cols]
        else:
            self.sopt = torch.optim.Adagrad(list(self.embs.parameters()), lr=LR_ROWS)

    def prepare(self, batch: Any) -> Any:
        sp, n = self.spec, self.spec.capacity
        f = batch.features
        ids = [torch.where(f.ids[c.name] < 0, n, f.ids[c.name] % n) for c in sp.cols]
        return ids, *_dense_inputs(sp, f)

    def step(self, prepared: Any) -> tuple[float, int]:
        ids, vectors, dense, targets, mask = prepared
        pooled = [emb(i) for emb, i in zip(self.bags, ids)]
        loss = _loss(self.net(torch.cat(pooled, dim=-1), vectors, dense), targets, mask)
        self.dopt.zero_grad(set_to_none=True)
        if self.rowwise:
            for e in self.bags:
                e.weight.grad = None
        else:
            self.sopt.zero_grad(set_to_none=True)
        loss.backward()
        if self.rowwise:
            with torch.no_grad():
                for e, acc in zip(self.bags, self.acc):
                    assert e.weight.grad is not None
                    g = e.weight.grad.coalesce()
                    _rowwise_adagrad(e.weight, acc, g.indices()[0], g.values())
        else:
            self.sopt.step()
        self.dopt.step()
        return float(loss.detach()), int(mask.sum())


def _jagged(sp: _Spec, f: Any) -> tuple[Tensor, Tensor]:
    """Every id column's real ids (``% capacity``, padding dropped), column-major, and their lengths."""
    values, lengths = [], []
    for c in sp.cols:
        ids = f.ids[c.name]
        valid = ids >= 0
        values.append(ids[valid] % sp.capacity)
        lengths.append(valid.sum(-1))
    return torch.cat(values), torch.cat(lengths)


class FloorArm(_Loader):
    """The kernel-only step: fbgemm's TBE (rowwise Adagrad fused in its backward) + the same dense net and Adam."""

    name = "floor"

    def __init__(self, job: Any, data: Path) -> None:
        self.job, self.data = job, data

    def setup(self) -> None:
        import fbgemm_gpu  # noqa: F401  (registers torch.ops.fbgemm)
        from fbgemm_gpu.split_embedding_configs import EmbOptimType
        from fbgemm_gpu.split_table_batched_embeddings_ops_common import EmbeddingLocation, PoolingMode
        from fbgemm_gpu.split_table_batched_embeddings_ops_training import (
            ComputeDevice,
            SplitTableBatchedEmbeddingBagsCodegen,
        )

        from meta_io.reader import MetaIODataset

        self.spec = sp = _Spec(self.job)
        self.ds = MetaIODataset(self.data)
        specs = [(sp.capacity, sp.dim, EmbeddingLocation.HOST, ComputeDevice.CPU) for _ in sp.tables]
        self.tbe = SplitTableBatchedEmbeddingBagsCodegen(
            specs, feature_table_map=[sp.tables.index(c.table_name) for c in sp.cols],
            optimizer=EmbOptimType.EXACT_ROWWISE_ADAGRAD, learning_rate=LR_ROWS, eps=EPS, weight_decay=0.0,
            pooling_mode=PoolingMode.MEAN)
        torch.manual_seed(0)
        with torch.no_grad():
            for w in self.tbe.split_embedding_weights():
                w.normal_(0.0, INIT_STD)
        self.net = sp.net()
        self.dopt = torch.optim.Adam(self.net.parameters(), lr=LR_DENSE)

    def prepare(self, batch: Any) -> Any:
        f = batch.features
        values, lengths = _jagged(self.spec, f)
        offsets = torch.zeros(lengths.numel() + 1, dtype=torch.int64)
        torch.cumsum(lengths, 0, out=offsets[1:])
        return values, offsets, *_dense_inputs(self.spec, f)

    def step(self, prepared: Any) -> tuple[float, int]:
        values, offsets, vectors, dense, targets, mask = prepared
        loss = _loss(self.net(self.tbe(values, offsets), vectors, dense), targets, mask)
        self.dopt.zero_grad(set_to_none=True)
        loss.backward()  # the rows are updated inside the backward
        self.dopt.step()
        return float(loss.detach()), int(mask.sum())


class TorchRecArm(TorchArm):
    """TorchRec ``FusedEmbeddingBagCollection`` (rowwise Adagrad fused in the backward) + the same dense net."""

    def __init__(self, job: Any, data: Path) -> None:
        super().__init__("torchrec", job, data, rowwise=False)

    def setup(self) -> None:
        import torchrec  # noqa: F401  (checked by available())
        from torchrec.modules.embedding_configs import EmbeddingBagConfig, PoolingType
        from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection
        from torchrec.optim import RowWiseAdagrad

        from meta_io.reader import MetaIODataset

        self.spec = sp = _Spec(self.job)
        self.ds = MetaIODataset(self.data)
        torch.manual_seed(0)
        tables = [EmbeddingBagConfig(name=f"t_{c.name}", embedding_dim=sp.dim, num_embeddings=sp.capacity,
                                     feature_names=[c.name], pooling=PoolingType.MEAN,
                                     weight_init_min=-INIT_STD, weight_init_max=INIT_STD) for c in sp.cols]
        self.ebc = FusedEmbeddingBagCollection(tables=tables, optimizer_type=RowWiseAdagrad,
                                               optimizer_kwargs={"lr": LR_ROWS, "eps": EPS},
                                               device=torch.device("cpu"))
        self.net = sp.net()
        self.dopt = torch.optim.Adam(self.net.parameters(), lr=LR_DENSE)

    def prepare(self, batch: Any) -> Any:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        sp, f = self.spec, batch.features
        values, lengths = _jagged(sp, f)
        kjt = KeyedJaggedTensor(keys=[c.name for c in sp.cols], values=values, lengths=lengths)
        return kjt, *_dense_inputs(sp, f)

    def step(self, prepared: Any) -> tuple[float, int]:
        kjt, vectors, dense, targets, mask = prepared
        loss = _loss(self.net(self.ebc(kjt).values(), vectors, dense), targets, mask)
        self.dopt.zero_grad(set_to_none=True)
        loss.backward()  # the rows are updated inside the backward
        self.dopt.step()
        return float(loss.detach()), int(mask.sum())

    @staticmethod
    def available() -> str | None:
        """None when torchrec and its fused collection import, else why not (set-up errors are caught apart)."""
        try:
            import torchrec  # noqa: F401
            from torchrec.modules.fused_embedding_modules import FusedEmbeddingBagCollection  # noqa: F401
        except Exception as e:  # ImportError, or fbgemm's ops failing to load
            return f"import torchrec failed: {type(e).__name__}: {str(e)[:160]}"
        return None


class TorchFuncArm(_Loader):
    """torch.func MAML (first order, adapt both, one inner step) on the meta set; see the module docstring."""

    mode = "meta"
    name = "torchfunc"

    def __init__(self, job: Any, data: Path) -> None:
        self.job, self.data = job, data

    def setup(self) -> None:
        from meta_io.reader import MetaIODataset

        self.spec = sp = _Spec(self.job)
        self.ds = MetaIODataset(self.data)
        self.inner_lr = float(self.job.meta.inner_lr)
        n = sp.capacity
        torch.manual_seed(0)
        self.weights = {t: torch.empty(n, sp.dim).normal_(0.0, INIT_STD) for t in sp.tables}
        self.acc = {t: torch.zeros(n) for t in sp.tables}
        self.net = sp.net()
        self.opt = torch.optim.Adam(self.net.parameters(), lr=LR_DENSE)
        # id columns grouped by id-list width: one gather + pool per group inside the task function
        widths: dict[int, list[Any]] = {}
        for c in sp.cols:
            widths.setdefault(max(int(c.max_len), 1), []).append(c)
        self.groups = list(widths.values())
        self._grad = torch.func.grad_and_value(self._outer, argnums=(0, 1))

    # the differentiable part --------------------------------------------------------------
    def _pool(self, rows: Tensor, half: dict[str, Any]) -> list[Tensor]:
        """Mean-pooled rows per width group, ``[S, C_g * D]``: a gather and a weighted sum."""
        return [(rows[pos] * w.unsqueeze(-1)).sum(-2).flatten(-2) for pos, w in zip(half["pos"], half["w"])]

    def _half_loss(self, params: dict[str, Tensor], rows: Tensor, half: dict[str, Any]) -> Tensor:
        """One task's loss on one half: rows ``[K, D]`` (the task's own), positions into them."""
        z = torch.func.functional_call(self.net, params, (torch.cat(self._pool(rows, half), -1), half["vec"],
                                                          half["dense"]))
        mask = half["mask"]
        return sum((masked_bce(z[..., h], half["y"][..., h], mask) for h in range(z.shape[-1])), torch.zeros(()))

    def _task(self, params: dict[str, Tensor], rows: Tensor, sup: dict[str, Any], qry: dict[str, Any]) -> Tensor:
        g_p, g_r = torch.func.grad(lambda p, r: self._half_loss(p, r, sup), argnums=(0, 1))(params, rows)
        fast_p = {k: v - self.inner_lr * g_p[k].detach() for k, v in params.items()}  # first order
        fast_r = rows - self.inner_lr * g_r.detach()
        return self._half_loss(fast_p, fast_r, qry)

    def _outer(self, params: dict[str, Tensor], rows: Tensor, l2g: Tensor, sup: dict[str, Any],
               qry: dict[str, Any], weights: Tensor) -> Tensor:
        per_task = torch.func.vmap(self._task, in_dims=(None, 0, 0, 0))(params, rows[l2g], sup, qry)
        return (per_task * weights).sum() / weights.sum().clamp_min(1.0)

    # the eager part: positions and re-index (loader thread), gather and optimizers (step) --------
    def prepare(self, batch: Any) -> Any:
        sp, n = self.spec, self.spec.capacity
        uniq = [batch.unique_ids[t] for t in sp.tables]
        slots = [u % n for u in uniq]
        sizes = [int(u.numel()) for u in uniq]
        base = dict(zip(sp.tables, torch.tensor([0] + sizes[:-1]).cumsum(0).tolist()))
        u_all = sum(sizes)
        uniq_of = dict(zip(sp.tables, uniq))
        sup, qry = batch.support, batch.query
        n_sup = int(sup.mask.shape[1])
        t_count = int(sup.mask.shape[0])
        # global positions (into the gathered rows) and mean-pooling weights of every id, support and query together
        pos_g, w_g = [], []
        for cols in self.groups:
            ps, ws = [], []
            for c in cols:
                ids = torch.cat([sup.ids[c.name], qry.ids[c.name]], dim=1)  # [T, S+Q, m]
                valid = ids >= 0
                u = uniq_of[c.table_name]
                p = torch.searchsorted(u, ids.clamp_min(0)).clamp_max(max(u.numel() - 1, 0)) + base[c.table_name]
                ps.append(torch.where(valid, p, u_all))
                v = valid.to(torch.float32)
                ws.append(v / v.sum(-1, keepdim=True).clamp_min(1.0))
            pos_g.append(torch.stack(ps, dim=-2))  # [T, S+Q, C_g, M_g]
            w_g.append(torch.stack(ws, dim=-2))
        # per task: its distinct rows (sorted), local positions into them; padding maps to a weight-0 slot
        flat = torch.cat([p.reshape(t_count, -1) for p in pos_g], dim=1)
        sorted_pos, order = flat.sort(dim=1)
        new = torch.ones_like(sorted_pos, dtype=torch.bool)
        new[:, 1:] = sorted_pos[:, 1:] != sorted_pos[:, :-1]
        slot_sorted = new.long().cumsum(1) - 1
        local = torch.empty_like(slot_sorted).scatter_(1, order, slot_sorted)
        k = int(slot_sorted[:, -1].max()) + 1
        l2g = torch.zeros(t_count, k, dtype=torch.long).scatter_(1, slot_sorted, sorted_pos).clamp(0, max(u_all - 1, 0))
        local_g = list(local.split([p[0].numel() for p in pos_g], dim=1))
        local_g = [lp.reshape(p.shape) for lp, p in zip(local_g, pos_g)]

        def half(fb: Any, part: slice) -> dict[str, Any]:
            return {"pos": [lp[:, part] for lp in local_g], "w": [w[:, part] for w in w_g],
                    "vec": [fb.vectors[v] for v in sp.vec_cols], "dense": fb.dense, "mask": fb.mask,
                    "y": torch.stack(head_targets(fb.labels, sp.labels), dim=-1)}

        weights = (batch.task_mask.bool() & qry.mask.any(-1)).to(torch.float32)
        return {"slots": slots, "sizes": sizes, "l2g": l2g, "k": k, "sup": half(sup, slice(0, n_sup)),
                "qry": half(qry, slice(n_sup, None)), "weights": weights,
                "samples": int(sup.mask.sum()) + int(qry.mask.sum())}

    def step(self, prepared: Any) -> tuple[float, int]:
        sp, p = self.spec, prepared
        rows = torch.cat([self.weights[t].index_select(0, s) for t, s in zip(sp.tables, p["slots"])])
        params = {k_: v.detach() for k_, v in self.net.named_parameters()}
        (g_params, g_rows), loss = self._grad(params, rows, p["l2g"], p["sup"], p["qry"], p["weights"])
        for name, param in self.net.named_parameters():
            param.grad = g_params[name]
        self.opt.step()
        with torch.no_grad():
            for t, s, g in zip(sp.tables, p["slots"], g_rows.split(p["sizes"])):
                _rowwise_adagrad(self.weights[t], self.acc[t], s, g)
        return float(loss), p["samples"]


class TorchFuncBagArm(TorchFuncArm):
    """:class:`TorchFuncArm` with ``F.embedding_bag`` pooling (mean, padding to an appended zero row)."""

    name = "torchfunc_bag"

    def prepare(self, batch: Any) -> Any:
        p = super().prepare(batch)
        k = p["k"]
        for half in (p["sup"], p["qry"]):  # padding (weight 0) -> slot k, the zero row; [T, S, C_g, M_g]
            half["pos"] = [torch.where(w > 0, pos, k) for pos, w in zip(half["pos"], half.pop("w"))]
        return p

    def _pool(self, rows: Tensor, half: dict[str, Any]) -> list[Tensor]:
        padded = torch.cat([rows, rows.new_zeros(1, rows.shape[1])])
        pad = rows.shape[0]
        return [F.embedding_bag(pos.reshape(-1, pos.shape[-1]), padded, mode="mean", padding_idx=pad)
                .reshape(pos.shape[0], -1) for pos in half["pos"]]
# -- profile -------------------------------------------------------------------------------------
BUCKETS = {
    "ps/": "ps (store path)",
    "models/": "models (compute)",
    "workers/": "workers (loop)",
    "meta_io/": "meta_io (reader)",
}
BACKWARD = "torch autograd backward"
OTHER = "other"


def attribute(stats: pstats.Stats) -> dict[Any, dict[str, float]]:
    """Function -> bucket -> seconds of its own time (see :func:`profile_buckets`)."""
    raw: dict[Any, Any] = stats.stats  # type: ignore[attr-defined]
    root = str(REPO) + os.sep

    def own_bucket(func: Any) -> str | None:
        path = str(func[0])
        if path.startswith(root) and "site-packages" not in path:  # the venv may live in the repository
            rel = path[len(root):]
            for prefix, name in BUCKETS.items():
                if rel.startswith(prefix):
                    return name
            return OTHER
        return None

    # A library function's time belongs to its callers, split by the time of each call edge (by call
    # counts where no time was recorded): d(f) = sum_c w(f, c) d(c), repository functions absorbing.
    # Recursion (nn.Module.__call__ -> forward -> __call__) makes this a linear system: iterate it.
    fixed = {f: own_bucket(f) for f in raw}
    edges: dict[Any, list[tuple[Any, float]]] = {}
    for f, entry in raw.items():
        if fixed[f] is not None:
            continue
        callers = entry[4]
        total = sum(e[2] for e in callers.values())
        counts = sum(e[1] for e in callers.values())
        edges[f] = [(c, e[2] / total if total > 0 else e[1] / counts) for c, e in callers.items()
                    if (total > 0 and e[2] > 0) or (total <= 0 and counts > 0)]
    dist: dict[Any, dict[str, float]] = {f: {} for f in edges}
    for _ in range(200):
        moved = 0.0
        new: dict[Any, dict[str, float]] = {}
        for f, es in edges.items():
            d: dict[str, float] = {}
            for c, w in es:
                b = fixed.get(c)
                src = {b: 1.0} if b is not None else dist.get(c, {OTHER: 1.0})
                for k, v in src.items():
                    d[k] = d.get(k, 0.0) + w * v
            moved += sum(abs(d.get(k, 0.0) - dist[f].get(k, 0.0)) for k in set(d) | set(dist[f]))
            new[f] = d
        dist = new
        if moved < 1e-9:
            break

    def owner(func: Any) -> dict[str, float]:
        b = fixed.get(func)
        if b is not None:
            return {b: 1.0}
        d = dict(dist.get(func, {}))
        rest = 1.0 - sum(d.values())  # a root, or mass left circling a closed recursion
        if rest > 1e-9:
            d[OTHER] = d.get(OTHER, 0.0) + rest
        return d

    per_func: dict[Any, dict[str, float]] = {}
    for func, (_cc, _nc, tt, _ct, _callers) in raw.items():
        if tt <= 0:
            continue
        backward = "run_backward" in str(func[2])
        got: dict[str, float] = {}
        for k, v in owner(func).items():
            if backward and k != BUCKETS["ps/"]:
                k = BACKWARD
            got[k] = got.get(k, 0.0) + tt * v
        per_func[func] = got
    return per_func


def profile_buckets(stats: pstats.Stats) -> dict[str, float]:
    """Seconds of own time per bucket; library time goes to the repository caller's bucket (see module doc)."""
    buckets: dict[str, float] = {name: 0.0 for name in list(BUCKETS.values()) + [BACKWARD, OTHER]}
    for got in attribute(stats).values():
        for k, v in got.items():
            buckets[k] += v
    return buckets


def top_in(stats: pstats.Stats, bucket: str, n: int = 5) -> list[tuple[str, float]]:
    """The ``n`` functions with the most own seconds in ``bucket``: ``(file:line(name), seconds)``."""
    got = [(f"{Path(str(f[0])).name}:{f[1]}({f[2]})", v.get(bucket, 0.0)) for f, v in attribute(stats).items()]
    return sorted(got, key=lambda kv: -kv[1])[:n]


def _phase_ms(arm: MetapsArm, seconds: float, steps: int) -> dict[str, float]:
    """Mean ms per step: StepStats phases, the worker's data wait, and the rest of the window's wall clock."""
    if not arm.stats:
        return {}
    out = {k: 1000 * statistics.fmean(getattr(s, k + "_s") for s in arm.stats)
           for k in ("pull", "compute", "push", "total")}
    out["data_wait"] = 1000 * statistics.fmean(arm.waits) if arm.waits else 0.0
    out["wall"] = 1000 * seconds / max(steps, 1)
    out["loop"] = max(0.0, out["wall"] - out["total"] - out["data_wait"])
    return out


# -- fleet: CPU per trained batch over every process ------------------------------------------------
FLEET_CONFIGS: dict[str, tuple[int, int]] = {"train-local": (0, 1), "1x1": (1, 1), "2x2": (2, 2), "2x1": (2, 1),
                                             "4x1": (4, 1)}
"""name -> (PS shards, workers); 0 shards: ``metaps train-local`` (one process, the baseline)."""
ROLES = ("launch", "controller", "agent", "ps", "worker", "train-local", "other")
_VALUE_OPTS = {"--log-level"}  # metaps's global options that take a value (before the subcommand)


def process_role(pid: int) -> str:
    """The metaps subcommand a process runs (``ps``, ``worker``, ``agent``, ...), else ``other``."""
    try:
        argv = Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace").split("\0")
    except OSError:
        return "other"
    for i in range(len(argv) - 1):
        if argv[i] == "-m" and argv[i + 1] == "metaps":
            rest = argv[i + 2:]
            j = 0
            while j < len(rest) and rest[j].startswith("-"):
                j += 2 if rest[j] in _VALUE_OPTS else 1
            sub = rest[j] if j < len(rest) else ""
            return sub if sub in ROLES else "other"
    return "other"


class TreeSampler(threading.Thread):
    """Samples a process tree's CPU time every ``period`` s; :meth:`by_role` gives ``[(time.time(), {role: s})]``.

    The tree's process list is walked again every ``rescan`` samples (its shape is still
    in the steady state the figures are taken from), and every process's role read again
    (a child forked but not yet exec'd still shows its parent's command line): a
    process's CPU goes to the role it last had; ``bench.procstat`` says how a tree's
    CPU is summed.
    """

    def __init__(self, root: int, period: float = 0.05, rescan: int = 10) -> None:
        super().__init__(daemon=True)
        self.root, self.period, self.rescan = root, period, rescan
        self.samples: list[tuple[float, dict[int, float]]] = []  # (time.time(), {pid: CPU s})
        self.roles: dict[int, str] = {}
        self._halt = threading.Event()

    def run(self) -> None:
        pids: list[int] = []
        n = 0
        while not self._halt.is_set():
            if n % self.rescan == 0:
                pids = process_tree(self.root)
                for pid in pids:
                    role = process_role(pid)
                    if role != "other" or pid not in self.roles:  # keep what it ran once it is gone
                        self.roles[pid] = role
            n += 1
            got: dict[int, float] = {}
            for pid in pids:
                try:
                    got[pid] = stat_cpu_s(f"/proc/{pid}/stat", reaped_children=True)
                except (OSError, ValueError, IndexError):
                    continue
            if got:
                self.samples.append((time.time(), got))
            self._halt.wait(self.period)

    def stop(self) -> None:
        self._halt.set()
        self.join()

    def by_role(self) -> list[tuple[float, dict[str, float]]]:
        """The samples with each process's CPU summed into its (last) role."""
        out = []
        for t, got in self.samples:
            roles: dict[str, float] = {}
            for pid, cpu in got.items():
                role = self.roles.get(pid, "other")
                roles[role] = roles.get(role, 0.0) + cpu
            out.append((t, roles))
        return out


def _interp(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear ``y(x)`` through sorted ``xs`` (clamped at the ends)."""
    i = bisect.bisect_left(xs, x)
    if i <= 0:
        return ys[0]
    if i >= len(xs):
        return ys[-1]
    x0, x1 = xs[i - 1], xs[i]
    return ys[i - 1] + (ys[i] - ys[i - 1]) * ((x - x0) / (x1 - x0) if x1 > x0 else 1.0)


def steady(reports: list[dict[str, Any]], samples: list[tuple[float, dict[str, float]]]) -> dict[str, Any]:
    """CPU per trained batch and samples/s over the window in which every worker trains.

    The window runs from the latest first history record of the workers to the earliest
    last one (``[train] log_every`` steps apart; step 1's one-time costs are before it,
    evaluation, checkpoints and shutdown after it). Batches: each worker's step count
    interpolated at the window's ends; CPU: the tree samples interpolated at the same times.
    """
    hists = [r["history"] for r in reports]
    if any(len(h) < 2 for h in hists):
        raise RuntimeError("too few worker history records for a steady window: use more rows")
    t_a, t_b = max(h[0]["time"] for h in hists), min(h[-1]["time"] for h in hists)
    if t_b <= t_a or len(samples) < 2:
        raise RuntimeError(f"no steady window (workers' records {t_a:.2f}..{t_b:.2f}, {len(samples)} CPU samples)")
    batches = rows = 0.0
    for h in hists:
        ts = [r["time"] for r in h]
        batches += _interp(ts, [r["step"] for r in h], t_b) - _interp(ts, [r["step"] for r in h], t_a)
        rows += _interp(ts, [r["samples"] for r in h], t_b) - _interp(ts, [r["samples"] for r in h], t_a)
    st = [s[0] for s in samples]
    roles = sorted({k for _, got in samples for k in got})
    cpu = {k: _interp(st, [got.get(k, 0.0) for _, got in samples], t_b)
           - _interp(st, [got.get(k, 0.0) for _, got in samples], t_a) for k in roles}
    total = sum(cpu.values())
    span = t_b - t_a
    return {"batches": batches, "window_s": span, "samples_per_s": rows / span, "cores_busy": total / span,
            "cpu_per_batch_ms": 1000 * total / max(batches, 1e-9),
            "by_role_ms": {k: 1000 * v / max(batches, 1e-9) for k, v in cpu.items()}}


def run_config(tmp: Path, data: Path, name: str, idx: int) -> dict[str, Any]:
    """One fresh run of a :data:`FLEET_CONFIGS` configuration, one epoch of ``data``, its CPU sampled.

    ``metaps train-local`` (``bench.train_throughput``'s job, overlap off) or ``metaps launch``
    (the same job with ``[ps] shards``, ``[train] workers`` and overlap ``auto``): the
    launcher, controller, agents, PS shards and workers all in the sampled tree.
    """
    shards, workers = FLEET_CONFIGS[name]
    d = tmp / f"{name}-{idx}"
    d.mkdir()
    if shards == 0:
        config = write_job(d / "job.toml", data, d / "runs", mode="plain", shards=1, workers=1, overlap=False,
                           epochs=1)
        argv = ["train-local", "--config", str(config), "--json"]
    else:
        config = write_job(d / "job.toml", data, d / "runs", mode="plain", shards=shards, workers=workers,
                           overlap="auto", epochs=1)
        argv = ["launch", "--config", str(config), "--no-progress", "--run-dir", str(d / "run"), "--json"]
    log = d / "stderr.log"
    ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    with log.open("w") as err:
        proc = subprocess.Popen([sys.executable, "-m", "metaps", *argv], cwd=REPO, env=_env(),
                                stdout=subprocess.PIPE, stderr=err, text=True)
        sampler = TreeSampler(proc.pid)
        sampler.start()
        try:
            out, _ = proc.communicate(timeout=1800)
        finally:
            sampler.stop()
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    wall = time.perf_counter() - t0
    ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    if proc.returncode != 0:
        raise RuntimeError(f"{name} failed (rc {proc.returncode}); its stderr ends:\n"
                           + log.read_text(errors="replace")[-3000:])
    run_dir = Path(json.loads(out.strip().splitlines()[-1])["run_dir"])
    reps = [json.loads((run_dir / "workers" / f"worker-{r}.json").read_text()) for r in range(workers)]
    got = steady(reps, sampler.by_role())
    got["run_wall_s"] = wall
    got["run_cpu_s"] = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
    got["run_batches"] = sum(int(r["steps"]) for r in reps)
    return got
# -- the run ---------------------------------------------------------------------------------------
def _summary(vals: list[float]) -> dict[str, float]:
    return {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}


def _round(x: Any) -> Any:
    if isinstance(x, float):
        return round(x, 4)
    if isinstance(x, dict):
        return {k: _round(v) for k, v in x.items()}
    if isinstance(x, list):
        return [_round(v) for v in x]
    return x


RATIOS = {"local_vs_torch": ("metaps_plain", "torch"),
          "local_vs_torch_rowwise": ("metaps_plain", "torch_rowwise"),
          "local_vs_torchrec": ("metaps_plain", "torchrec"),
          "local_vs_floor": ("metaps_plain", "floor"),
          "meta_vs_torchfunc": ("metaps_meta", "torchfunc"),
          "meta_vs_torchfunc_bag": ("metaps_meta", "torchfunc_bag")}
"""JSON key -> (metaps arm, reference arm): ratios of median samples/s and of median samples per CPU-second."""

FLEET_KEYS = {"1x1": "dist_1x1", "2x2": "dist_2x2", "2x1": "dist_2ps", "4x1": "dist_4ps"}
"""configuration -> JSON key prefix: ``<prefix>_cpu_efficiency`` and ``<prefix>_vs_local``."""


def _in_process(args: argparse.Namespace, size: str, rows: int, tmp: Path, out: dict[str, Any]) -> Path:
    """The in-process arms, interleaved rounds, ratios, profile; returns the plain data set."""
    pairs = args.pairs or {"smoke": 2, "quick": 6, "full": 15}[size]
    win = args.window or {"smoke": 2, "quick": 10, "full": 30}[size]
    mwin = args.meta_window or {"smoke": 1, "quick": 3, "full": 8}[size]
    warm, mwarm = (1, 1) if args.smoke else (3, 2)
    out.update({"pairs": pairs, "window": {"plain": win, "meta": mwin}})
    _progress(f"[0/4] generating {rows:,} rows; plain and meta Meta-IO sets")
    plain = make_data(tmp / "plain", rows, "plain")
    meta = make_data(tmp / "meta", rows, "meta")
    jp = write_job(tmp / "plain-w.toml", plain, tmp / "run-plain", mode="plain", shards=1, workers=1, overlap=False,
                   epochs=1)
    jm = write_job(tmp / "meta-w.toml", meta, tmp / "run-meta", mode="meta", shards=1, workers=1, overlap=False,
                   epochs=1)
    jp, jm = _default_logging(jp, tmp / "plain.toml"), _default_logging(jm, tmp / "meta.toml")

    _progress("[1/4] setting up the arms")
    cap = 20_000 if args.smoke else 0
    mp = MetapsArm("metaps_plain", jp, tmp / "run-plain", "plain", cap)
    mm = MetapsArm("metaps_meta", jm, tmp / "run-meta", "meta", cap)
    mp.setup()
    mm.setup()
    out["metaps_logging"] = {"log_every": mp.job.train.log_every, "tb_every_steps": mp.job.train.tb_every_steps}
    plain_arms: list[Arm] = [mp, TorchArm("torch", mp.job, plain, rowwise=False),
                             TorchArm("torch_rowwise", mp.job, plain, rowwise=True), FloorArm(mp.job, plain)]
    meta_arms: list[Arm] = [mm, TorchFuncArm(mm.job, meta), TorchFuncBagArm(mm.job, meta)]
    for arm in plain_arms[1:] + meta_arms[1:]:
        arm.setup()
    why_not = TorchRecArm.available()
    if why_not is None:
        trec = TorchRecArm(mp.job, plain)
        try:
            trec.setup()
            plain_arms.append(trec)
        except Exception as e:  # fbgemm's CPU ops missing (the CUDA build installed), an API change...
            why_not = f"set-up failed: {type(e).__name__}: {str(e)[:160]}"
    out["torchrec"] = "measured" if why_not is None else f"not measured: {why_not}"
    if why_not is not None:
        _progress(f"      torchrec: {why_not} (see docs/peers.md)")
    from meta_io.reader import MetaIODataset

    pw, mw = Windows(MetaIODataset(plain)), Windows(MetaIODataset(meta))
    out["batches"] = {"plain": len(pw.pos), "meta": len(mw.pos)}
    w0, m0 = pw.take(warm), mw.take(mwarm)
    mp.record = mm.record = False  # warm-up steps stay out of the phase figures
    for arm in plain_arms + meta_arms:
        arm.run(w0 if arm.mode == "plain" else m0)  # warm-up, untimed
    mp.record = mm.record = True

    _progress(f"[2/4] {pairs} rounds: plain windows of {win} batches, meta windows of {mwin} batches")
    arms = plain_arms + meta_arms
    res: dict[str, list[WindowResult]] = {a.name: [] for a in arms}
    for i in range(pairs):
        wp, wm = pw.take(win), mw.take(mwin)
        order = arms if i % 2 == 0 else arms[::-1]
        for arm in order:
            res[arm.name].append(arm.run(wp if arm.mode == "plain" else wm))
        line = "  ".join(f"{a.name} {res[a.name][-1].samples / res[a.name][-1].cpu_s:,.0f}" for a in arms)
        _progress(f"      round {i + 1}/{pairs} samples per CPU-s: {line}")

    rate = {a: [r.samples / r.seconds for r in rs] for a, rs in res.items()}
    cpu_rate = {a: [r.samples / max(r.cpu_s, 1e-9) for r in rs] for a, rs in res.items()}
    out["samples_per_s"] = {a: _summary(v) for a, v in rate.items()}
    out["samples_per_cpu_s"] = {a: _summary(v) for a, v in cpu_rate.items()}
    out["steps_per_s"] = {a: statistics.median(r.steps / r.seconds for r in rs) for a, rs in res.items()}
    out["cpu_ms_per_batch"] = {a: statistics.median(1000 * r.cpu_s / max(r.steps, 1) for r in rs)
                               for a, rs in res.items()}
    out["cpu_per_wall"] = {a: statistics.median(r.cpu_s / r.seconds for r in rs) for a, rs in res.items()}
    out["loss"] = {a: {"first": statistics.fmean(rs[0].losses), "last": statistics.fmean(rs[-1].losses)}
                   for a, rs in res.items()}
    out["paired"] = {}
    for key, (a, b) in RATIOS.items():
        if a in rate and b in rate:
            for suffix, by in (("", rate), ("_per_cpu", cpu_rate)):
                out[key + suffix] = statistics.median(by[a]) / statistics.median(by[b])
                per = [x / y for x, y in zip(by[a], by[b])]
                out["paired"][key + suffix] = {"min": min(per), "max": max(per)}
            _progress(f"      {key}: per CPU-s {out[key + '_per_cpu']:.3f}  wall {out[key]:.3f}")
        else:
            out[key] = out[key + "_per_cpu"] = None
            out[key + "_reason"] = f"{b} not measured: {why_not}" if b == "torchrec" else f"{b} not measured"
    _progress("      cores busy (process CPU / wall, median): "
              + "  ".join(f"{a} {v:.2f}" for a, v in out["cpu_per_wall"].items()))

    _progress("[3/4] profile of metaps's plain step")
    secs = sum(r.seconds for r in res["metaps_plain"])
    steps = sum(r.steps for r in res["metaps_plain"])
    msecs = sum(r.seconds for r in res["metaps_meta"])
    msteps = sum(r.steps for r in res["metaps_meta"])
    profile: dict[str, Any] = {"phases_ms": {"metaps_plain": _phase_ms(mp, secs, steps),
                                             "metaps_meta": _phase_ms(mm, msecs, msteps)}}
    mp.record = False
    prof = cProfile.Profile()
    wprof = pw.take(win)
    prof.enable()
    r = mp.run(wprof)
    prof.disable()
    buckets = profile_buckets(pstats.Stats(prof))
    total = sum(buckets.values())
    profile["cprofile"] = {"steps": r.steps, "wall_s": r.seconds, "profiled_s": total,
                           "ms_per_step": {k: 1000 * v / max(r.steps, 1) for k, v in buckets.items()},
                           "share": {k: v / total if total > 0 else 0.0 for k, v in buckets.items()}}
    ph = profile["phases_ms"]
    _progress("      mean ms/step   " + "".join(f"{k:>10}" for k in ph["metaps_plain"]))
    for arm_name, p in ph.items():
        _progress(f"      {arm_name:<14} " + "".join(f"{v:10.2f}" for v in p.values()))
    _progress(f"      cProfile of {r.steps} steps ({r.seconds:.2f} s wall under the profiler):")
    for k, v in sorted(buckets.items(), key=lambda kv: -kv[1]):
        _progress(f"        {k:<26} {1000 * v / max(r.steps, 1):7.2f} ms/step  {100 * v / max(total, 1e-9):5.1f}%")
    out["profile"] = profile
    return plain


def _fleet(args: argparse.Namespace, size: str, tmp: Path, data: Path, rows: int, out: dict[str, Any]) -> None:
    """The fleet configurations in interleaved pairs; efficiencies, wall ratios, PS CPU per batch."""
    fleet_rows = {"smoke": 6_000, "quick": min(rows, 20_000), "full": rows}[size]  # smoke: >= 2 records a worker
    fpairs = args.fleet_pairs or {"smoke": 1, "quick": 2, "full": 5}[size]
    if fleet_rows != rows:
        data = make_data(tmp / "fleet", fleet_rows, "plain")
    names = list(FLEET_CONFIGS)
    _progress(f"[4/4] fleet, plain mode, {fleet_rows:,} rows, 1 epoch: {', '.join(names)}; {fpairs} interleaved "
              "pairs (fresh processes each, one at a time)")
    runs: dict[str, list[dict[str, Any]]] = {n: [] for n in names}
    for i in range(fpairs):
        for name in (names if i % 2 == 0 else names[::-1]):
            got = run_config(tmp, data, name, i)
            runs[name].append(got)
            _progress(f"      pair {i + 1}/{fpairs} {name:<11} CPU {got['cpu_per_batch_ms']:6.1f} ms/batch  "
                      f"{got['samples_per_s']:7,.0f} samples/s  (cores busy {got['cores_busy']:.2f}; "
                      f"run {got['run_wall_s']:.0f} s wall, {got['run_cpu_s']:.0f} CPU-s)")
    local = runs["train-local"]
    configs: dict[str, Any] = {}
    for name, rs in runs.items():
        roles = sorted({k for r in rs for k in r["by_role_ms"]})
        configs[name] = {
            "cpu_per_batch_ms": _summary([r["cpu_per_batch_ms"] for r in rs]),
            "samples_per_s": _summary([r["samples_per_s"] for r in rs]),
            "by_role_ms": {k: statistics.median(r["by_role_ms"].get(k, 0.0) for r in rs) for k in roles},
            "cores_busy": statistics.median(r["cores_busy"] for r in rs),
            "steady_batches": statistics.median(r["batches"] for r in rs),
            "run_wall_s": [r["run_wall_s"] for r in rs], "run_cpu_s": [r["run_cpu_s"] for r in rs],
            "run_batches": rs[0]["run_batches"],
        }
    out["fleet"] = {"rows": fleet_rows, "pairs": fpairs, "configs": configs}
    out["paired"] = out.get("paired", {})
    for name, prefix in FLEET_KEYS.items():
        eff = [lo["cpu_per_batch_ms"] / r["cpu_per_batch_ms"] for lo, r in zip(local, runs[name])]
        wall = [r["samples_per_s"] / lo["samples_per_s"] for lo, r in zip(local, runs[name])]
        out[f"{prefix}_cpu_efficiency"] = statistics.median(eff)
        out[f"{prefix}_vs_local"] = statistics.median(wall)
        out["paired"][f"{prefix}_cpu_efficiency"] = {"min": min(eff), "max": max(eff)}
        out["paired"][f"{prefix}_vs_local"] = {"min": min(wall), "max": max(wall)}
        _progress(f"      {name}: CPU efficiency {out[f'{prefix}_cpu_efficiency']:.3f} "
                  f"(pairs {min(eff):.3f}-{max(eff):.3f}); wall {out[f'{prefix}_vs_local']:.3f}")
    out["ps_cpu_per_batch_ms"] = {str(FLEET_CONFIGS[n][0]): statistics.median(r["by_role_ms"].get("ps", 0.0)
                                                                               for r in runs[n])
                                  for n in ("1x1", "2x1", "4x1")}
    _progress("      PS CPU per batch (1 worker): " + "  ".join(f"{k} shard(s) {v:.2f} ms"
                                                             for k, v in out["ps_cpu_per_batch_ms"].items()))


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="6 rounds of small windows; fleet: 2 pairs on 20k rows")
    ap.add_argument("--smoke", action="store_true", help="2 rounds of tiny windows on tiny data; fleet once")
    ap.add_argument("--rows", type=int, default=0, help="generated rows (default 130k; quick 40k; smoke 2k)")
    ap.add_argument("--pairs", type=int, default=0, help="in-process rounds (default 15; quick 6; smoke 2)")
    ap.add_argument("--window", type=int, default=0, help="plain batches per window (default 30; quick 10)")
    ap.add_argument("--meta-window", type=int, default=0, help="meta batches per window (default 8; quick 3)")
    ap.add_argument("--fleet-pairs", type=int, default=0, help="fleet pairs (default 5; quick 2; smoke 1)")
    ap.add_argument("--no-fleet", action="store_true", help="skip the fleet (separate processes) part")
    args = ap.parse_args(argv)
    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    rows = args.rows or {"smoke": 2_000, "quick": 40_000, "full": 130_000}[size]
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Sparse invariant checks")  # torch.optim.Adagrad's sparse path
    # F.embedding_bag has no vmap batching rule: torchfunc_bag runs torch's per-task fallback (its figure says so)
    warnings.filterwarnings("ignore", message="There is a performance drop because we have not yet implemented")
    t_all = time.perf_counter()
    out: dict[str, Any] = {"smoke": args.smoke, "quick": args.quick, "rows": rows, "cores": os.cpu_count(),
                           "load": {"before": os.getloadavg()[0]}}
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as td:
        tmp = Path(td)
        plain = _in_process(args, size, rows, tmp, out)
        if args.no_fleet:
            _progress("[4/4] fleet skipped (--no-fleet)")
        else:
            _fleet(args, size, tmp, plain, rows, out)
    out["load"]["after"] = os.getloadavg()[0]
    out["elapsed_s"] = time.perf_counter() - t_all
    print(json.dumps(_round(out)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
