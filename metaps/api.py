"""The Python API: the ``metaps`` command line's main path as functions, for notebooks and scripts.

Each function takes plain Python arguments (paths, a job file or a job mapping, overrides
as a ``{"section.key": value}`` dict like the CLI's ``--set``), returns a small frozen
dataclass instead of printing, and raises a :class:`~common.errors.MetapsError`
subclass with one clear line on bad input. They call the same functions the CLI
commands call::

    generate_data   metaps gen-data               metaps.roles.data.generate_data
    split_holdout   metaps meta-io split-holdout  metaps.roles.data.split_holdout
    build_meta_io   metaps meta-io build          metaps.roles.data.build_dataset
    train_local     metaps train-local            metaps.roles.local_run.run_local
    launch          metaps launch                 metaps.launch.Launcher
    evaluate        metaps evaluate               metaps.evaluate.evaluate_report
    deliver         metaps deliver                metaps.roles.deliver.delivery_config + delivery.job.deliver_once
    load_bundle     metaps predict                delivery.loader.load_bundle + delivery.predict.predict_to_parquet

Example (docs/api.md has the whole path, run by tests/metaps/test_api.py)::

    from metaps import api
    data = api.generate_data("work/data", rows=3000, users=300, items=200, seed=1)
    run = api.train_local({"data": {"train": "work/metaio"}}, overrides={"train.max_steps": 10})

Importing this module is light (no torch); each function imports what it runs.
Logging goes to the ``metaps`` / subsystem loggers. Only :func:`train_local` and :func:`launch`
draw: their progress (``progress=``: a bar in Jupyter or on a terminal, else lines on stderr;
False: nothing). Their results hold the trained model in memory (``model``, ``tables``,
``predict``), and their callbacks (``on_step``, ``on_eval``, ``on_checkpoint``) can stop a run
(:data:`STOP`, :class:`StopTraining`); docs/api.md says what each sees in each mode.
"""

from __future__ import annotations

import contextlib
import copy
import enum
import logging
import os
import tempfile
import time
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Union

from common.errors import ConfigError, MetapsError
from workers.callbacks import CheckpointEvent, EvalEvent, StepEvent

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa
    import torch

    from meta_io.batch import FeatureBatch
    from meta_io.schema import Schema
    from metaps.job import JobConfig
    from metaps.progress import RunProgress

log = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]
"""A path: ``str`` or :class:`pathlib.Path`."""
JobSource = Union[str, "os.PathLike[str]", Mapping[str, object]]
"""A job: the path of a job TOML, or the job as a mapping of sections (``{"data": {"train": ...}}``)."""
Overrides = Mapping[str, object]
"""Job-file overrides, ``{"train.max_steps": 20, "ps.shards": 1}``: the CLI's ``--set`` keys, checked the same way."""
DataInput = Union[str, "os.PathLike[str]", "pa.Table"]
"""Rows to score: a Parquet/CSV file or folder, or a ``pyarrow.Table`` with the same columns."""
IdsInput = Union[Sequence[int], "np.ndarray", "torch.Tensor"]
"""Ids to look up: a list, a NumPy array or a tensor of int64 ids (any order, duplicates allowed)."""
StepCallback = Callable[[StepEvent], object]
"""``on_step(event)``: return :data:`STOP` (or raise :class:`StopTraining`) to stop the run."""
EvalCallback = Callable[[EvalEvent], object]
"""``on_eval(event)``: return :data:`STOP` (or raise :class:`StopTraining`) to stop the run."""
CheckpointCallback = Callable[[CheckpointEvent], object]
"""``on_checkpoint(event)``: return :data:`STOP` (or raise :class:`StopTraining`) to stop the run."""
ProgressSetting = Union[bool, str]
"""``"auto"`` (True), ``"bar"``, ``"lines"`` or ``"off"`` (False): :func:`metaps.progress.progress_mode`."""

__all__ = [
    "STOP", "AdaptedBundle", "ApiError", "Bundle", "CallbackError", "CheckpointEvent", "DataResult",
    "DeliverResult", "EvalEvent", "EvalResult", "LaunchResult", "MetaIOResult", "Predictions", "Signal",
    "SplitResult", "StepEvent", "StopTraining", "Table", "TrainResult", "TrainedModel", "build_meta_io",
    "deliver", "evaluate", "generate_data", "launch", "load_bundle", "load_checkpoint", "load_job",
    "split_holdout", "train_local",
]


class ApiError(MetapsError):
    """A bad argument to a :mod:`metaps.api` function (a wrong type, a missing path)."""


class CallbackError(ApiError):
    """A callback (``on_step``, ``on_eval``, ``on_checkpoint``) raised; the run ended there (its cause is chained)."""


class Signal(enum.Enum):
    """What a callback returns to act on the run."""

    STOP = "stop"


STOP = Signal.STOP
"""Return this from a callback to stop the run: training ends after the current step, then the
run ends as usual (train-local: final evaluation and checkpoint; launch: the fleet stops with a
final checkpoint) and its report says it was stopped, by which callback, at which step."""


class StopTraining(Exception):  # noqa: N818 -- a request, not an error: the run ends cleanly
    """Raise this in a callback to stop the run, as returning :data:`STOP` does; its message joins the reason."""


# ---------------------------------------------------------------------------- trained models in memory

class _RowStore:
    """Where a :class:`Table`'s rows live (a checkpoint's arrays, a bundle's LMDB chain)."""

    dim: int

    def count(self) -> int:
        raise NotImplementedError

    def ids(self) -> "np.ndarray":
        raise NotImplementedError

    def get(self, uniq: "np.ndarray") -> tuple["np.ndarray", "np.ndarray"]:
        """``(found, rows)`` for sorted unique ids; ids it does not hold read as their initial row."""
        raise NotImplementedError


class Table:
    """One embedding table of a trained model or a bundle: rows by id, in NumPy/torch (no Python per row).

    An id the table does not hold reads as the PS's initial row of that id, as a PS pull in
    training and a bundle lookup in serving do (zeros for bundles exported before that rule).

    Attributes:
        name: the table's name (``user``, ``item``, ...).
        dim: its row length.
    """

    def __init__(self, name: str, store: _RowStore) -> None:
        self.name = name
        self.dim = int(store.dim)
        self._store = store

    def __repr__(self) -> str:
        return f"Table({self.name!r}, rows={self.rows}, dim={self.dim})"

    def __len__(self) -> int:
        return self.rows

    @property
    def rows(self) -> int:
        """Rows held."""
        return self._store.count()

    def ids(self) -> "np.ndarray":
        """Every id held, sorted (int64)."""
        return self._store.ids()

    def _unique(self, ids: IdsInput) -> tuple["np.ndarray", "np.ndarray"]:
        import numpy as np

        if hasattr(ids, "detach"):
            ids = ids.detach().cpu().numpy()  # type: ignore[union-attr]
        try:
            arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        except (TypeError, ValueError) as exc:
            raise ApiError(f"table {self.name!r}: ids must be int64 ids (a list, array or tensor): {exc}") from None
        uniq, inv = np.unique(arr, return_inverse=True)
        return uniq, inv.reshape(-1)

    def lookup(self, ids: IdsInput) -> "torch.Tensor":
        """Rows of ``ids`` as a float32 tensor ``[len(ids), dim]`` (any order, duplicates allowed).

        Raises:
            ApiError: ``ids`` are not integers.
        """
        import torch

        uniq, inv = self._unique(ids)
        _, rows = self._store.get(uniq)
        return torch.from_numpy(rows[inv])

    def contains(self, ids: IdsInput) -> "np.ndarray":
        """Whether the table holds each id (bool per id)."""
        uniq, inv = self._unique(ids)
        return self._store.get(uniq)[0][inv]


class _CheckpointRows(_RowStore):
    """A checkpoint table's rows, read once on first use (:meth:`delivery.export.CheckpointSource.table`)."""

    def __init__(self, src: Any, table: str, dim: int, init: Callable[["np.ndarray"], "np.ndarray"] | None) -> None:
        self.src, self.table, self.dim, self.init = src, table, dim, init
        self._data: tuple["np.ndarray", "np.ndarray"] | None = None

    def _load(self) -> tuple["np.ndarray", "np.ndarray"]:
        if self._data is None:
            d = self.src.table(self.table)
            self._data = (d.ids, d.weights())
        return self._data

    def count(self) -> int:
        return int(self._load()[0].shape[0])

    def ids(self) -> "np.ndarray":
        return self._load()[0].copy()

    def get(self, uniq: "np.ndarray") -> tuple["np.ndarray", "np.ndarray"]:
        import numpy as np

        have, w = self._load()
        pos = np.searchsorted(have, uniq).clip(max=max(have.shape[0] - 1, 0))
        found = (have[pos] == uniq) if have.shape[0] else np.zeros(uniq.shape[0], bool)
        rows = np.zeros((uniq.shape[0], self.dim), dtype=np.float32)
        rows[found] = w[pos[found]]
        if self.init is not None and not found.all():
            rows[~found] = self.init(uniq[~found])
        return found, rows


class _Served:
    """A bundle's :class:`delivery.loader.ServingModel`, open while lookups need it.

    LMDB opens an environment once per process: scoring (``metaps predict``'s code opens the
    bundle itself) releases it, and the next lookup opens it again (already verified at load).
    """

    def __init__(self, served: Any) -> None:
        self.path = Path(served.path)
        self._served: Any = served

    def get(self) -> Any:
        if self._served is None:
            from delivery.loader import load_bundle as _load

            self._served = _load(self.path, verify=False)
        return self._served

    def release(self) -> None:
        if self._served is not None:
            self._served.close()
            self._served = None


class _BundleRows(_RowStore):
    """A bundle table's rows through its chain (:meth:`delivery.loader.ServingModel.lookup`'s walk)."""

    def __init__(self, box: _Served, table: str, dim: int, rows: int) -> None:
        self.box, self.table, self.dim, self.rows = box, table, dim, rows

    @property
    def served(self) -> Any:
        return self.box.get()

    def count(self) -> int:
        return self.rows

    def ids(self) -> "np.ndarray":
        import numpy as np

        from delivery.bundle import BundleKind

        cur = np.zeros(0, np.int64)
        for link in reversed(self.served.links):  # the full base first, then each delta
            info = link.manifest.tables.get(self.table)
            if info is None:
                continue
            delta = link.manifest.kind is BundleKind.DELTA
            got, _ = link.reader.scan(self.table, int(info.written if delta else info.rows), values=False)
            gone = link.removed.get(self.table)
            if gone is not None and gone.size:
                cur = cur[~np.isin(cur, gone)]
            cur = np.union1d(cur, got)
        return cur.astype(np.int64)

    def get(self, uniq: "np.ndarray") -> tuple["np.ndarray", "np.ndarray"]:
        found, rows = self.served._lookup_unique(self.table, uniq)
        return found, rows


class TrainedModel:
    """A committed checkpoint's model in memory: :func:`load_checkpoint` returns it, and
    ``TrainResult`` / ``LaunchResult`` give their final checkpoint's as ``.model``, ``.tables``
    and ``.predict``.

    Read with the checkpoint reader delivery exports from (``delivery.export.CheckpointSource``
    over ``ps.checkpoint``, every file sha256-verified first); each table's rows are read on
    first use.

    Attributes:
        path: the checkpoint directory.
        step: its step.
        model: the dense network (a ``torch.nn.Module``, the job's model class) with the trained
            parameters, in eval mode. It takes ``(features, rows, unique_ids)``; :meth:`predict`
            feeds it from :attr:`tables`.
        tables: table name -> :class:`Table`.
        heads: the model's heads (``click``, ...).
        schema: the data schema it was trained on.
    """

    def __init__(self, path: Path) -> None:
        from delivery.adapt import adapt_recipe, unseen_initializers
        from delivery.export import CheckpointSource, build_trained_model

        src = CheckpointSource.open(path)
        model, dims = build_trained_model(src)
        self.path = Path(src.path)
        self.step = int(src.step)
        self.model = model.eval()
        self.schema: Schema = src.schema
        self.heads = tuple(str(getattr(h, "name", h)) for h in model.heads)
        init = unseen_initializers(adapt_recipe(src.info, list(dims), str(src.path)), dims)
        self.tables: Mapping[str, Table] = {t: Table(t, _CheckpointRows(src, t, int(d), init.get(t)))
                                            for t, d in dims.items()}
        self._scratch = _Scratch(self)

    def __repr__(self) -> str:
        return f"TrainedModel({str(self.path)!r}, step={self.step}, heads={list(self.heads)})"

    def score_batch(self, features: "FeatureBatch") -> "dict[str, torch.Tensor]":
        """Head -> probabilities ``[*L]`` for every row of one ``FeatureBatch`` (padding rows
        included), its rows looked up in :attr:`tables`: what :meth:`predict` does per batch.

        Args:
            features: a batch with the schema's feature columns (``meta_io.batch.FeatureBatch``).
        """
        import torch

        lead = tuple(features.shape)
        features = features.flat()
        uniq = features.unique_ids(self.schema.id_columns, self.tables)
        rows = {t: self.tables[t].lookup(u) for t, u in uniq.items()}
        with torch.no_grad():
            out = self.model.predict(features, rows, uniq)
        return {h: o.reshape(lead) for h, o in out.items()}

    def predict(self, data: DataInput, *, keep_columns: Sequence[str] = (), batch_rows: int = 4096) -> Predictions:
        """Score every row of ``data`` in this process with :attr:`model` and :attr:`tables`.

        The rows are read as ``metaps predict`` reads them (the same columns; labels optional:
        present ones are evaluated; a ``pyarrow.Table`` through a scratch Parquet file, removed
        after), so a bundle delivered from this checkpoint scores them alike.

        Args:
            data: a Parquet/CSV file or folder, or a ``pyarrow.Table``.
            keep_columns: input columns returned with the scores.
            batch_rows: rows per batch.

        Returns:
            head -> probabilities per input row (input order); ``bundle`` names the checkpoint.

        Raises:
            ApiError: a missing path; DeliveryError / DataError: rows the model cannot read.
        """
        import numpy as np

        from common.evaluation import StreamingAUC
        from delivery.predict import _batches

        if isinstance(keep_columns, str):
            raise ApiError(f"keep_columns: expected a list of column names, got the string {keep_columns!r}")
        src = self._scratch.input(data, "data", f"data-{time.monotonic_ns()}")
        batches, labels = _batches(src, self.schema, batch_rows)
        accs = {h: StreamingAUC() for h in self.heads if h in labels}
        probs: dict[str, list[np.ndarray]] = {h: [] for h in self.heads}
        rows = 0
        for fb, _ in batches:
            out = self.score_batch(fb)
            mask = fb.mask.reshape(-1).numpy()
            for h in self.heads:
                p = out[h].reshape(-1).numpy()
                probs[h].append(p)
                if h in accs:
                    accs[h].update(fb.labels[h].reshape(-1).numpy(), p, mask)
            rows += int(fb.mask.numel())
        cols: dict[str, np.ndarray] = {}
        if keep_columns:
            cols = _kept_columns(src, list(keep_columns), rows)
        self._scratch.drop(src)
        return Predictions(bundle=f"{self.path.name} (in memory)", rows=rows,
                           probs={h: np.concatenate(v) if v else np.zeros(0, np.float32) for h, v in probs.items()},
                           columns=cols, auc={h: a.value() for h, a in accs.items()})


def _kept_columns(src: Path, names: list[str], rows: int) -> "dict[str, np.ndarray]":
    """``keep_columns`` of scored input, in the order it was scored (``metaps predict``'s reader)."""
    from delivery.bundle import DeliveryError
    from delivery.predict import _RawColumns
    from meta_io.layout import MANIFEST_NAME
    from meta_io.source import list_source_files

    if src.is_dir() and (src / MANIFEST_NAME).is_file():
        raise DeliveryError(f"{src}: keep_columns needs Parquet/CSV input, not a Meta-IO dataset")
    kept = _RawColumns(list_source_files(src), names).take(rows)
    return {c: kept.column(c).to_numpy(zero_copy_only=False) for c in names}


def load_checkpoint(path: PathLike) -> TrainedModel:
    """A committed checkpoint's model and tables in memory (verified first).

    Args:
        path: a checkpoint (``RUN/checkpoints/ckpt-N``), or a run directory (its newest committed one).

    Returns:
        the :class:`TrainedModel`: ``.model``, ``.tables``, ``.predict``.

    Raises:
        ApiError: a missing path; DeliveryError: not a committed checkpoint, or a corrupt one.
    """
    from metaps.evaluate import checkpoint_dir

    return TrainedModel(checkpoint_dir(_path(path, "checkpoint", must_exist=True)))


class _FromCheckpoint:
    """``model``, ``tables`` and ``predict`` of a run's result, from its final checkpoint (read on first use)."""

    checkpoint: Path | None
    _loaded: dict[str, TrainedModel]

    @property
    def trained(self) -> TrainedModel:
        """The final checkpoint as a :class:`TrainedModel` (read once, then kept).

        Raises:
            ApiError: the run left no checkpoint.
        """
        if "final" not in self._loaded:
            if self.checkpoint is None:
                raise ApiError("this run left no checkpoint: it has no trained model to load")
            self._loaded["final"] = TrainedModel(self.checkpoint)
        return self._loaded["final"]

    @property
    def model(self) -> "torch.nn.Module":
        """The trained dense network (eval mode): :attr:`TrainedModel.model`."""
        return self.trained.model

    @property
    def tables(self) -> Mapping[str, Table]:
        """Table name -> :class:`Table` of the final checkpoint."""
        return self.trained.tables

    def predict(self, data: DataInput, *, keep_columns: Sequence[str] = (), batch_rows: int = 4096) -> "Predictions":
        """Score rows in memory with the final checkpoint's model: :meth:`TrainedModel.predict`."""
        return self.trained.predict(data, keep_columns=keep_columns, batch_rows=batch_rows)



# ---------------------------------------------------------------------------- results

@dataclass(frozen=True)
class DataResult:
    """What :func:`generate_data` wrote.

    Args:
        out_dir: the output folder.
        schema: its ``schema.json`` (pass it to :func:`split_holdout` / :func:`build_meta_io`).
        files: the Parquet files, in order.
        rows: rows written.
        oracle_auc: label -> AUC of the true probability (the ceiling a model can reach).
    """

    out_dir: Path
    schema: Path
    files: tuple[Path, ...]
    rows: int
    oracle_auc: Mapping[str, float]


@dataclass(frozen=True)
class SplitResult:
    """What :func:`split_holdout` wrote.

    Args:
        train_dir / holdout_dir: the two Parquet folders (a task split: held-out tasks are unseen in
            training; a time split: the holdout is every row at or after ``time_cut``).
        schema: the split data's schema file.
        keys_file: what reproduces the split: the held-out task keys, one per line (``keys=`` of a
            later split), or for a time split ``time_cut.json`` (its ``cut`` is ``cut=``).
        train_rows / holdout_rows / holdout_tasks: counts.
        time_cut: the time split's cut (None for a task split).
    """

    train_dir: Path
    holdout_dir: Path
    schema: Path
    keys_file: Path
    train_rows: int
    holdout_rows: int
    holdout_tasks: int
    time_cut: int | None = None


@dataclass(frozen=True)
class MetaIOResult:
    """What :func:`build_meta_io` built.

    Args:
        out_dir: the dataset folder (``data.train`` / ``data.eval`` of a job).
        layout: ``meta`` or ``plain``.
        rows: input rows.
        batches / files: record batches and part files written.
        tasks / episodes: tasks and support/query episodes (0 for ``plain``).
        totals: the manifest's totals, as written.
    """

    out_dir: Path
    layout: str
    rows: int
    batches: int
    files: int
    tasks: int
    episodes: int
    totals: Mapping[str, object]


@dataclass(frozen=True)
class TrainResult(_FromCheckpoint):
    """What :func:`train_local` did, and the trained model in memory.

    ``model``, ``tables`` and ``predict(data)`` are the final checkpoint's
    (:class:`TrainedModel`, read on first use).

    Args:
        run_dir: the run directory (``report.json``, ``checkpoints/``, ``tb/``, ``plots/``).
        status: ``succeeded``, or ``stopped`` (a callback stopped it; ``reason`` says which, when).
        steps / samples / samples_per_s: the training totals.
        checkpoint: the last committed checkpoint (None when the job writes none).
        auc: head -> AUC on ``data.eval`` (empty without one).
        report: ``report.json``'s content.
        reason: why it stopped early ('' when it ran to its end).
    """

    run_dir: Path
    status: str
    steps: int
    samples: int
    samples_per_s: float
    checkpoint: Path | None
    auc: Mapping[str, float]
    report: Mapping[str, object]
    reason: str = ""
    _loaded: dict[str, TrainedModel] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def stopped(self) -> bool:
        """Whether a callback stopped the run before its end."""
        return self.status == "stopped"


@dataclass(frozen=True)
class LaunchResult(_FromCheckpoint):
    """What :func:`launch` did; ``model``, ``tables`` and ``predict(data)`` are its final checkpoint's.

    Args:
        run_dir: the run directory.
        status: ``succeeded``, ``failed`` or ``interrupted`` (a signal, or a callback: ``reason`` says).
        reason: why it failed or stopped ('' when it succeeded).
        exit_code: what ``metaps launch`` would have exited with (0: every worker finished).
        checkpoint: the last committed checkpoint (None: none).
        auc: head -> final AUC on ``data.eval``.
        coverage: the data coverage summary (``complete`` when every shard of every epoch is done).
        report: ``report.json``'s content.
    """

    run_dir: Path
    status: str
    reason: str
    exit_code: int
    checkpoint: Path | None
    auc: Mapping[str, float]
    coverage: str
    report: Mapping[str, object]
    _loaded: dict[str, TrainedModel] = field(default_factory=dict, init=False, repr=False, compare=False)

    @property
    def ok(self) -> bool:
        """Whether the run succeeded."""
        return self.exit_code == 0


@dataclass(frozen=True)
class EvalResult:
    """What :func:`evaluate` measured.

    Args:
        protocol: ``plain``, ``episodes`` or ``first-k``.
        rows / tasks: rows scored, tasks seen.
        base: head -> metrics (``auc``, ``gauc``, ...) of the base model.
        adapted: head -> metrics after per-task adaptation (empty when not adapted).
        report: the whole report, as ``metaps evaluate`` prints it.
    """

    protocol: str
    rows: int
    tasks: int
    base: Mapping[str, Mapping[str, float]]
    adapted: Mapping[str, Mapping[str, float]]
    report: Mapping[str, object]


@dataclass(frozen=True)
class DeliverResult:
    """What :func:`deliver` did.

    Args:
        status: ``published``, ``up_to_date`` (nothing newer than LATEST) or ``refused`` (the gate).
        version: the version published (or that would have been).
        kind: ``full`` or ``delta``.
        checkpoint: the checkpoint delivered.
        bundle: the published bundle directory (None unless published).
        auc: head -> the gate's AUC on the holdout (empty when ungated).
        reason: the gate's reasons when refused, else the status.
    """

    status: str
    version: str | None
    kind: str | None
    checkpoint: Path
    bundle: Path | None
    auc: Mapping[str, float]
    reason: str

    @property
    def published(self) -> bool:
        """Whether a bundle was published."""
        return self.status == "published"


@dataclass(frozen=True)
class Predictions:
    """Scores of :meth:`Bundle.predict` / :meth:`AdaptedBundle.predict`, one per input row, in input order.

    Args:
        bundle: the bundle version that scored.
        rows: rows scored.
        probs: head -> float32 probabilities ``[rows]``.
        columns: the ``keep_columns`` copied from the input (name -> ``[rows]``).
        auc: head -> AUC, for heads whose label column is in the input.
        adapted: rows of tasks with support rows were scored after adapting on them.
        unknown_share: share of looked-up ids the bundle does not hold.
    """

    bundle: str
    rows: int
    probs: Mapping[str, "np.ndarray"]
    columns: Mapping[str, "np.ndarray"] = field(default_factory=dict)
    auc: Mapping[str, float] = field(default_factory=dict)
    adapted: bool = False
    unknown_share: float = 0.0



# ---------------------------------------------------------------------------- helpers

def _path(value: object, what: str, must_exist: bool = False) -> Path:
    if isinstance(value, bool) or not isinstance(value, (str, os.PathLike)) or not str(value):
        raise ApiError(f"{what}: expected a path (str or pathlib.Path), got {type(value).__name__} {value!r}")
    p = Path(value)
    if must_exist and not p.exists():
        raise ApiError(f"{what} {p}: no such file or directory")
    return p


@contextlib.contextmanager
def _run_umask() -> Iterator[None]:
    """The CLI's 0640/0750 rule for the run's files, for the call only (a notebook keeps its umask)."""
    from common.security import set_run_umask

    old = set_run_umask()
    try:
        yield
    finally:
        os.umask(old)


def _set_texts(overrides: Overrides | None) -> list[str]:
    """``{"train.max_steps": 20}`` -> ``["train.max_steps=20"]``: the ``--set`` texts the CLI would get."""
    from common.toml_writer import dumps

    if overrides is None:
        return []
    if not isinstance(overrides, Mapping):
        raise ApiError(f"overrides: expected a mapping like {{'train.max_steps': 20}}, got {type(overrides).__name__}")
    texts = []
    for key, value in overrides.items():
        if not isinstance(key, str):
            raise ApiError(f"overrides: keys are dotted job-file keys like 'train.max_steps', got {key!r}")
        if isinstance(value, Mapping):
            raise ApiError(f"overrides {key!r}: give one dotted key per value (e.g. '{key}.KEY'), not a table")
        if value is None:  # dumps leaves a None key out (unset): an override must set a value
            raise ApiError(f"overrides {key!r}: TOML has no null; give a value")
        try:
            text = dumps({"v": value}).strip()
        except MetapsError as exc:
            raise ApiError(f"overrides {key!r}: {exc}") from None
        texts.append(f"{key}={text.removeprefix('v = ')}")
    return texts


def _job_mapping(config: JobSource, texts: list[str]) -> tuple[dict[str, object], str]:
    """(the job mapping with the overrides applied, how errors name it)."""
    from common.config import read_toml
    from metaps.roles.overrides import apply_overrides, describe, parse_sets

    if isinstance(config, Mapping):
        from metaps.job import absolute_class_dir

        # a mapping has no file: a custom model's relative class_dir is the caller's working
        # directory (a notebook's folder), made absolute before the job is copied to a run dir
        data = absolute_class_dir(copy.deepcopy(dict(config)), Path.cwd() / "job.toml")
        name = "<job mapping>"
    else:
        name = str(_path(config, "config"))
        data = dict(read_toml(name))
    try:
        sets = parse_sets(texts)
    except ConfigError as exc:  # the CLI's words name its flag; here the argument is `overrides`
        raise ConfigError(str(exc).replace("--set ", "overrides: ", 1)) from None
    return apply_overrides(data, sets), describe(name, texts)


def load_job(config: JobSource, overrides: Overrides | None = None) -> "JobConfig":
    """Parse and check a job (a TOML path or a mapping) with overrides, as every CLI command does.

    Args:
        config: the job TOML's path, or its sections as a mapping (``{"data": {"train": "metaio"}}``).
        overrides: ``{"section.key": value}``, checked like ``--set`` (unknown keys name the nearest real ones).

    Returns:
        the :class:`metaps.job.JobConfig`.

    Raises:
        ConfigError: a missing file, an unknown key, a bad value (one line naming it).
    """
    from metaps.job import job_from_mapping

    data, where = _job_mapping(config, _set_texts(overrides))
    return job_from_mapping(data, where=where)


def _floats(value: object) -> dict[str, float]:
    return {str(k): float(v) for k, v in value.items()} if isinstance(value, Mapping) else {}


def _metrics(value: object) -> dict[str, dict[str, float]]:
    if not isinstance(value, Mapping):
        return {}
    return {str(h): {str(k): float(v) for k, v in m.items() if isinstance(v, (int, float))}
            for h, m in value.items() if isinstance(m, Mapping)}


def _int(value: object) -> int:
    return int(value) if isinstance(value, (int, float)) else 0


# ---------------------------------------------------------------------------- data

def generate_data(out: PathLike, *, rows: int = 200_000, users: int = 20_000, items: int = 5_000, seed: int = 0,
                  files: int | None = None) -> DataResult:
    """Generate AntM2C-like synthetic CTR/CVR logs (Parquet + ``schema.json``), like ``metaps gen-data``.

    Args:
        out: output folder (created; earlier ``part-*.parquet`` files there are replaced).
        rows: rows (impressions).
        users: distinct users (the tasks of Meta-IO).
        items: distinct items.
        seed: random seed (same seed, same data).
        files: Parquet files to write (None: the generator's default).

    Returns:
        the folder, schema file, files, row count and oracle AUCs.

    Raises:
        ConfigError: a bad size (one line naming it).
    """
    from metaps.roles.data import generate_data as _generate

    data = _generate(_path(out, "out"), rows, users, items, seed, files, where="generate_data()")
    return DataResult(out_dir=Path(data.out_dir), schema=Path(data.schema_path), files=tuple(map(Path, data.files)),
                      rows=int(data.rows), oracle_auc=dict(data.oracle_auc))


def split_holdout(input: PathLike, schema: PathLike, out: PathLike, *, fraction: float | None = None, seed: int = 0,
                  keys: PathLike | None = None, by: str = "task", cut: int | None = None) -> SplitResult:
    """Split logs into train and held-out rows, like ``metaps meta-io split-holdout``: by task (users
    unseen in training, the cold-start judge) or by time (train on the past, score the future).

    Args:
        input: Parquet/CSV file or folder (your logs or :func:`generate_data`'s).
        schema: schema file (.json or .toml; ``configs/schema_example.toml`` shows one for your own logs).
        out: writes ``out/train``, ``out/holdout`` and ``out/schema.json``.
        fraction: ``by="task"``: share of tasks held out, chosen by a seeded hash of the task key;
            ``by="time"``: share of rows held out, the latest (None: 0.1).
        seed: seed of the task ``fraction`` choice.
        keys: ``by="task"``, instead of ``fraction``: hold out exactly the task keys in this file, one per line.
        by: ``task`` or ``time``.
        cut: ``by="time"``, instead of ``fraction``: hold out the rows with a timestamp >= ``cut``.

    Returns:
        the two folders, the schema, what reproduces the split, and the counts.

    Raises:
        ApiError: a missing input or schema; DataError / SchemaError: bad data.
    """
    from metaps.roles.data import split_holdout as _split

    given = [n for n, v in (("fraction", fraction), ("keys", keys), ("cut", cut)) if v is not None]
    if len(given) > 1:
        raise ApiError(f"split_holdout: give one of fraction, keys and cut, not {' and '.join(given)}")
    key_file = _path(keys, "keys", must_exist=True) if keys is not None else None
    res = _split(_path(input, "input", must_exist=True), _path(schema, "schema", must_exist=True),
                 _path(out, "out"), fraction, seed, key_file, by, cut)
    return SplitResult(train_dir=Path(res.train_dir), holdout_dir=Path(res.holdout_dir),
                       schema=Path(res.schema_path), keys_file=Path(res.record),
                       train_rows=int(res.train_rows), holdout_rows=int(res.holdout_rows),
                       holdout_tasks=int(res.holdout_tasks), time_cut=res.time_cut)


def build_meta_io(input: PathLike, schema: PathLike, out: PathLike, *, support: int = 8, query: int = 4,
                  rows_per_batch: int = 768, layout: str = "meta", split: str = "time", seed: int = 0,
                  overwrite: bool = False, options: Mapping[str, object] | None = None) -> MetaIOResult:
    """Lay logs out by task into a Meta-IO dataset (fixed-shape Arrow IPC files), like ``metaps meta-io build``.

    Args:
        input: Parquet/CSV file or folder.
        schema: schema file (.json or .toml).
        out: the dataset folder to write.
        support / query: support and query slots per episode.
        rows_per_batch: slots (rows) per record batch.
        layout: ``meta`` (support/query episodes per task) or ``plain`` (rows in input order).
        split: how a task's rows divide into support and query: ``time`` or ``random``.
        seed: seed of the random split and shuffles.
        overwrite: replace a dataset already in ``out``.
        options: other :class:`meta_io.build.MetaIOBuildConfig` fields (``task_key``, ``bucketing``,
            ``memory_budget_mb``, ...), checked by name.

    Returns:
        the folder and the build's totals.

    Raises:
        ApiError: a missing input or schema; ConfigError: a bad option; DataError: bad data, or a
            dataset already in ``out`` without ``overwrite``.
    """
    from metaps.roles.data import build_dataset

    fields: dict[str, object] = dict(options or {})
    fields.update(support=support, query=query, rows_per_batch=rows_per_batch, layout=layout, split=split,
                  seed=seed, overwrite=overwrite)
    res = build_dataset(_path(input, "input", must_exist=True), _path(schema, "schema", must_exist=True),
                        _path(out, "out"), fields, where="build_meta_io()")
    t = dict(res.manifest["totals"])
    return MetaIOResult(out_dir=Path(res.out_dir), layout=str(res.manifest["layout"]), rows=_int(t.get("input_rows")),
                        batches=_int(t.get("batches")), files=_int(t.get("files")), tasks=_int(t.get("tasks")),
                        episodes=_int(t.get("episodes")), totals=t)


# ---------------------------------------------------------------------------- training

class _Callbacks:
    """The caller's callbacks and the run's progress, as a worker's ``TrainingCallbacks``
    (workers/callbacks.py): train-local's worker calls it in-process; :class:`_FleetWatch` drives
    it from the launcher's polls. ``reason`` keeps the first stop asked for."""

    def __init__(self, on_step: StepCallback | None, on_eval: EvalCallback | None,
                 on_checkpoint: CheckpointCallback | None, progress: "RunProgress") -> None:
        for name, fn in (("on_step", on_step), ("on_eval", on_eval), ("on_checkpoint", on_checkpoint)):
            if fn is not None and not callable(fn):
                raise ApiError(f"{name}: expected a function of one event, got {type(fn).__name__} {fn!r}")
        self.on_step, self.on_eval, self.on_checkpoint = on_step, on_eval, on_checkpoint
        self.progress = progress
        self.reason = ""

    def _call(self, name: str, fn: Callable[[Any], object] | None, event: object, step: int) -> str:
        if fn is None:
            return ""
        try:
            answer = fn(event)
        except StopTraining as exc:
            why = f"{name} raised StopTraining at step {step}" + (f": {' '.join(str(exc).split())}" if str(exc) else "")
        except Exception as exc:
            raise CallbackError(f"{name} raised {type(exc).__name__} at step {step}: "
                                f"{' '.join(str(exc).split()) or '(no message)'}") from exc
        else:
            if answer is not STOP:
                return ""
            why = f"{name} returned STOP at step {step}"
        self.reason = self.reason or why
        return why

    def step(self, event: StepEvent) -> str:
        self.progress.update(event.step, event.total_steps, "" if event.loss != event.loss else f"loss {event.loss:.4f}")
        return self._call("on_step", self.on_step, event, event.step)

    def evaluated(self, event: EvalEvent) -> str:
        return self._call("on_eval", self.on_eval, event, event.step)

    def checkpointed(self, event: CheckpointEvent) -> str:
        return self._call("on_checkpoint", self.on_checkpoint, event, event.step)


def _progress(progress: ProgressSetting, what: str, unit: str) -> "RunProgress":
    from metaps.progress import RunProgress, progress_mode

    try:
        return RunProgress(what, progress_mode(progress), unit)
    except ValueError as exc:
        raise ApiError(f"progress: {exc}") from None


def _summary(what: str, status: str, reason: str, steps: int, wall_s: float, checkpoint: Path | None,
             auc: Mapping[str, float], extra: str = "") -> str:
    aucs = ", ".join(f"{k} {v:.4f}" for k, v in auc.items() if k.endswith("/auc") or "/" not in k)
    return (f"{what} {status}{f' ({reason})' if reason else ''}: {steps} steps in {wall_s:.1f}s{extra}"
            f"{f'; auc {aucs}' if aucs else ''}; checkpoint {checkpoint or '-'}")


def train_local(config: JobSource, *, overrides: Overrides | None = None, run_dir: PathLike | None = None,
                max_steps: int | None = None, plots: bool | None = None, on_step: StepCallback | None = None,
                on_eval: EvalCallback | None = None, on_checkpoint: CheckpointCallback | None = None,
                progress: ProgressSetting = "auto") -> TrainResult:
    """Train in this process with local tables (the parity reference), like ``metaps train-local``.

    Leaves a run directory like :func:`launch` does (``job.toml``, ``checkpoints/``, ``report.json``,
    ``tb/``, ``plots/``); everything is checked before it is made. The result holds the trained
    model in memory (``model``, ``tables``, ``predict``: the final checkpoint's).

    Callbacks run in this process, in the training loop, with one event each: ``on_step`` after
    every step (:class:`StepEvent`: step, loss, samples, total_steps, the step's metrics),
    ``on_eval`` after every periodic evaluation (``[train] eval_every_steps``) and the final one
    (:class:`EvalEvent`, ``final=True``), ``on_checkpoint`` after every checkpoint
    (:class:`CheckpointEvent`: step, path). One that returns :data:`STOP` or raises
    :class:`StopTraining` ends training after that step; the run then evaluates, writes its final
    checkpoint and report as usual, with ``status = "stopped"`` and the reason. Any other
    exception ends the run as :class:`CallbackError`.

    Args:
        config: the job TOML's path, or its sections as a mapping.
        overrides: ``{"section.key": value}`` (the CLI's ``--set``), e.g. ``{"train.max_steps": 20}``.
        run_dir: run directory, new or empty (None: ``[run] dir/<name>-<time>``, pointed at by ``latest``).
        max_steps: shorthand for ``overrides={"train.max_steps": N}``.
        plots: draw the run's ``plots/`` PNGs (``report.json`` and ``tb/`` are always written); drawing
            them takes about as long as a short run, so a quick notebook may skip them (None: the
            job's ``[run] plots``).
        on_step / on_eval / on_checkpoint: callbacks (above).
        progress: ``"auto"`` (a bar in Jupyter or on a terminal, else a line on stderr every 10 s),
            ``"bar"``, ``"lines"``, or False: nothing. A last line sums the run up.

    Returns:
        the run directory, status, training totals, checkpoint, eval AUC, report, and the model.

    Raises:
        ConfigError: a bad job, override or missing dataset (one line naming it); ApiError: a
            bad callback or progress setting; CallbackError: a callback raised.
    """
    from metaps.job import job_from_mapping
    from metaps.roles.local_run import run_local
    from metaps.run_report import flat_auc

    over = dict(overrides or {})
    if max_steps is not None:
        over["train.max_steps"] = max_steps
    data, where = _job_mapping(config, _set_texts(over))
    job = job_from_mapping(data, where=where)
    target = str(_path(run_dir, "run_dir")) if run_dir is not None else ""
    bar = _progress(progress, "train-local", "steps")
    calls = _Callbacks(on_step, on_eval, on_checkpoint, bar)
    t0 = time.monotonic()
    try:
        with _run_umask():
            rep, d = run_local(job, target, plots=plots, callbacks=calls)
    finally:
        bar.close()
    w = rep["worker"]
    ckpt = str(w.get("checkpoint") or "")
    report = {k: v for k, v in rep.items() if k != "worker"}
    res = TrainResult(run_dir=Path(d), status=str(rep["status"]), steps=int(w["steps"]), samples=int(w["samples"]),
                      samples_per_s=float(w["samples_per_s"]), checkpoint=Path(ckpt) if ckpt else None,
                      auc=_floats(flat_auc(w.get("eval") or {})), report=report, reason=str(rep.get("reason") or ""))
    bar.close(_summary("train-local", res.status, res.reason, res.steps, time.monotonic() - t0, res.checkpoint,
                       res.auc))
    return res


class _FleetWatch:
    """``api.launch``'s callbacks and progress, driven by the launcher's polls of the controller.

    At every poll (``status_every_s``, 1 s): progress from the controller's coverage (batches of
    every requested epoch done / total); ``on_step`` once the furthest worker's step has
    advanced (step: that worker's; loss: the mean of the workers' latest; samples: their sum;
    fraction: the coverage); ``on_checkpoint`` for each checkpoint committed under
    ``RUN/checkpoints/`` since the last poll. The answer is a reason to stop ('' to go on): the
    launcher then stops the fleet as on Ctrl-C (workers stopped, a final coordinated checkpoint).
    """

    def __init__(self, calls: _Callbacks, checkpoints: Path, total_steps: int) -> None:
        from common.eta import JobEta

        self.calls, self.root, self.total_steps = calls, checkpoints, total_steps
        self.eta = JobEta()
        self.last_step = 0
        self.seen: set[str] = set()

    def _new_checkpoints(self) -> list[tuple[int, Path]]:
        from ps.checkpoint import checkpoint_step

        out = []
        for p in self.root.glob("ckpt-*"):
            if p.name not in self.seen and (p / "manifest.json").is_file():
                self.seen.add(p.name)
                out.append((checkpoint_step(p), p))
        return sorted(out)

    def __call__(self, status: Mapping[str, Any] | None, workers: Mapping[int, Mapping[str, Any]]) -> str:
        import math

        reading = self.eta.from_status(status, time.monotonic())
        steps = [int(w.get("step") or 0) for w in workers.values()]
        step = max(steps, default=0)
        losses = [float(w["loss"]) for w in workers.values() if isinstance(w.get("loss"), (int, float))]
        loss = sum(losses) / len(losses) if losses else math.nan
        text = f"step {step}" + (f" loss {loss:.4f}" if losses else "") + f", {len(workers)} workers"
        if reading is not None:
            self.calls.progress.update(reading.done, reading.total, text)
        why = ""
        if step > self.last_step:
            self.last_step = step
            fraction = reading.done / reading.total if reading is not None and reading.total else None
            event = StepEvent(step, loss, sum(int(w.get("samples") or 0) for w in workers.values()),
                              self.total_steps, {}, fraction)
            why = self.calls._call("on_step", self.calls.on_step, event, step)
        for s, p in self._new_checkpoints():
            why = self.calls.checkpointed(CheckpointEvent(s, p)) or why
        return why

    def finish(self) -> None:
        """After the run: ``on_checkpoint`` for checkpoints committed since the last poll (the final one)."""
        for s, p in self._new_checkpoints():
            self.calls.checkpointed(CheckpointEvent(s, p))


def launch(config: JobSource, *, overrides: Overrides | None = None, workers: int | None = None,
           ps: int | None = None, run_dir: PathLike | None = None, resume_from: PathLike | None = None,
           timeout_s: float = 0.0, token_file: PathLike | None = None, on_step: StepCallback | None = None,
           on_eval: EvalCallback | None = None, on_checkpoint: CheckpointCallback | None = None,
           progress: ProgressSetting = "auto") -> LaunchResult:
    """Run a controller, PS shards and workers on this machine until training ends, like ``metaps launch``.

    Call it from the main thread (it handles SIGINT/SIGTERM: an interrupt stops the whole fleet).
    The launcher's live tables are off; ``progress`` draws the run's coverage instead, and the
    result holds the final checkpoint's model in memory (``model``, ``tables``, ``predict``).

    The workers are other processes, so the callbacks run here, at the launcher's polls of the
    controller (every second), not in the training loop: ``on_step`` when the furthest worker's
    step advanced since the last poll (several steps may pass between two events; step: the
    furthest worker's, loss: the mean of the workers' latest, samples: their sum, fraction: the
    controller's coverage), ``on_checkpoint`` for each checkpoint committed under
    ``RUN/checkpoints/`` (cuts and the final one), ``on_eval`` once, after the run, with the
    final evaluation when the run has one (``final=True``; a fleet's periodic evaluations stay in
    its TensorBoard).
    :data:`STOP` / :class:`StopTraining` from ``on_step`` or ``on_checkpoint`` stops the fleet as
    Ctrl-C does (workers stopped, a final coordinated checkpoint): ``status = "interrupted"``,
    ``reason`` names the callback and step, the coverage says how much ran.

    Args:
        config: the job TOML's path, or its sections as a mapping (written to a temporary file the
            fleet's processes read; the run directory keeps the effective ``job.toml``).
        overrides: ``{"section.key": value}`` (the CLI's ``--set``).
        workers / ps: worker processes and PS shards (None: ``[train] workers`` / ``[ps] shards``).
        run_dir: run directory, new or empty (None: ``[run] dir/<name>-<time>``).
        resume_from: warm start from a run dir, checkpoints dir or checkpoint.
        timeout_s: fail the run after this many seconds (0: none).
        token_file: the run's auth token file (0600): read, or created with a fresh token.
        on_step / on_eval / on_checkpoint: callbacks (above).
        progress: ``"auto"``, ``"bar"``, ``"lines"`` or False, as in :func:`train_local`
            (counted in batches of the controller's coverage).

    Returns:
        the run directory, status, reason, checkpoint, final AUC, report and model. A failed run
        is a result (``ok`` is False, ``reason`` says why), not an exception.

    Raises:
        ConfigError: a bad job, override, count, or a missing dataset (before any process starts);
            ApiError: a bad callback or progress setting; CallbackError: a callback raised (the
            fleet is stopped first).
    """
    from rich.console import Console

    from common.toml_writer import write
    from metaps.launch import LaunchConfig, Launcher

    texts = _set_texts(overrides)
    with contextlib.ExitStack() as stack:
        if isinstance(config, Mapping):
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory(prefix="metaps-job-")))
            data, _ = _job_mapping(config, [])
            path = str(write(tmp / "job.toml", data))
        else:
            path = str(_path(config, "config", must_exist=True))
        lc = LaunchConfig(config=path, workers=workers, ps=ps,
                          run_dir=str(_path(run_dir, "run_dir")) if run_dir is not None else "",
                          resume_from=str(_path(resume_from, "resume_from", must_exist=True)) if resume_from else "",
                          progress=False, timeout_s=float(timeout_s),
                          token_file=str(_path(token_file, "token_file")) if token_file is not None else "",
                          sets=tuple(texts))
        try:
            lc.validate()
        except ValueError as exc:
            raise ConfigError(f"launch(): {exc}") from None
        bar = _progress(progress, "launch", "batches")
        calls = _Callbacks(on_step, on_eval, on_checkpoint, bar)
        t0 = time.monotonic()
        try:
            with _run_umask():
                launcher = Launcher(lc, console=Console(quiet=True))
                watch = _FleetWatch(calls, launcher.run_dir / "checkpoints", launcher.job.train.max_steps)
                launcher.on_poll = watch
                code = launcher.run()
        finally:
            bar.close()
    import json

    rep = json.loads((launcher.run_dir / "report.json").read_text())
    ckpt = str(rep.get("checkpoint") or "")
    res = LaunchResult(run_dir=Path(launcher.run_dir), status=str(rep.get("status", "")),
                       reason=str(rep.get("reason") or ""), exit_code=int(code),
                       checkpoint=Path(ckpt) if ckpt else None, auc=_floats(rep.get("final_auc")),
                       coverage=str(rep.get("coverage_summary") or ""), report=rep)
    watch.finish()
    if res.auc:
        calls.evaluated(EvalEvent(max(watch.last_step, 0), dict(res.auc), final=True))
    steps = max((_int(w.get("last_step")) for w in rep.get("workers") or [] if isinstance(w, Mapping)), default=0)
    bar.close(_summary("launch", res.status, res.reason, steps, time.monotonic() - t0, res.checkpoint, res.auc,
                       f", coverage {res.coverage or '-'}"))
    return res


# ---------------------------------------------------------------------------- evaluation and delivery

def evaluate(data: PathLike, *, checkpoint: PathLike | None = None, bundle: PathLike | None = None,
             protocol: str = "episodes", k: int = 5, query_slots: int = 32, inner_steps: int | None = None,
             inner_lr: float | None = None, offset_steps: int | None = None,
             offset_prior: float | None = None) -> EvalResult:
    """Evaluate a checkpoint or a bundle without training, like ``metaps evaluate``.

    Args:
        data: a Meta-IO dataset (``episodes``, ``plain``) or Parquet/CSV (``first-k``, ``plain``).
        checkpoint: a committed checkpoint, or a run directory (its latest); exactly one of this and ``bundle``.
        bundle: a bundle directory or publish root (its LATEST).
        protocol: ``plain`` (base model on every row), ``episodes`` (the dataset's support/query
            episodes) or ``first-k`` (first ``k`` rows of each task as support, every later row scored once).
        k: support rows per task for ``first-k``.
        query_slots: query rows per ``first-k`` episode.
        inner_steps / inner_lr / offset_steps / offset_prior: override the model's ``[meta]``
            inner loop (None: the model's; ``inner_steps=0``: base only).

    Returns:
        rows, tasks, base and adapted metrics per head, and the whole report.

    Raises:
        ApiError: a missing path, or not exactly one source; ConfigError: a bad protocol or recipe.
    """
    from metaps.evaluate import evaluate_report

    if (checkpoint is None) == (bundle is None):
        raise ApiError("evaluate: give exactly one of checkpoint= and bundle=")
    rep = evaluate_report(
        _path(data, "data", must_exist=True), protocol,
        checkpoint=_path(checkpoint, "checkpoint", must_exist=True) if checkpoint is not None else None,
        bundle=_path(bundle, "bundle", must_exist=True) if bundle is not None else None,
        k=k, query_slots=query_slots, inner_steps=inner_steps, inner_lr=inner_lr, offset_steps=offset_steps,
        offset_prior=offset_prior)
    return EvalResult(protocol=protocol, rows=_int(rep.get("rows")), tasks=_int(rep.get("tasks")),
                      base=_metrics(rep.get("base")), adapted=_metrics(rep.get("adapted")), report=rep)


def deliver(out: PathLike, *, run: PathLike | None = None, checkpoint: PathLike | None = None,
            holdout: PathLike | None = None, no_gate: bool = False, incremental: bool = False, keep: int = 5,
            dtype: str = "fp32", max_chain: int = 8, max_auc_drop: float = 0.01, holdout_rows: int = 0,
            force: bool = False) -> DeliverResult:
    """Export a checkpoint as a serving bundle and publish it atomically behind the AUC gate, like ``metaps deliver``.

    Args:
        out: the publish root (versions + ``LATEST``).
        run: a run directory (its latest committed checkpoint); exactly one of this and ``checkpoint``.
        checkpoint: a checkpoint directory.
        holdout: holdout data for the AUC gate (Parquet/CSV or a Meta-IO dataset). Required unless ``no_gate``.
        no_gate: publish without the AUC gate (the manifest records ``gate.gated = false``).
        incremental: publish a delta on LATEST when possible.
        keep: versions to keep.
        dtype: row storage, ``fp32`` or ``fp16``.
        max_chain: deltas on one base before a full bundle.
        max_auc_drop: refuse when the AUC drops more than this below the published bundle's.
        holdout_rows: evaluate at most this many holdout rows (0: all).
        force: deliver even if LATEST is from the same checkpoint.

    Returns:
        the status (a gate refusal is a result: ``published`` is False, ``reason`` says why), the
        version and the bundle directory.

    Raises:
        ApiError: a missing path, not exactly one of run/checkpoint; DeliveryError: no holdout and
            no ``no_gate``, or bad input (nothing already published is touched).
    """
    from delivery.job import Status, deliver_once

    from metaps.roles.deliver import delivery_config

    if (run is None) == (checkpoint is None):
        raise ApiError("deliver: give exactly one of run= and checkpoint=")
    if holdout is None and not no_gate:
        raise ApiError("deliver: no holdout= given: bundles are published only after the holdout AUC gate; pass "
                       "holdout=DATA, or no_gate=True to publish ungated (the manifest records gate.gated = false)")
    cfg = delivery_config(
        {"out": str(_path(out, "out")), "incremental": incremental, "keep": keep, "dtype": dtype,
         "max_chain": max_chain, "max_auc_drop": max_auc_drop, "holdout_rows": holdout_rows,
         "holdout": str(_path(holdout, "holdout", must_exist=True)) if holdout is not None else ""},
        no_gate=no_gate, where="deliver()")
    o = deliver_once(cfg, run=_path(run, "run", must_exist=True) if run is not None else None,
                     checkpoint=_path(checkpoint, "checkpoint", must_exist=True) if checkpoint is not None else None,
                     force=force)
    published = o.status is Status.PUBLISHED and o.version is not None
    return DeliverResult(status=o.status.value, version=o.version, kind=o.kind, checkpoint=Path(o.checkpoint),
                         bundle=Path(cfg.out) / str(o.version) if published else None,
                         auc=_floats(o.gate.auc) if o.gate else {}, reason=o.reason)


# ---------------------------------------------------------------------------- serving

class _Scratch:
    """A temporary folder for in-memory inputs, removed with its owner."""

    def __init__(self, owner: object) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="metaps-api-"))
        weakref.finalize(owner, _remove_tree, str(self.dir))

    def input(self, data: DataInput, what: str, name: str) -> Path:
        """A path for ``data``: itself, or a ``pyarrow.Table`` written as Parquet here."""
        import pyarrow as pa
        import pyarrow.parquet as pq

        if isinstance(data, pa.Table):
            p = self.dir / f"{name}.parquet"
            pq.write_table(data, p)
            return p
        return _path(data, what, must_exist=True)

    def drop(self, path: Path) -> None:
        """Remove ``path`` if :meth:`input` wrote it here (a caller's own file is kept)."""
        if path.parent == self.dir:
            path.unlink(missing_ok=True)


def _remove_tree(path: str) -> None:
    import shutil

    shutil.rmtree(path, ignore_errors=True)


def _score(bundle: "Bundle", data: DataInput, support: Path | None, keep_columns: Sequence[str],
           batch_rows: int) -> Predictions:
    """``metaps predict``'s function into a scratch file, read back as arrays."""
    import pyarrow.parquet as pq

    from delivery.predict import predict_to_parquet

    if isinstance(keep_columns, str):
        raise ApiError(f"keep_columns: expected a list of column names, got the string {keep_columns!r}")
    bundle._served.release()  # predict_to_parquet opens the bundle itself (LMDB: once per process)
    with tempfile.TemporaryDirectory(prefix="metaps-scores-") as tmp:
        src = bundle._scratch.input(data, "data", "data")
        out = Path(tmp) / "scores.parquet"
        res = predict_to_parquet(bundle.path, src, out, batch_rows, support=support, keep_columns=list(keep_columns))
        table = pq.read_table(out)
    probs = {h: table.column(f"p_{h}").to_numpy() for h in bundle.heads}
    cols = {c: table.column(c).to_numpy(zero_copy_only=False) for c in keep_columns}
    return Predictions(bundle=res.bundle, rows=res.rows, probs=probs, columns=cols, auc=dict(res.auc),
                       adapted=res.adapted, unknown_share=float(res.unknown_share))


class Bundle:
    """A published bundle, pinned to one version: :func:`load_bundle` returns it.

    Scoring runs ``metaps predict``'s code (:func:`delivery.predict.predict_to_parquet`):
    the same column rules, the same unseen-id rows, the same adaptation.

    Attributes:
        path: the bundle's directory (one version; a later publish does not change it).
        version: its version (``v000001``...).
        heads: the model's heads (``click``, ...), the keys of :attr:`Predictions.probs`.
        tables: table name -> :class:`Table` (``.rows`` held, ``.lookup(ids)``, ``.ids()``), read
            from the bundle's chain as serving reads it.
        model: the bundle's dense network as served (the ``torch.nn.Module`` loaded from its
            ``dense`` file): it takes the flat inputs the manifest's ``dense.inputs`` names and
            returns one probability tensor per head; :meth:`predict` feeds it.
        task_key: the column that groups rows into tasks (what :meth:`adapt` adapts per).
    """

    def __init__(self, served: Any) -> None:
        self.path = Path(served.path)
        self.version = str(served.version)
        self.heads = tuple(served.heads)
        self.task_key = str(served.schema.task_key)
        self.model: torch.nn.Module = served.module
        self._served = _Served(served)
        self.tables: Mapping[str, Table] = {
            t: Table(t, _BundleRows(self._served, t, int(info.dim), int(info.rows)))
            for t, info in served.manifest.tables.items()}
        self._scratch = _Scratch(self)
        weakref.finalize(self, self._served.release)

    def __repr__(self) -> str:
        return f"Bundle({str(self.path)!r}, version={self.version!r}, heads={list(self.heads)})"

    def score_batch(self, features: "FeatureBatch") -> "dict[str, torch.Tensor]":
        """Head -> probabilities ``[*L]`` for one ``FeatureBatch`` (padding rows included), as the
        bundle serves it (:meth:`delivery.loader.ServingModel.predict`).

        Args:
            features: a batch with the bundle's feature columns (``meta_io.batch.FeatureBatch``).
        """
        out: dict[str, torch.Tensor] = self._served.get().predict(features)
        return out

    def predict(self, data: DataInput, *, keep_columns: Sequence[str] = (), batch_rows: int = 4096) -> Predictions:
        """Score every row of ``data`` with the base model.

        Args:
            data: a Parquet/CSV file or folder, or a ``pyarrow.Table``, with the bundle's feature
                columns (labels optional: present ones are evaluated).
            keep_columns: input columns returned with the scores (e.g. ``["user_id", "click"]``).
            batch_rows: rows per prediction batch.

        Returns:
            head -> probabilities per input row (input order), and AUCs of labeled heads.

        Raises:
            ApiError: a missing path; DeliveryError / DataError: data the bundle cannot read.
        """
        return _score(self, data, None, keep_columns, batch_rows)

    def adapt(self, support: DataInput) -> "AdaptedBundle":
        """The bundle adapted per task on labeled ``support`` rows (the G-Meta inner loop the model was trained with).

        Args:
            support: labeled rows (Parquet/CSV file or folder, or a ``pyarrow.Table``) with the task key column.

        Returns:
            an :class:`AdaptedBundle`: its ``predict`` scores rows of tasks with support rows after
            adapting on them, the others with the base model.

        Raises:
            ApiError: a missing path.
        """
        return AdaptedBundle(self, self._scratch.input(support, "support", f"support-{id(support)}"))


class AdaptedBundle:
    """A :class:`Bundle` with per-task support rows: :meth:`Bundle.adapt` returns it.

    Attributes:
        bundle: the base bundle.
        support: the support rows' file or folder.
    """

    def __init__(self, bundle: Bundle, support: Path) -> None:
        self.bundle = bundle
        self.support = support

    def __repr__(self) -> str:
        return f"AdaptedBundle({self.bundle!r}, support={str(self.support)!r})"

    def predict(self, data: DataInput, *, keep_columns: Sequence[str] = (), batch_rows: int = 4096) -> Predictions:
        """Score ``data``: rows of tasks with support rows after adapting on them, the others by the base model.

        Args:
            data: a Parquet/CSV file or folder, or a ``pyarrow.Table`` (the task key column included).
            keep_columns: input columns returned with the scores.
            batch_rows: rows per prediction batch.

        Returns:
            head -> probabilities per input row; ``adapted`` is True.

        Raises:
            ApiError: a missing path; DeliveryError / DataError: bad support or data.
        """
        return _score(self.bundle, data, self.support, keep_columns, batch_rows)


def load_bundle(path: PathLike) -> Bundle:
    """Load and verify a published bundle (a publish root's LATEST, or one bundle directory).

    Every file of the bundle's chain is checked against its manifest's sha256 first.

    Args:
        path: a publish root (what :func:`deliver` published to) or a bundle directory.

    Returns:
        a :class:`Bundle` pinned to that version (kept open while it lives), with ``predict``,
        ``adapt``, ``model`` and ``tables``.

    Raises:
        ApiError: a missing path; DeliveryError: not a bundle, or a corrupt one.
    """
    from delivery.loader import load_bundle as _load

    return Bundle(_load(_path(path, "bundle", must_exist=True)))
