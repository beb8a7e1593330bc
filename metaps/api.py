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
Logging goes to the ``metaps`` / subsystem loggers; nothing is printed.
"""

from __future__ import annotations

import contextlib
import copy
import logging
import os
import tempfile
import weakref
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Union

from common.errors import ConfigError, MetapsError

if TYPE_CHECKING:
    import numpy as np
    import pyarrow as pa

    from metaps.job import JobConfig

log = logging.getLogger(__name__)

PathLike = Union[str, "os.PathLike[str]"]
"""A path: ``str`` or :class:`pathlib.Path`."""
JobSource = Union[str, "os.PathLike[str]", Mapping[str, object]]
"""A job: the path of a job TOML, or the job as a mapping of sections (``{"data": {"train": ...}}``)."""
Overrides = Mapping[str, object]
"""Job-file overrides, ``{"train.max_steps": 20, "ps.shards": 1}``: the CLI's ``--set`` keys, checked the same way."""
DataInput = Union[str, "os.PathLike[str]", "pa.Table"]
"""Rows to score: a Parquet/CSV file or folder, or a ``pyarrow.Table`` with the same columns."""

__all__ = [
    "AdaptedBundle", "ApiError", "Bundle", "DataResult", "DeliverResult", "EvalResult", "LaunchResult",
    "MetaIOResult", "Predictions", "SplitResult", "TrainResult", "build_meta_io", "deliver", "evaluate",
    "generate_data", "launch", "load_bundle", "load_job", "split_holdout", "train_local",
]


class ApiError(MetapsError):
    """A bad argument to a :mod:`metaps.api` function (a wrong type, a missing path)."""


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
class TrainResult:
    """What :func:`train_local` did.

    Args:
        run_dir: the run directory (``report.json``, ``checkpoints/``, ``tb/``, ``plots/``).
        status: ``succeeded``.
        steps / samples / samples_per_s: the training totals.
        checkpoint: the last committed checkpoint (None when the job writes none).
        auc: head -> AUC on ``data.eval`` (empty without one).
        report: ``report.json``'s content.
    """

    run_dir: Path
    status: str
    steps: int
    samples: int
    samples_per_s: float
    checkpoint: Path | None
    auc: Mapping[str, float]
    report: Mapping[str, object]


@dataclass(frozen=True)
class LaunchResult:
    """What :func:`launch` did.

    Args:
        run_dir: the run directory.
        status: ``succeeded``, ``failed`` or ``interrupted``.
        reason: why it failed ('' when it succeeded).
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
def _private_umask() -> Iterator[None]:
    """The CLI's 0600/0700 rule for the run's files, for the call only (a notebook keeps its umask)."""
    from common.security import set_private_umask

    old = set_private_umask()
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
        data = copy.deepcopy(dict(config))
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

def train_local(config: JobSource, *, overrides: Overrides | None = None, run_dir: PathLike | None = None,
                max_steps: int | None = None, plots: bool | None = None) -> TrainResult:
    """Train in this process with local tables (the parity reference), like ``metaps train-local``.

    Leaves a run directory like :func:`launch` does (``job.toml``, ``checkpoints/``, ``report.json``,
    ``tb/``, ``plots/``); everything is checked before it is made.

    Args:
        config: the job TOML's path, or its sections as a mapping.
        overrides: ``{"section.key": value}`` (the CLI's ``--set``), e.g. ``{"train.max_steps": 20}``.
        run_dir: run directory, new or empty (None: ``[run] dir/<name>-<time>``, pointed at by ``latest``).
        max_steps: shorthand for ``overrides={"train.max_steps": N}``.
        plots: draw the run's ``plots/`` PNGs (``report.json`` and ``tb/`` are always written); drawing
            them takes about as long as a short run, so a quick notebook may skip them (None: the
            job's ``[run] plots``).

    Returns:
        the run directory, training totals, checkpoint, eval AUC and report.

    Raises:
        ConfigError: a bad job, override or missing dataset (one line naming it).
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
    with _private_umask():
        rep, d = run_local(job, target, plots=plots)
    w = rep["worker"]
    ckpt = str(w.get("checkpoint") or "")
    report = {k: v for k, v in rep.items() if k != "worker"}
    return TrainResult(run_dir=Path(d), status=str(rep["status"]), steps=int(w["steps"]), samples=int(w["samples"]),
                       samples_per_s=float(w["samples_per_s"]), checkpoint=Path(ckpt) if ckpt else None,
                       auc=_floats(flat_auc(w.get("eval") or {})), report=report)


def launch(config: JobSource, *, overrides: Overrides | None = None, workers: int | None = None,
           ps: int | None = None, run_dir: PathLike | None = None, resume_from: PathLike | None = None,
           timeout_s: float = 0.0, token_file: PathLike | None = None) -> LaunchResult:
    """Run a controller, PS shards and workers on this machine until training ends, like ``metaps launch``.

    Call it from the main thread (it handles SIGINT/SIGTERM: an interrupt stops the whole fleet).
    The live view is off; progress goes to the ``metaps.launch`` logger.

    Args:
        config: the job TOML's path, or its sections as a mapping (written to a temporary file the
            fleet's processes read; the run directory keeps the effective ``job.toml``).
        overrides: ``{"section.key": value}`` (the CLI's ``--set``).
        workers / ps: worker processes and PS shards (None: ``[train] workers`` / ``[ps] shards``).
        run_dir: run directory, new or empty (None: ``[run] dir/<name>-<time>``).
        resume_from: warm start from a run dir, checkpoints dir or checkpoint.
        timeout_s: fail the run after this many seconds (0: none).
        token_file: the run's auth token file (0600): read, or created with a fresh token.

    Returns:
        the run directory, status, reason, checkpoint, final AUC and report. A failed run is a
        result (``ok`` is False, ``reason`` says why), not an exception.

    Raises:
        ConfigError: a bad job, override, count, or a missing dataset (before any process starts).
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
        with _private_umask():
            launcher = Launcher(lc, console=Console(quiet=True))
            code = launcher.run()
    import json

    rep = json.loads((launcher.run_dir / "report.json").read_text())
    ckpt = str(rep.get("checkpoint") or "")
    return LaunchResult(run_dir=Path(launcher.run_dir), status=str(rep.get("status", "")),
                        reason=str(rep.get("reason") or ""), exit_code=int(code),
                        checkpoint=Path(ckpt) if ckpt else None, auc=_floats(rep.get("final_auc")),
                        coverage=str(rep.get("coverage_summary") or ""), report=rep)


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
        tables: embedding table -> rows held.
        task_key: the column that groups rows into tasks (what :meth:`adapt` adapts per).
    """

    def __init__(self, path: Path, version: str, heads: Sequence[str], tables: Mapping[str, int],
                 task_key: str) -> None:
        self.path = path
        self.version = version
        self.heads = tuple(heads)
        self.tables = dict(tables)
        self.task_key = task_key
        self._scratch = _Scratch(self)

    def __repr__(self) -> str:
        return f"Bundle({str(self.path)!r}, version={self.version!r}, heads={list(self.heads)})"

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
        a :class:`Bundle` pinned to that version, with ``predict`` and ``adapt``.

    Raises:
        ApiError: a missing path; DeliveryError: not a bundle, or a corrupt one.
    """
    from delivery.loader import load_bundle as _load

    served = _load(_path(path, "bundle", must_exist=True))
    try:
        return Bundle(path=Path(served.path), version=str(served.version), heads=list(served.heads),
                      tables={t: int(info.rows) for t, info in served.manifest.tables.items()},
                      task_key=str(served.schema.task_key))
    finally:
        served.close()
