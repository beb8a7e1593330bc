"""Two workers against a single-process reference that steps on the same global batches.

The semantics under test (``[ps] sync = "sync"``, ``[train] overlap = false``):

* **Global step t** = worker 0's t-th batch and worker 1's t-th batch of their
  static shares (``workers.data_feed.static_ranges``).
* Every worker computes its gradients **at the parameters after step t-1**:
  no worker's step-t pull of rows or dense params sees another worker's step-t
  update, and every step-t update is applied before any step-t+1 pull.
* PS dense sync (``dense_sync = "ps"``): each worker pushes the gradient of its
  own batch's mean loss; the PS applies the two pushes as two optimizer steps, in
  arrival order. With SGD (used here, on rows and dense params) the two steps add:
  ``w_t = w_{t-1} - lr * (g_0 + g_1)``, independent of the order up to rounding. With a
  stateful optimizer (Adam, Adagrad) the result depends on the arrival order, so no
  fixed reference exists; that is why this test uses SGD.
* All-reduce dense sync (``dense_sync = "allreduce"``): the dense gradient is the
  sample-weighted mean ``(n_0 g_0 + n_1 g_1) / (n_0 + n_1)`` (the gradient of the mean
  loss over the union of both batches), one step of ``[ps].dense_optimizer`` (Adam here:
  one step of one reduced gradient is order-free); a worker whose share is exhausted
  joins with no batch. Row gradients go to the PS as in PS mode (two SGD pushes).
  Tested in ``test_allreduce.py`` (2 real worker processes) with :func:`reference`.

The reference applies exactly that in one process (a :class:`LocalRowSource`, one
model, ``Trainer.compute`` for each worker's batch at the same parameters). The
distributed result must equal it to float tolerance and differ from the initial
parameters. Before the fix that came with this test, a worker could pull rows
after its peer's same-step push and load dense params before its peer's push
landed; the PS-mode test failed on that.
"""

from __future__ import annotations

import threading
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import torch

from meta_io.reader import MetaIODataset
from ps.client import PsClient
from workers.data_feed import static_ranges
from workers.local import local_store
from workers.row_source import LocalRowSource, RemoteRowSource
from workers.trainer import Trainer, _ids_of, _samples_of
from workers.worker import Worker, build_model

from tests.workers.conftest import make_job
from tests.workers.test_parity import assert_trained

SGD = {"kind": "sgd", "lr": 0.05}


def _rank_batches(ds: MetaIODataset, rank: int, world: int) -> Iterator[Any]:
    """Worker ``rank``'s batches in its training order (static split, one epoch)."""
    for r in static_ranges(ds, rank, world):
        yield from ds.read_range(r.file, r.start, r.stop)


def _row_grads(ids: dict[str, np.ndarray], result: Any) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    return {t: (ids[t], result.row_grads[t].detach().numpy()) for t in ids if t in result.row_grads}


def reference(job: Any, steps: int | None, allreduce: bool) -> tuple[LocalRowSource, torch.nn.Module, int]:
    """The two-worker semantics above, in one process. Returns (rows, model, steps taken)."""
    src = LocalRowSource(local_store(job))
    model = build_model(job)
    trainer = Trainer(model, src, job.train, job.meta, job.ps.dense_optimizer)
    names = [n for n, _ in model.named_parameters()]
    ds = MetaIODataset(job.data.train)
    seqs = [_rank_batches(ds, r, 2) for r in range(2)]
    t = 0
    while steps is None or t < steps:
        batches = [next(s, None) for s in seqs]
        if all(b is None for b in batches):
            break
        # every worker pulls and computes at the parameters after step t-1 ...
        done = []
        for b in batches:
            if b is None:
                continue
            ids = _ids_of(b)
            done.append((b, ids, trainer.compute(b, src.pull(ids))))
        # ... then the updates of step t land
        for _, ids, res in done:
            src.push(_row_grads(ids, res), t)
        if allreduce:
            n = [float(_samples_of(b)[0]) for b, _, _ in done]
            flat = sum(torch.cat([res.dense_grads[k].reshape(-1) for k in names]) * w
                       for w, (_, _, res) in zip(n, done))
            trainer._apply_local(flat / sum(n))
        else:
            for _, _, res in done:
                src.push_dense({k: g.detach().numpy() for k, g in res.dense_grads.items()}, t)
            trainer._load_dense(src.pull_dense(names))
        t += 1
    return src, model, t


def trained_ids(job: Any, steps: int) -> dict[str, np.ndarray]:
    ds = MetaIODataset(job.data.train)
    ids: dict[str, list[np.ndarray]] = {}
    for r in range(2):
        for i, b in enumerate(_rank_batches(ds, r, 2)):
            if i >= steps:
                break
            for t, u in b.unique_ids.items():
                ids.setdefault(t, []).append(u.numpy())
    return {t: np.unique(np.concatenate(v)) for t, v in ids.items()}


def compare(job: Any, ref_rows: LocalRowSource, ref_model: torch.nn.Module,
            rows: dict[str, np.ndarray], dense: dict[str, np.ndarray], ids: dict[str, np.ndarray]) -> None:
    """Distributed ``rows`` (of ``ids``) and ``dense`` equal the reference's, which moved."""
    for name, p in ref_model.named_parameters():
        got = torch.from_numpy(np.asarray(dense[name]).reshape(p.shape))
        torch.testing.assert_close(got, p.detach(), rtol=1e-4, atol=1e-6, msg=f"dense param {name}")
    want = ref_rows.pull(ids)
    for t in ids:
        np.testing.assert_allclose(rows[t], want[t], rtol=1e-4, atol=1e-6, err_msg=f"table {t}")
    assert_trained(job, ids, want, ref_model)


def test_two_sync_ps_workers_match_reference(worker_data, ps_servers, tmp_path: Path) -> None:
    """dense_sync = "ps": 2 workers (threads, own gRPC clients) x 2 PS shards, 6 synchronous steps."""
    steps = 6
    job = make_job(worker_data["meta"], tmp_path, mode="meta", shards=2, workers=2,
                   ps={"sync": "sync", "dense_optimizer": SGD,
                       "table_defaults": {"dim": 8, "capacity": 4096, "optimizer": SGD}},
                   train={"max_steps": steps})
    addrs = ps_servers(job)
    # Both register before either trains, so the first barrier counts both.
    clients = [PsClient(addrs, job.rpc, worker_id=f"worker-{r}", register=True) for r in range(2)]
    workers = [Worker(job, r, RemoteRowSource(c), run_dir=tmp_path / "dist", world=2, barrier=c.barrier)
               for r, c in enumerate(clients)]
    errors: list[BaseException] = []

    def run(w: Worker) -> None:
        try:
            w.train()
        except BaseException as exc:  # reported below
            errors.append(exc)

    threads = [threading.Thread(target=run, args=(w,)) for w in workers]
    for th in threads:
        th.start()
    for th in threads:
        th.join(timeout=300)
    assert not any(th.is_alive() for th in threads), "a worker did not finish"
    assert not errors, errors
    assert [w.trainer.step_no for w in workers] == [steps, steps]

    ref_rows, ref_model, ref_steps = reference(job, steps, allreduce=False)
    assert ref_steps == steps
    ids = trained_ids(job, steps)
    reader = PsClient(addrs, job.rpc)
    names = [n for n, _ in ref_model.named_parameters()]
    compare(job, ref_rows, ref_model, reader.pull(ids), reader.pull_dense(names), ids)
    for w in workers:  # the workers' own models hold the final dense params too
        compare(job, ref_rows, ref_model, reader.pull(ids),
                 {n: p.detach().numpy() for n, p in w.model.named_parameters()}, ids)
    reader.close()
    for c in clients:
        c.close()
