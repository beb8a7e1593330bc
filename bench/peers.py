"""metaps's training step against what a user would run instead: same model, data and batches, one run.

Run::

    python -m bench.peers [--quick] [--smoke] [--rows N] [--pairs N] [--window N] [--meta-window N]

Data and model are those of ``bench.train_throughput`` (its ``make_data`` and
``write_job``, imported): generated AntM2C-like rows built as a plain Meta-IO set
(256 rows a batch) and as a meta set (support 8, query 4, 768 rows a batch = 64
tasks); the ``dnn`` model (29 tables of dim 16, hidden [128, 64], heads click and
conversion with target click * conversion); one torch thread everywhere
(``torch.set_num_threads(1)``; ``OMP_NUM_THREADS=1`` before torch is imported when
run as a script).

In-process arms (one object each: ``setup()``, then ``run(window)`` -> wall and CPU
seconds, steps, real rows and losses of the window; a warm-up is an untimed ``run``):

* ``metaps_plain``: ``metaps train-local``'s own loop, in this process: a
  ``workers.worker.Worker`` over a ``LocalRowSource(local_store(job))`` with no
  controller, and per window exactly the inner loop of ``Worker.train``:
  ``for stats in w.trainer.run(prefetch(w.dataset.read_range(f, a, b), depth=2)):
  w._after_step(stats)`` (through ``w.read(f, a, b)`` instead where the Worker has that
  method, as ``Worker.train`` then does: the same batches, prepared for the step on the
  prefetch thread). Job = ``write_job(..., overlap=False)`` as
  ``bench.train_throughput``'s train-local baseline, loaded with two overrides:
  ``[train] log_every = 1000`` and ``tb_every_steps = 0`` (no progress lines, no
  live TensorBoard scalars or report snapshots inside the timed windows); all else
  is train-local's default (rowwise Adagrad lr 0.05 on the rows in fbgemm TBE,
  Adam lr 1e-3 on the dense parameters in the store's DenseStore).
* ``metaps_meta``: the same on the meta set with ``[train] mode = "meta"`` and
  ``[meta] inner_steps = 1, first_order = true, adapt = "both"`` (inner lr: the
  default ``[meta] inner_lr``).
* ``torch``: a plain PyTorch loop written here: one
  ``nn.EmbeddingBag(N + 1, 16, mode="mean", sparse=True, padding_idx=N)`` per table
  (N = the job's table capacity, ids mapped ``where(ids < 0, N, ids % N)``, rows
  initialised N(0, 0.01) like the PS's default), the same dense network as
  ``models/dnn.py`` (flat = cat(pooled rows per id column in the model's table
  order, Linear(vector_dim -> 16) per vector column, sign(x) * log1p(|x|) of the
  dense columns); wide Linear(in, 2) + MLP [128, 64] -> Linear(64, 2)), loss = the
  sum of the two heads' mean BCE-with-logits over real rows,
  ``torch.optim.Adagrad(rows, lr=0.05)`` (sparse gradients) and
  ``torch.optim.Adam(dense, lr=1e-3)``. It reads and decodes every batch itself
  in its step thread (``MetaIODataset(...).read_range``, no prefetch): what a user
  would write.
* ``torch_rowwise``: the same loop with a hand-written rowwise Adagrad on the
  embedding weights (metaps's default optimizer): per touched row of the coalesced
  sparse gradient ``m += mean(g^2)``, ``w -= 0.05 * g / (sqrt(m) + 1e-8)``.
* ``torchrec`` (only where ``import torchrec`` works; not in this project's venv):
  a ``FusedEmbeddingBagCollection`` of the 29 tables (``RowWiseAdagrad``, i.e.
  fbgemm's EXACT_ROWWISE_ADAGRAD, lr 0.05, updated inside the backward), one
  ``KeyedJaggedTensor`` per batch (padding ids dropped), the same dense net and
  Adam. See docs/peers.md for a venv where it runs.
* ``torchfunc``: a torch.func MAML reference written here, on the meta set: per
  meta batch the unique rows of each table (``batch.unique_ids``) are gathered from
  plain per-table weight tensors (``index_select``) into one ``[U, 16]`` tensor,
  each task's ids re-indexed onto its own rows (a per-task sort, vectorized),
  then ``vmap`` over the 64 tasks of: ``torch.func.grad`` of the support loss
  w.r.t. (dense params, task rows), one inner SGD step at the job's ``inner_lr``
  (first order: inner grads detached), the query loss; the outer gradient
  (``torch.func.grad_and_value`` of the mean query loss over real tasks, w.r.t.
  the dense params and the gathered rows) is applied with Adam (dense, lr 1e-3)
  and a rowwise Adagrad (rows, lr 0.05, ``index_add_`` into the tables). The dense
  part is this file's ``DenseNet`` (the same net as the ``dnn`` model, written
  again, called with ``torch.func.functional_call``); id columns are pooled per
  id-list width group (3 gathers: sparse, multi-hot, text) rather than per column,
  which permutes the flat input's columns (same network up to that order). Padded
  rows (``mask``) and padded or query-less tasks (``task_mask``) are masked as in
  ``models/meta.py``.

How it is measured: every arm first trains untimed on a few warm-up batches.
Then ``--pairs`` rounds; in round ``i`` every arm trains on the same window ``i``
of W batches (W = ``--window`` plain batches, ``--meta-window`` meta batches;
windows walk through the data set, wrapping around), one arm after the other,
the order reversed every other round (metaps first in even rounds, last in odd
ones). A window's rate is its real rows (``mask``) over its wall clock (reading
included: prefetch for metaps, in the step thread for the torch loops). Per arm:
the median, min and max of the window rates; the ratios are ratios of medians
(``paired``: the min and max of the per-round ratio). ``cpu_per_wall`` is the
process's CPU time over the window's wall clock: how many cores an arm kept busy
(metaps's prefetch thread can use the second core; the torch loops read in their
one thread).

Fleet (separate processes, after the in-process rounds, not interleaved):
``bench.train_throughput``'s ``run_local`` (``metaps train-local``) and
``run_fleet`` for 1 PS + 1 worker and 2 PS + 2 workers (overlap on, async PS),
plain mode, one epoch of the plain set (a smaller set of the same generator in
``--quick``/``--smoke``: ``fleet_rows``); steady-state samples/s from the worker
reports, as that bench measures them.

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

Flags: ``--quick`` about a minute and a half (40k rows, 8 pairs of 10 plain / 3
meta batches; fleet on 10k rows); ``--smoke`` seconds of in-process work (2 pairs
of 2 / 1-batch windows on 2,000 rows, tables of 20k rows instead of 200k for a
fast set-up), then train-local, 1x1 and 2x2 once each on the same rows, all three
at once (figures meaningless: it checks that everything runs; 30-40 s in all, the
fleet's process start-ups); default about three minutes (130k rows, so that no
window wraps around to ids the tables already hold; 15 pairs of 30 / 8 batches).
``--rows``, ``--pairs``, ``--window``, ``--meta-window`` override the sizes;
``--no-fleet`` skips the fleet.

The last line printed is one JSON object: ``local_vs_torch`` (metaps_plain /
torch, ratio of median samples/s; < 1: metaps is slower), ``local_vs_torch_rowwise``,
``local_vs_torchrec`` (only when measured; ``torchrec`` says why not),
``meta_vs_torchfunc``, ``dist_1x1_vs_local``, ``dist_2x2_vs_local`` (fleet /
train-local), ``samples_per_s`` (per arm: median, min, max), ``steps_per_s``
(medians), ``cpu_per_wall`` (medians), ``paired`` (per ratio: min and max over
rounds), ``loss`` (per arm: mean loss of the first and last window, a check that
every arm trains), ``fleet``,
``profile`` (``phases_ms`` per metaps arm; ``cprofile``: ``ms_per_step`` and
``share`` per bucket), ``pairs``, ``window``, ``rows``, ``batches``, ``load`` (1-min
load average before/after), ``elapsed_s``, ``smoke``, ``quick``.
"""

from __future__ import annotations

import os
import sys

if __name__ == "__main__":  # before torch is imported anywhere
    os.environ["OMP_NUM_THREADS"] = "1"

import argparse
import cProfile
import json
import pstats
import statistics
import tempfile
import time
import warnings
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from bench.train_throughput import make_data, run_fleet, run_local, write_job

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


class _ReadsInStep(Arm):
    """The torch loops: each batch read and decoded in the step thread (``self.ds``), then ``step``."""

    ds: Any

    def step(self, batch: Any) -> tuple[float, int]:
        raise NotImplementedError

    def steps(self, window: Window) -> Iterator[tuple[float, int]]:
        for f, a, b in window:
            for batch in self.ds.read_range(f, a, b):
                yield self.step(batch)


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

        overrides: dict[str, dict[str, Any]] = {"train": {"log_every": 1000, "tb_every_steps": 0}}
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


class TorchArm(_ReadsInStep):
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

    def step(self, batch: Any) -> tuple[float, int]:
        sp, n = self.spec, self.spec.capacity
        f = batch.features
        pooled = []
        for c, emb in zip(sp.cols, self.bags):
            ids = f.ids[c.name]
            pooled.append(emb(torch.where(ids < 0, n, ids % n)))
        z = self.net(torch.cat(pooled, dim=-1), [f.vectors[v] for v in sp.vec_cols], f.dense)
        mask = f.mask
        loss = sum((masked_bce(z[:, h], y, mask) for h, y in enumerate(head_targets(f.labels, sp.labels))),
                   torch.zeros(()))
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

    def step(self, batch: Any) -> tuple[float, int]:
        from torchrec.sparse.jagged_tensor import KeyedJaggedTensor

        sp, n = self.spec, self.spec.capacity
        f = batch.features
        values, lengths = [], []
        for c in sp.cols:
            ids = f.ids[c.name]
            valid = ids >= 0
            values.append(ids[valid] % n)
            lengths.append(valid.sum(-1))
        kjt = KeyedJaggedTensor(keys=[c.name for c in sp.cols], values=torch.cat(values), lengths=torch.cat(lengths))
        pooled = self.ebc(kjt).values()
        z = self.net(pooled, [f.vectors[v] for v in sp.vec_cols], f.dense)
        mask = f.mask
        loss = sum((masked_bce(z[:, h], y, mask) for h, y in enumerate(head_targets(f.labels, sp.labels))),
                   torch.zeros(()))
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


class TorchFuncArm(_ReadsInStep):
    """torch.func MAML (first order, adapt both, one inner step) on the meta set; see the module docstring."""

    mode = "meta"

    def __init__(self, job: Any, data: Path) -> None:
        self.name, self.job, self.data = "torchfunc", job, data

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
    def _half_loss(self, params: dict[str, Tensor], rows: Tensor, half: dict[str, Any]) -> Tensor:
        """One task's loss on one half: rows ``[K, D]`` (the task's own), positions into them."""
        pooled = [(rows[pos] * w.unsqueeze(-1)).sum(-2).flatten(-2) for pos, w in zip(half["pos"], half["w"])]
        z = torch.func.functional_call(self.net, params, (torch.cat(pooled, -1), half["vec"], half["dense"]))
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

    # the eager part: gather, re-index, optimizers ------------------------------------------------
    def step(self, batch: Any) -> tuple[float, int]:
        sp, n = self.spec, self.spec.capacity
        uniq = [batch.unique_ids[t] for t in sp.tables]
        slots = [u % n for u in uniq]
        sizes = [int(u.numel()) for u in uniq]
        base = dict(zip(sp.tables, torch.tensor([0] + sizes[:-1]).cumsum(0).tolist()))
        u_all = sum(sizes)
        rows = torch.cat([self.weights[t].index_select(0, s) for t, s in zip(sp.tables, slots)])
        uniq_of = dict(zip(sp.tables, uniq))
        sup, qry = batch.support, batch.query
        n_sup = int(sup.mask.shape[1])
        t_count = int(sup.mask.shape[0])
        # global positions (into `rows`) and mean-pooling weights of every id, support and query slots together
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

        s_half, q_half = half(sup, slice(0, n_sup)), half(qry, slice(n_sup, None))
        weights = (batch.task_mask.bool() & qry.mask.any(-1)).to(torch.float32)
        params = {k_: v.detach() for k_, v in self.net.named_parameters()}
        (g_params, g_rows), loss = self._grad(params, rows, l2g, s_half, q_half, weights)
        for name, p in self.net.named_parameters():
            p.grad = g_params[name]
        self.opt.step()
        with torch.no_grad():
            for t, s, g in zip(sp.tables, slots, g_rows.split(sizes)):
                _rowwise_adagrad(self.weights[t], self.acc[t], s, g)
        return float(loss), int(sup.mask.sum()) + int(qry.mask.sum())


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


# -- the run ---------------------------------------------------------------------------------------
def _fleet(tmp: Path, data: Path, name: str, *, shards: int, workers: int) -> dict[str, Any]:
    """``bench.train_throughput.run_fleet`` with the default ``[train] overlap = "auto"``, plain mode, one epoch."""
    return dict(run_fleet(tmp, data, name, mode="plain", shards=shards, workers=workers, overlap="auto", epochs=1))


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


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="about a minute and a half: 8 pairs, small windows")
    ap.add_argument("--smoke", action="store_true", help="2 pairs of tiny windows on tiny data, fleet once (30-50 s)")
    ap.add_argument("--rows", type=int, default=0, help="generated rows (default 130k; quick 40k; smoke 2k)")
    ap.add_argument("--pairs", type=int, default=0, help="rounds (default 15; quick 8; smoke 2)")
    ap.add_argument("--window", type=int, default=0, help="plain batches per window (default 30; quick 10)")
    ap.add_argument("--meta-window", type=int, default=0, help="meta batches per window (default 8; quick 3)")
    ap.add_argument("--no-fleet", action="store_true", help="skip the fleet (separate processes) part")
    args = ap.parse_args(argv)
    size = "smoke" if args.smoke else "quick" if args.quick else "full"
    rows = args.rows or {"smoke": 2_000, "quick": 40_000, "full": 130_000}[size]
    fleet_rows = {"smoke": rows, "quick": min(rows, 10_000), "full": rows}[size]
    pairs = args.pairs or {"smoke": 2, "quick": 8, "full": 15}[size]
    win = args.window or {"smoke": 2, "quick": 10, "full": 30}[size]
    mwin = args.meta_window or {"smoke": 1, "quick": 3, "full": 8}[size]
    warm, mwarm = (1, 1) if args.smoke else (3, 2)
    torch.set_num_threads(1)
    warnings.filterwarnings("ignore", message="Sparse invariant checks")  # torch.optim.Adagrad's sparse path
    t_all = time.perf_counter()
    out: dict[str, Any] = {"smoke": args.smoke, "quick": args.quick, "rows": rows, "pairs": pairs,
                           "window": {"plain": win, "meta": mwin}, "cores": os.cpu_count(),
                           "load": {"before": os.getloadavg()[0]}}
    with tempfile.TemporaryDirectory(prefix="bench-peers-") as td:
        tmp = Path(td)
        _progress(f"[0/4] generating {rows:,} rows; plain and meta Meta-IO sets")
        plain = make_data(tmp / "plain", rows, "plain")
        meta = make_data(tmp / "meta", rows, "meta")
        jp = write_job(tmp / "plain.toml", plain, tmp / "run-plain", mode="plain", shards=1, workers=1, overlap=False,
                       epochs=1)
        jm = write_job(tmp / "meta.toml", meta, tmp / "run-meta", mode="meta", shards=1, workers=1, overlap=False,
                       epochs=1)

        _progress("[1/4] setting up the arms")
        cap = 20_000 if args.smoke else 0
        mp = MetapsArm("metaps_plain", jp, tmp / "run-plain", "plain", cap)
        mm = MetapsArm("metaps_meta", jm, tmp / "run-meta", "meta", cap)
        mp.setup()
        mm.setup()
        plain_arms: list[Arm] = [mp, TorchArm("torch", mp.job, plain, rowwise=False),
                                 TorchArm("torch_rowwise", mp.job, plain, rowwise=True)]
        meta_arms: list[Arm] = [mm, TorchFuncArm(mm.job, meta)]
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
            line = "  ".join(f"{a.name} {res[a.name][-1].samples / res[a.name][-1].seconds:,.0f}" for a in arms)
            _progress(f"      round {i + 1}/{pairs} samples/s: {line}")

        rate = {a: [r.samples / r.seconds for r in rs] for a, rs in res.items()}
        step_rate = {a: [r.steps / r.seconds for r in rs] for a, rs in res.items()}
        out["samples_per_s"] = {a: _summary(v) for a, v in rate.items()}
        out["steps_per_s"] = {a: statistics.median(v) for a, v in step_rate.items()}
        out["cpu_per_wall"] = {a: statistics.median(r.cpu_s / r.seconds for r in rs) for a, rs in res.items()}
        out["loss"] = {a: {"first": statistics.fmean(rs[0].losses), "last": statistics.fmean(rs[-1].losses)}
                       for a, rs in res.items()}
        ratios = {"local_vs_torch": ("metaps_plain", "torch"),
                  "local_vs_torch_rowwise": ("metaps_plain", "torch_rowwise"),
                  "local_vs_torchrec": ("metaps_plain", "torchrec"),
                  "meta_vs_torchfunc": ("metaps_meta", "torchfunc")}
        out["paired"] = {}
        for key, (a, b) in ratios.items():
            if a in rate and b in rate:
                out[key] = statistics.median(rate[a]) / statistics.median(rate[b])
                per = [x / y for x, y in zip(rate[a], rate[b])]
                out["paired"][key] = {"min": min(per), "max": max(per)}
                _progress(f"      {key} = {out[key]:.3f} (per round {min(per):.3f}-{max(per):.3f})")

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

        if args.no_fleet:
            _progress("[4/4] fleet skipped (--no-fleet)")
        else:
            fdata = plain
            if fleet_rows != rows:
                fdata = make_data(tmp / "fleet", fleet_rows, "plain")
            how = "at once, no 2x2 (--smoke)" if args.smoke else "one after the other"
            _progress(f"[4/4] fleet, plain mode, {fleet_rows:,} rows, 1 epoch: train-local, 1x1, 2x2 "
                      f"(processes, {how})")
            jobs: dict[str, Callable[[], dict[str, Any]]] = {
                "train-local": lambda: run_local(tmp, fdata, mode="plain", epochs=1),
                "1x1": lambda: _fleet(tmp, fdata, "1x1", shards=1, workers=1),
                "2x2": lambda: _fleet(tmp, fdata, "2x2", shards=2, workers=2),
            }
            if args.smoke:
                # figures meaningless anyway: the runs at once (they only have to run); no 2x2 (four
                # more processes: bench.train_throughput's smoke runs run_fleet with 2 shards)
                del jobs["2x2"]
                with ThreadPoolExecutor(max_workers=3) as pool:
                    futs = {k: pool.submit(fn) for k, fn in jobs.items()}
                    fl = {k: f.result() for k, f in futs.items()}
            else:
                fl = {k: fn() for k, fn in jobs.items()}
            for k, got in fl.items():
                _progress(f"      {k} {got['samples_per_s']:,.0f} samples/s")
            local, one = fl["train-local"], fl["1x1"]
            two = fl.get("2x2")
            out["dist_1x1_vs_local"] = one["samples_per_s"] / local["samples_per_s"]
            out["dist_2x2_vs_local"] = None if two is None else two["samples_per_s"] / local["samples_per_s"]
            out["fleet"] = {"rows": fleet_rows, "local_samples_per_s": local["samples_per_s"],
                            "dist_1x1_samples_per_s": one["samples_per_s"],
                            "dist_2x2_samples_per_s": None if two is None else two["samples_per_s"],
                            "overlap_1x1": one.get("overlap"),
                            "step_ms": {"local": local["step_ms"], "dist_1x1": one["step_ms"],
                                        "dist_2x2": None if two is None else two["step_ms"]}}
    out["load"]["after"] = os.getloadavg()[0]
    out["elapsed_s"] = time.perf_counter() - t_all
    print(json.dumps(_round(out)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
