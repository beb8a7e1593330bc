"""Held-out evaluation: AUC and logloss per head, overall and per scenario.

For a meta dataset every task's *query* rows are scored twice: by the shared
model as is ("base") and after adapting on the task's support rows
("adapted", G-Meta's point). Plain datasets are scored once. When the data
carries the generator's true probabilities, the oracle AUC on the same rows is
reported too, and ``norm_auc = (auc - 0.5) / (oracle_auc - 0.5)``.

Heads and targets: ``click`` is scored against click; ``conversion`` is the
CTCVR probability, scored against ``click * conversion`` over all impressions.

:class:`PeriodicEval` runs the checkpoint leader's periodic evaluation off its
training path (a copy of the model scored in a background thread), so the leader
is not made the fleet's straggler by its own evaluations.
"""

from __future__ import annotations

import copy
import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from meta_io.batch import FeatureBatch, MetaBatch, PlainBatch
from common.evaluation import auc, logloss
from common.log import kv
from workers.row_source import RowSource

if TYPE_CHECKING:
    from models.base import CtrModel

log = logging.getLogger(__name__)


def head_target(head: str, labels: dict[str, torch.Tensor]) -> torch.Tensor:
    """The 0/1 target a head is scored against (conversion = CTCVR)."""
    if head == "conversion" and "click" in labels:
        return labels["click"] * labels["conversion"]
    return labels[head]


Scores = dict[str, dict[str, dict[str, np.ndarray]]]
"""kind ("base"/"adapted") -> head -> {"score", "target", "scenario"[, "oracle"]} flat arrays."""


class _Collector:
    """Accumulates flat (score, target, scenario, oracle) arrays per head."""

    def __init__(self) -> None:
        self.parts: dict[str, dict[str, list[np.ndarray]]] = defaultdict(lambda: defaultdict(list))

    def add(self, probs: dict[str, torch.Tensor], fb: FeatureBatch) -> None:
        mask = fb.mask.reshape(-1).numpy().astype(bool)
        for head, p in probs.items():
            if head not in fb.labels:
                continue
            part = self.parts[head]
            part["score"].append(p.detach().reshape(-1).numpy()[mask].astype(np.float32))
            part["target"].append(head_target(head, fb.labels).reshape(-1).numpy()[mask].astype(np.float32))
            part["scenario"].append(fb.scenario.reshape(-1).numpy()[mask])
            if head in fb.oracle:
                part["oracle"].append(fb.oracle[head].reshape(-1).numpy()[mask].astype(np.float32))

    def arrays(self) -> dict[str, dict[str, np.ndarray]]:
        return {h: {k: np.concatenate(v) for k, v in part.items()} for h, part in self.parts.items()}


def summarize(arrays: dict[str, dict[str, np.ndarray]]) -> dict[str, Any]:
    """AUC, logloss, oracle and normalized AUC per head, overall and per scenario."""
    out: dict[str, Any] = {}
    for head, part in arrays.items():
        score = part["score"].astype(np.float64)
        target = part["target"].astype(np.float64)
        scen = part["scenario"]
        res: dict[str, Any] = {
            "rows": int(len(score)),
            "positives": int(target.sum()),
            "auc": auc(target, score),
            "logloss": logloss(target, np.clip(score, 1e-7, 1 - 1e-7)),
        }
        if "oracle" in part:
            res["oracle_auc"] = auc(target, part["oracle"].astype(np.float64))
            denom = res["oracle_auc"] - 0.5
            res["norm_auc"] = (res["auc"] - 0.5) / denom if denom > 0 else float("nan")
        by_scen = {}
        for s in np.unique(scen):
            sel = scen == s
            if 0 < target[sel].sum() < sel.sum():  # AUC needs both classes
                by_scen[str(int(s))] = {"rows": int(sel.sum()), "auc": auc(target[sel], score[sel])}
        res["by_scenario"] = by_scen
        out[head] = res
    return out


@torch.no_grad()
def _predict(model: CtrModel, fb: FeatureBatch, rows: dict[str, torch.Tensor], uids: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return model.predict(fb, rows, uids)


def score_batches(
    model: CtrModel,
    rows_src: RowSource,
    batches: Iterable[MetaBatch | PlainBatch],
    meta_cfg: Any = None,
    adapt: bool = True,
    max_batches: int = 0,
    divergence: list[int] | None = None,
) -> Scores:
    """Score held-out batches; returns flat arrays (mergeable across workers).

    Args:
        model: the trained model (dense parameters current).
        rows_src: where rows come from (pulls only: evaluation never pushes).
        batches: meta or plain batches of a held-out dataset.
        meta_cfg: inner-loop settings for the adapted scores (meta batches only).
        adapt: also score after per-task adaptation (meta batches only).
        max_batches: stop after this many batches (0: all).
        divergence: ``[diverged, adapted]`` task counts, added to in place: tasks whose inner steps raised
            the support loss or left it non-finite (:func:`models.meta.adapt_tasks`' check, one more
            support forward per task), tasks adapted. None: not checked.
    """
    was = model.training
    model.eval()  # no dropout while scoring (nor in the inner steps of adapted scores)
    try:
        return _score(model, rows_src, batches, meta_cfg, adapt, max_batches, divergence)
    finally:
        model.train(was)


def _score(model: CtrModel, rows_src: RowSource, batches: Iterable[MetaBatch | PlainBatch],
           meta_cfg: Any, adapt: bool, max_batches: int, divergence: list[int] | None = None) -> Scores:
    from models.meta import adapt_and_predict, adapt_tasks

    base, adapted = _Collector(), _Collector()
    for n, batch in enumerate(batches):
        if max_batches and n >= max_batches:
            break
        ids = {t: u.numpy() for t, u in batch.unique_ids.items()}
        rows = {t: torch.from_numpy(np.ascontiguousarray(r)) for t, r in rows_src.pull(ids).items()}
        if isinstance(batch, MetaBatch):
            base.add(_predict(model, batch.query, rows, batch.unique_ids), batch.query)
            if adapt and meta_cfg is not None:
                if divergence is None:
                    probs = adapt_and_predict(model, batch.support, batch.query, rows, batch.unique_ids, meta_cfg)
                else:
                    res = adapt_tasks(model, batch.support, batch.query, rows, batch.unique_ids, meta_cfg)
                    probs = res.probs
                    divergence[0] += int((res.diverged & res.real).sum())
                    divergence[1] += int(res.real.sum())
                adapted.add({h: p.detach() for h, p in probs.items()}, batch.query)
        else:
            base.add(_predict(model, batch.features, rows, batch.unique_ids), batch.features)
    out: Scores = {"base": base.arrays()}
    if adapted.parts:
        out["adapted"] = adapted.arrays()
    return out


def evaluate(
    model: CtrModel,
    rows_src: RowSource,
    batches: Iterable[MetaBatch | PlainBatch],
    meta_cfg: Any = None,
    adapt: bool = True,
    max_batches: int = 0,
) -> dict[str, Any]:
    """Score and summarize in one go: ``{"base": {head: metrics}[, "adapted": ...]}``."""
    scores = score_batches(model, rows_src, batches, meta_cfg, adapt, max_batches)
    return {kind: summarize(arrs) for kind, arrs in scores.items()}


def batch_rows(batch: MetaBatch | PlainBatch) -> int:
    """Rows of one batch (support + query of a meta batch)."""
    if isinstance(batch, MetaBatch):
        return int(batch.support.num_rows() + batch.query.num_rows())
    return int(batch.features.num_rows())


def bounded_batches(batches: Iterable[MetaBatch | PlainBatch], max_rows: int) -> Iterator[MetaBatch | PlainBatch]:
    """The leading batches of ``batches`` holding at most ``max_rows`` rows (at least one batch).

    The periodic evaluation's sample: the same rows every time, so its AUC curve moves
    with the model only.

    Args:
        batches: held-out batches in dataset order.
        max_rows: the row budget (>= 1).
    """
    seen = 0
    for n, batch in enumerate(batches):
        rows = batch_rows(batch)
        if n and seen + rows > max_rows:
            return
        seen += rows
        yield batch
        if seen >= max_rows:
            return


def write_eval_file(path: Path, scores: Scores) -> None:
    """Save one shard's scores atomically (a replayed shard overwrites its own file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    flat = {f"{kind}/{head}/{k}": v for kind, heads in scores.items() for head, arrs in heads.items() for k, v in arrs.items()}
    tmp = path.with_name(path.name + ".tmp.npz")
    np.savez(tmp, allow_pickle=True, **flat)
    tmp.replace(path)


def merge_eval_files(directory: Path) -> dict[str, Any]:
    """Summarize every shard's scores under ``directory`` as one evaluation."""
    merged: dict[str, dict[str, dict[str, list[np.ndarray]]]] = defaultdict(lambda: defaultdict(lambda: defaultdict(list)))
    files = sorted(Path(directory).glob("*.npz"))
    for f in files:
        if f.name.endswith(".tmp.npz"):
            continue
        with np.load(f) as z:
            for key in z.files:
                kind, head, k = key.split("/")
                merged[kind][head][k].append(z[key])
    out: dict[str, Any] = {"files": len(files)}
    for kind, heads in merged.items():
        out[kind] = summarize({h: {k: np.concatenate(v) for k, v in arrs.items()} for h, arrs in heads.items()})
    return out


@dataclass
class PeriodicResult:
    """One periodic evaluation, done.

    Attributes:
        step: the step whose model was scored (its dense parameters, copied when the step ended).
        metrics: :func:`evaluate`'s ``{"base": {head: metrics}[, "adapted": ...]}``.
        seconds: how long the scoring took.
        rows: eval rows scored (support + query).
        steps_during: training steps the worker ran while it scored (0 when it scored inline).
        thread: the thread that scored it (``periodic-eval``, or ``MainThread`` inline).
    """

    step: int
    metrics: dict[str, Any]
    seconds: float
    rows: int
    steps_during: int
    thread: str


class PeriodicEval:
    """The leader's periodic evaluation, off its training path.

    :meth:`start` copies the model (its dense parameters as of the step just done) and scores
    the copy on the leading ``max_rows`` rows of the eval set in a daemon thread, pulling the
    embedding rows live from ``rows`` (pulls only, no step number: no staleness wait), so the
    worker goes on training meanwhile; :meth:`poll` hands finished results back to the training
    thread (which records them: telemetry and callbacks stay on one thread). One evaluation at a
    time: a step that falls due while one is running is skipped (counted in ``skipped``). With
    ``background=False`` (a row source that is not safe to read beside training, e.g. the
    in-process tables of ``train-local``), :meth:`start` scores inline and the result is ready at
    once.

    Args:
        dataset: the eval Meta-IO dataset (``MetaIODataset``).
        rows: the row source (a fleet's ``RemoteRowSource``: its PS client serves threads).
        meta_cfg: inner-loop settings for the adapted scores.
        adapt: also score after per-task adaptation.
        max_rows: the row budget (:func:`bounded_batches`).
        current_step: the worker's step counter, read when a result is done (``steps_during``).
        background: score in a thread (True) or inline.
    """

    def __init__(self, dataset: Any, rows: RowSource, meta_cfg: Any, adapt: bool, max_rows: int,
                 current_step: Callable[[], int], background: bool = True) -> None:
        self.dataset, self.rows, self.meta_cfg, self.adapt, self.max_rows = dataset, rows, meta_cfg, adapt, max_rows
        self.current_step, self.background = current_step, background
        self.skipped = 0
        self._thread: threading.Thread | None = None
        self._done: list[PeriodicResult] = []
        self._lock = threading.Lock()

    @property
    def busy(self) -> bool:
        return self._thread is not None and self._thread.is_alive()

    def start(self, step: int, model: CtrModel) -> bool:
        """Score ``model`` as of ``step`` (a copy, in the background); False when one is still running."""
        if self.busy:
            self.skipped += 1
            return False
        snapshot = None
        if self.background:
            try:
                snapshot = copy.deepcopy(model)  # the dense parameters of this step; training goes on with the original
            except Exception as exc:  # a model that cannot be copied (a user's module): scored inline from now on
                log.warning("periodic eval: the model cannot be copied; scoring inline, on the step path",
                            extra=kv(step=step, error=str(exc)[:200]))
                self.background = False
        if snapshot is None:
            self._run(step, model, steps_from=step)
            return True
        self._thread = threading.Thread(target=self._run, args=(step, snapshot, step), name="periodic-eval",
                                        daemon=True)
        self._thread.start()
        return True

    def _run(self, step: int, model: CtrModel, steps_from: int) -> None:
        t0 = time.perf_counter()
        try:
            ds = self.dataset
            batches = (b for f in range(ds.num_files) for b in ds.read_range(f, 0, ds.num_batches(f)))
            counted: list[int] = []

            def count(bs: Iterable[MetaBatch | PlainBatch]) -> Iterator[MetaBatch | PlainBatch]:
                for b in bs:
                    counted.append(batch_rows(b))
                    yield b

            metrics = evaluate(model, self.rows, count(bounded_batches(batches, self.max_rows)), self.meta_cfg,
                               adapt=self.adapt)
        except Exception:  # a failed evaluation costs its point on the curve, never the training
            log.exception("periodic eval failed", extra=kv(step=step))
            return
        res = PeriodicResult(step, metrics, time.perf_counter() - t0, sum(counted),
                             max(0, int(self.current_step()) - steps_from), threading.current_thread().name)
        with self._lock:
            self._done.append(res)

    def poll(self) -> list[PeriodicResult]:
        """The evaluations finished since the last call, oldest first."""
        with self._lock:
            done, self._done = self._done, []
        return done

    def wait(self, timeout_s: float | None = None) -> list[PeriodicResult]:
        """Wait for the running evaluation (at most ``timeout_s``), then :meth:`poll`."""
        t = self._thread
        if t is not None:
            t.join(timeout_s)
        return self.poll()
