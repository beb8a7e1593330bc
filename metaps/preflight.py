"""Preflight: find every deterministic configuration or data error before any process starts.

``metaps launch`` calls :func:`preflight` once, after it parsed the job file and
before it creates the run directory or starts a process; ``metaps train-local``
calls it too. Without it, a typo in ``[[ps.tables]]`` or a truncated dataset
surfaced only inside the PS or a worker, after several agent restarts.

What it checks (cheap: nothing is trained, data batches are not read)::

    data        data.train (and data.eval, data.validation) exist and are Meta-IO datasets: manifest,
                index (crc32), every file's size, Arrow footer and frame crc32
                (see meta_io.integrity); their columns match the job's schema;
                data.schema, when set, loads
    tables      [[ps.tables]] and model.table_dims name only tables of the
                schema; every feature's table resolves (the same code the PS and
                the workers use: JobConfig.table_configs); the model builds
    resume      --resume-from: the checkpoint's manifest, the sha256 and size of
                every file it lists, and its table dims vs the job's
    policy      [controller] policy = "dd" only with [train] dense_sync = "allreduce"
                (DD sets per-worker batch sizes of all-reduce workers; PS-mode
                workers would drop every batch-size command)

Every problem found is collected and reported together, in one line::

    metaps launch: error: preflight: 2 problems: [[ps.tables]] overrides unknown table(s) ['itme'] ...; ...

Example::

    job = load_job("configs/local.toml")
    preflight(job, resume="runs/local/runs/latest/checkpoints/ckpt-40")   # raises PreflightError
"""

from __future__ import annotations

import contextlib
import logging
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, Iterator

from common.errors import ConfigError, MetapsError
from common.log import kv

if TYPE_CHECKING:
    from metaps.job import JobConfig

log = logging.getLogger(__name__)


class PreflightError(ConfigError):
    """One or more deterministic problems with a job, its data or its resume checkpoint.

    Args:
        problems: one line each (file, field, expected vs got).
    """

    def __init__(self, problems: list[str]) -> None:
        self.problems = list(problems)
        n = len(self.problems)
        head = "preflight: " + (f"{n} problems: " if n > 1 else "")
        super().__init__(head + "; ".join(p.replace("\n", " ") for p in self.problems))


def _check(problems: list[str], fn: Callable[[], Any], where: str = "") -> Any:
    """Run one check; a deliberate error (or a config ValueError) becomes a problem line.

    ``where`` prefixes the messages of plain ValueErrors (ours already name their file).
    """
    try:
        return fn()
    except MetapsError as exc:
        problems.append(str(exc).strip().replace("\n", " "))
    except (ValueError, KeyError, OSError) as exc:
        msg = str(exc) if not isinstance(exc, KeyError) else f"missing key {exc}"
        problems.append((f"{where}: " if where else "") + msg.strip().replace("\n", " "))
    return None


@contextlib.contextmanager
def _quiet(name: str) -> Iterator[None]:
    """Raise logger ``name`` to WARNING for the block (INFO chatter on stderr is not part of a report)."""
    lg = logging.getLogger(name)
    old = lg.level
    lg.setLevel(max(old, logging.WARNING))
    try:
        yield
    finally:
        lg.setLevel(old)


def _dataset(path: str, what: str, source: str = "") -> Any:
    """Open a Meta-IO dataset the cheap way and check every file's frame; returns it.

    A missing dataset says which command builds it (:func:`metaps.job.build_hint`).
    """
    from meta_io.reader import MetaIODataset
    from common.errors import DataError
    from metaps.job import build_hint

    p = Path(path)
    if not p.exists():
        raise DataError(f"{what} = {path}: no such directory; {build_hint(path, source)}")
    ds = MetaIODataset(p)
    ds.check_files()
    return ds


def _same_layout(train: Any, validation: Any) -> None:
    """The validation batches go through the training step: they must be laid out like the train set's."""
    from common.errors import DataError

    a, b = train.manifest.get("layout", "meta"), validation.manifest.get("layout", "meta")
    if a != b:
        raise DataError(f"data.validation = {validation.path}: layout '{b}', but data.train is '{a}' "
                        f"(build both with the same --layout)")


def _columns(ds: Any, what: str, want: list[str]) -> None:
    from common.errors import DataError

    if list(ds.manifest.get("columns", [])) != want:
        raise DataError(f"{what} = {ds.path}: columns {ds.manifest.get('columns')} do not match the job's schema "
                        f"{want} (built from another schema?)")


def _support_size(ds: Any, job: "JobConfig") -> None:
    """``[meta] inner_loss_reduction = "sum_per_support"`` divides the inner loss by
    ``inner_support_size``: it must be the training layout's support rows per task."""
    from common.errors import ConfigError
    from models.meta_config import InnerReduction

    meta = job.meta
    if meta.inner_loss_reduction is not InnerReduction.SUM_PER_SUPPORT or ds.manifest.get("layout") != "meta":
        return
    support = int(ds.manifest.get("support", 0))
    if support != meta.inner_support_size:
        raise ConfigError(f"[meta] inner_support_size = {meta.inner_support_size} but data.train = {ds.path} has "
                          f"{support} support rows per task (inner_loss_reduction = 'sum_per_support' needs them equal)")


def _dd_policy(job: "JobConfig") -> None:
    """``[controller] policy = "dd"`` needs all-reduce workers: only they train controller-set batch sizes."""
    from controller.config import PolicyKind
    from common.errors import ConfigError
    from workers.config import DenseSync

    if job.controller.policy == PolicyKind.DD and job.train.dense_sync != DenseSync.ALLREDUCE:
        got = job.train.dense_sync.value if isinstance(job.train.dense_sync, DenseSync) else job.train.dense_sync
        raise ConfigError(f"{job.source or '<job>'}: [controller] policy = 'dd' needs [train] dense_sync = "
                          f"'allreduce' (DD sets the batch sizes of all-reduce workers), got dense_sync = '{got}'")


def _resume(ckpt: str, job: "JobConfig", problems: list[str]) -> None:
    from ps.checkpoint import verify_checkpoint

    manifest = _check(problems, lambda: verify_checkpoint(ckpt))
    if manifest is None:
        return
    try:
        tables = {t.name: t.dim for t in job.table_configs()}
    except (MetapsError, ValueError):
        return  # already reported by the table check
    for name, info in sorted(manifest.get("tables", {}).items()):
        if name in tables and int(info.get("dim", -1)) != tables[name]:
            problems.append(f"--resume-from {ckpt}: table '{name}' has dim {info.get('dim')} in the checkpoint, "
                            f"the job says {tables[name]}")


def preflight(job: "JobConfig", resume: str | Path = "", build_model: bool = True) -> None:
    """Check a job's data, tables and resume checkpoint; raise once with every problem.

    Args:
        job: the parsed job (``metaps.job.load_job``).
        resume: a resolved checkpoint directory ('' = cold start).
        build_model: also build the model once (catches model/schema mismatches).

    Raises:
        PreflightError: one line listing every problem found.
    """
    t0 = time.perf_counter()
    problems: list[str] = []
    _check(problems, lambda: _dd_policy(job))
    datasets = {"data.train": _check(problems, lambda: _dataset(job.data.train, "data.train", job.source))}
    if job.data.eval:
        datasets["data.eval"] = _check(problems, lambda: _dataset(job.data.eval, "data.eval", job.source))
    if job.data.validation:
        datasets["data.validation"] = _check(problems, lambda: _dataset(job.data.validation, "data.validation",
                                                                        job.source))
        if datasets["data.train"] is not None and datasets["data.validation"] is not None:
            _check(problems, lambda: _same_layout(datasets["data.train"], datasets["data.validation"]))
    if datasets["data.train"] is not None:
        _check(problems, lambda: _support_size(datasets["data.train"], job), job.source or "<job>")
    schema = None
    if job.data.schema or (Path(job.data.train) / "manifest.json").is_file():  # else: reported above
        schema = _check(problems, job.schema)
    if schema is not None:
        from meta_io.source import normalized_arrow_schema

        want = normalized_arrow_schema(schema).names
        for what, ds in datasets.items():
            if ds is not None:
                _check(problems, lambda: _columns(ds, what, want))
        where = job.source or "<job>"
        n = len(problems)
        # each side on its own, so typos in both places are both reported
        _check(problems, lambda: job.ps.table_configs(schema.tables), where)
        _check(problems, lambda: job.model.embedding_dims(schema.tables), where)
        if len(problems) == n:
            _check(problems, job.table_configs, where)  # dims merged as the PS and workers will
        if build_model and len(problems) == n:
            from models.factory import build_model as _build

            with _quiet("models"):  # its "built model" line would precede the launch's one-line report
                _check(problems, lambda: _build(schema, job.model), f"{where}: [model]")
    if resume:
        _resume(str(resume), job, problems)
    if problems:  # the caller reports it (the CLI: one line on stderr); no log line, so it is said once
        raise PreflightError(problems)
    log.debug("preflight ok", extra=kv(train=job.data.train, eval=job.data.eval or "-", resume=str(resume) or "-",
                                      seconds=round(time.perf_counter() - t0, 2)))
