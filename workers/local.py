"""``metaps train-local``: the same training without a PS fleet.

The model, the data order, the optimizers (fbgemm TBE for embeddings, the same
dense optimizer) and the step engine are the distributed worker's; only the
rows live in one in-process :class:`~ps.shard_store.ShardStore` instead of
behind gRPC. It is the parity reference for distributed training and the
speed baseline of ``bench.train_throughput``.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from pathlib import Path
from typing import Any

from common.log import kv
from workers.config import resolve_device
from workers.callbacks import EvalEvent, TrainingCallbacks
from workers.row_source import LocalRowSource
from workers.worker import Worker, merge_eval_files

log = logging.getLogger(__name__)


def local_store(job: Any) -> Any:
    """One ShardStore holding every table with the fleet's total capacity, on ``[train] device``.

    Raises:
        ConfigError: the device is CUDA and this machine has none (one line).
    """
    import torch

    from ps.shard_store import ShardStore

    device = resolve_device(job.train.device)
    if device.startswith("cuda:"):
        torch.cuda.set_device(int(device.split(":")[1]))  # the store takes "cuda" = the current device
        device = "cuda"
    tables = [dataclasses.replace(t, capacity=t.capacity * job.ps.shards) for t in job.table_configs()]
    return ShardStore(
        tables, shard_id=0, num_vshards=job.ps.num_vshards, seed=job.ps.seed, device=device,
        nonfinite_grads=job.ps.nonfinite_grads.value if hasattr(job.ps.nonfinite_grads, "value") else job.ps.nonfinite_grads,
        dense_optimizer=job.ps.dense_optimizer,
    )


def train_local(job: Any, run_dir: Path | None = None, checkpoint: bool = True,
                callbacks: TrainingCallbacks | None = None) -> tuple[dict[str, Any], Worker]:
    """Train on the whole train dataset in one process; evaluate; checkpoint.

    Args:
        callbacks: called at every step, evaluation (the final one too) and checkpoint; a stop
            they ask for ends training after the step, then the run evaluates and checkpoints
            as usual and the report's ``stop_asked`` says why (workers/callbacks.py).

    Returns:
        (the report dict, the Worker, whose ``model`` and ``rows.store`` hold the result)
    """
    store = local_store(job)
    worker = Worker(job, 0, LocalRowSource(store), controller=None, run_dir=run_dir, world=1)
    if callbacks is not None:
        worker.callbacks = callbacks
    validation = None
    if job.train.val_fraction > 0 or job.data.validation:
        # validation split, early stopping, the best epoch restored (workers/hygiene.py)
        from workers.hygiene import train_with_validation

        t0 = time.perf_counter()
        worker.train_start = time.time()
        validation = train_with_validation(worker, job, lambda: local_store(job)).to_dict()
        worker.wall_s, worker.train_end = time.perf_counter() - t0, time.time()
    else:
        ds = worker.dataset
        worker.trainer.total_steps = job.train.max_steps or job.train.epochs * sum(
            ds.num_batches(i) for i in range(ds.num_files)
        )
        worker.train()
    stopped = worker.stop_asked  # a stop asked of the final evaluation or checkpoint comes after training
    metrics = None
    if job.data.eval:
        worker.evaluate()
        metrics = merge_eval_files(worker.run_dir / "eval")
        worker._asked(worker.callbacks.evaluated(EvalEvent(worker.trainer.step_no, _flat(metrics), final=True)))
    ckpt = worker.checkpoint(metrics=metrics) if checkpoint else None
    rep = worker.report(metrics, ckpt)
    if validation is not None:
        rep["validation"] = validation
    rep["stop_asked"] = stopped
    log.info("train-local done", extra=kv(steps=rep["steps"], samples=rep["samples"],
                                          samples_per_s=round(rep["samples_per_s"], 1)))
    return rep, worker


def _flat(metrics: dict[str, Any]) -> dict[str, float]:
    """``{"base": {"click": {"auc": 0.7}}}`` -> ``{"base/click/auc": 0.7}`` (finite numbers only)."""
    return {f"{kind}/{head}/{k}": float(v) for kind, heads in metrics.items() if isinstance(heads, dict)
            for head, m in heads.items() if isinstance(m, dict)
            for k, v in m.items() if isinstance(v, (int, float)) and float(v) == float(v)}
