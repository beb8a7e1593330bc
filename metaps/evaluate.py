"""``metaps evaluate``: evaluate a checkpoint or a bundle under a chosen protocol, without training.

Examples::

    metaps evaluate --checkpoint runs/main/checkpoints/ckpt-900 --data runs/main/split/holdout \\
        --protocol first-k --k 5 --out report.json
    metaps evaluate --bundle bundles --data holdout-metaio --protocol episodes --inner-steps 3 --inner-lr 0.05

The model and its rows come from the checkpoint (every table read once, the
dense parameters from its ``d/`` chunks) or from the bundle (``adapt_params.npz``
and its LMDB rows). Unseen ids read the PS's initial row (the bundle's
``adapt.init``; for a checkpoint, its ``[ps]`` config), as in training. The inner
loop is the one the model was trained with (``[meta]`` of the checkpoint, the
bundle's recipe), overridable with ``--inner-steps`` / ``--inner-lr`` / ``--inner-lr-rows`` (and the logit
offset's ``--offset-steps`` / ``--offset-prior``, ``[meta] offset_steps``); it also
runs for plain-trained models ("plain model + the same fine-tuning").

Output: one JSON object (``--out`` written atomically; stdout gets the JSON, or
a short human summary when stdout is a terminal). Protocols and metrics:
:mod:`workers.eval_protocols`.

Progress on stderr, in batches scored: a bar on a terminal, else (or with
``--no-progress``) ``msg="progress" what=evaluate`` log lines every 5 s and at the end,
with the total known ahead for ``episodes`` (the dataset's batches) and ``first-k`` (its
episodes / 64 per batch; the rows are read once, before the layout), and counts and a
rate for ``plain``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

from common.errors import ConfigError
from common.eta import ProgressHook
from common.log import kv

log = logging.getLogger(__name__)

PROTOCOLS = ("plain", "episodes", "first-k")
"""The evaluation protocols (:mod:`workers.eval_protocols`)."""


def register(sub: argparse._SubParsersAction) -> None:
    e = sub.add_parser("evaluate", help="evaluate a checkpoint or bundle (plain / episodes / first-k; base vs adapted)")
    src = e.add_mutually_exclusive_group(required=True)
    src.add_argument("--checkpoint", type=Path,
                     help="a committed checkpoint directory, or a run directory (its newest committed checkpoint)")
    src.add_argument("--bundle", type=Path, help="a bundle directory or publish root (LATEST)")
    e.add_argument("--data", type=Path, required=True,
                   help="evaluation data: a Meta-IO dataset (episodes, plain) or Parquet/CSV (first-k, plain)")
    e.add_argument("--protocol", choices=list(PROTOCOLS), default="episodes",
                   help="plain: base model on every row; episodes: the dataset's support/query episodes; "
                        "first-k: first K rows of each task by time as support, every later row scored once "
                        "(default episodes)")
    e.add_argument("--k", type=int, default=5, help="support rows per task for first-k (default 5)")
    e.add_argument("--query-slots", type=int, default=32, help="query rows per first-k episode (default 32)")
    e.add_argument("--inner-steps", type=int, default=None,
                   help="inner SGD steps of the adapted score (default: the model's [meta]; 0 = no gradient step: "
                        "base only, or the offset alone with --offset-steps N)")
    e.add_argument("--inner-lr", type=float, default=None,
                   help="inner learning rate of the dense parameters (default: the model's [meta])")
    e.add_argument("--inner-lr-rows", type=float, default=None,
                   help="inner learning rate of the embedding rows (default: the model's [meta]; 0 = --inner-lr)")
    e.add_argument("--offset-steps", type=int, default=None,
                   help="Newton iterations of the per-task logit offset (default: the model's [meta]; 0 = off)")
    e.add_argument("--offset-prior", type=float, default=None,
                   help="prior precision of the logit offset (default: the model's [meta])")
    e.add_argument("--out", type=Path, default=None, help="write the report (one JSON object) here, atomically")
    e.add_argument("--no-progress", action="store_true",
                   help="no progress bar; a progress log line every 5 s and at the end (as off a terminal)")
    e.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1, as metaps deliver: small tensor ops, a shared box)")
    e.set_defaults(func=_evaluate)


def checkpoint_dir(path: Path) -> Path:
    """The committed checkpoint ``--checkpoint PATH`` names, resolved once for every reader.

    ``PATH`` may be a checkpoint (``.../checkpoints/ckpt-N``, its ``manifest.json`` present),
    a run directory (its newest committed checkpoint under ``checkpoints/``) or a run's
    ``checkpoints/`` folder itself. The model, its rows and the inner loop's learned rates
    (Meta-SGD's ``meta_learner.*`` dense values) are all read from the returned directory:
    a reader handed the unresolved run path would find no checkpoint there.

    Args:
        path: what the user gave.

    Raises:
        DeliveryError: no such directory, or it holds no committed checkpoint (one line).
    """
    from delivery.bundle import DeliveryError
    from delivery.export import resolve_checkpoint
    from ps.checkpoint import latest_checkpoint

    if (path / "manifest.json").is_file():
        return path
    if path.name == "checkpoints" and path.is_dir() and not (path / "checkpoints").is_dir():
        newest = latest_checkpoint(path)
        if newest is None:
            raise DeliveryError(f"{path}: no committed checkpoint (ckpt-<step> with its manifest) in this folder")
        return Path(newest)
    return resolve_checkpoint(run=path)


def _from_checkpoint(ckpt: Path) -> tuple[Any, Any, Any, dict[str, Any]]:
    """Model, rows, schema and source of a resolved checkpoint (:func:`checkpoint_dir`)."""
    from delivery.adapt import adapt_recipe, unseen_initializers
    from delivery.export import CheckpointSource, build_trained_model
    from workers.eval_protocols import FixedRows

    src = CheckpointSource.open(ckpt)
    model, dims = build_trained_model(src)
    recipe = adapt_recipe(src.info, list(dims), str(src.path))
    rows = {}
    for t in dims:
        data = src.table(t)
        rows[t] = (data.ids, data.weights())
    return model, FixedRows(rows, unseen_initializers(recipe, dims)), src.schema, {
        "checkpoint": str(src.path), "step": src.step, "recipe": recipe}


class _BundleRows:
    """Rows of a loaded bundle through its chain (unseen ids: its initial rows)."""

    def __init__(self, served: Any) -> None:
        self.served = served

    def pull(self, ids: dict[str, Any], step: int | None = None) -> dict[str, Any]:
        out = {}
        for t, v in ids.items():
            found, r = self.served._lookup_unique(t, v)
            self.served.count_lookups(found)
            out[t] = r
        return out


def _inner_loop(model: Any, meta: Any, fixed_rate: bool, checkpoint: Path | None, served: Any,
                recipe: Any = None) -> Any:
    """The recipe with its learned inner rates (``[meta] learn_inner_lr``), unless ``fixed_rate``: a rate was
    given (``--inner-lr`` / ``--inner-lr-rows``), which fixes the rates."""
    from models.meta_learner import MetaLearner

    if fixed_rate and meta.meta_emb:  # a fixed rate, but the MetaEmb generator still ships
        meta = dataclasses.replace(meta, learn_inner_lr="off")
    learner = MetaLearner(model, meta)
    if (fixed_rate and not meta.meta_emb) or not learner.has_parameters:
        return meta
    if served is not None:
        import numpy as np

        with np.load(served.path / str(served.manifest.adapt.get("params", "adapt_params.npz"))) as z:
            values = {k: z[k] for k in z.files}
    else:
        from delivery.export import CheckpointSource

        assert checkpoint is not None  # a checkpoint source when there is no bundle
        values = CheckpointSource.open(checkpoint).dense([n for n, _ in learner.store_named_parameters()])
    learner.load_dense(values)
    if learner.meta_emb:
        from delivery.adapt import unseen_initializers

        learner.set_init_rows(unseen_initializers(recipe or {}, dict(model.dims)))
    return learner


def evaluate_report(data: Path, protocol: str = "episodes", *, checkpoint: Path | None = None,
                    bundle: Path | None = None, k: int = 5, query_slots: int = 32, inner_steps: int | None = None,
                    inner_lr: float | None = None, inner_lr_rows: float | None = None, offset_steps: int | None = None,
                    offset_prior: float | None = None, progress: ProgressHook | None = None) -> dict[str, Any]:
    """Evaluate a checkpoint or a bundle on ``data``: what ``metaps evaluate`` runs (without printing).

    Args:
        data: a Meta-IO dataset (episodes, plain) or Parquet/CSV (first-k, plain).
        protocol: ``plain``, ``episodes`` or ``first-k``.
        checkpoint: a committed checkpoint directory, or a run directory (or its ``checkpoints/``): its newest
            committed checkpoint (:func:`checkpoint_dir`); exactly one of this and ``bundle``.
        bundle: a bundle directory or publish root (LATEST).
        k / query_slots: support rows per task and query rows per episode of ``first-k``.
        inner_steps / inner_lr / inner_lr_rows / offset_steps / offset_prior: override the model's ``[meta]`` recipe
            (None: the model's; ``inner_steps=0``: base only, or the offset alone when ``offset_steps > 0``
            is given: every recipe the deliver gate can serve, :meth:`delivery.adapt.Recipe.evaluate_args`).
        progress: told ``("evaluate", batches scored, batches in all)`` before the first batch and after
            each (:func:`scored_batches`); None: nothing told.

    Returns:
        the report: ``protocol``, ``data``, ``source``, ``meta``, ``rows``, ``tasks``, ``base``
        (head -> metrics) and, when adapted, ``adapted`` and ``gain``; with inner steps ``inner_diverged``
        (``episodes``, ``diverged``, ``share``: adapted episodes whose inner steps raised the support loss
        or left it non-finite; a warning is logged above ``delivery.adapt_select.DIVERGED_WARN``).

    Raises:
        ConfigError: not exactly one source, an unknown protocol, or a bad recipe override.
    """
    from models.meta_config import MetaConfig
    from common.config import from_mapping, to_dict
    from workers.eval_protocols import evaluate_protocol, protocol_batches

    if (checkpoint is None) == (bundle is None):
        raise ConfigError("evaluate: give exactly one of a checkpoint and a bundle")
    if protocol not in PROTOCOLS:
        raise ConfigError(f"evaluate: unknown protocol {protocol!r}; known: {list(PROTOCOLS)}")
    served = None
    ckpt: Path | None = None
    if checkpoint is not None:
        ckpt = checkpoint_dir(Path(checkpoint))  # a run dir -> its newest committed checkpoint, for every reader
        model, rows, schema, source = _from_checkpoint(ckpt)
    else:
        from delivery.adapt import AdaptingModel
        from delivery.loader import load_bundle

        assert bundle is not None  # exactly one source, checked above
        served = load_bundle(Path(bundle))
        adapting = AdaptingModel(served)
        model, rows, schema = adapting.model, _BundleRows(served), served.schema
        source = {"bundle": str(served.path), "version": served.version, "recipe": served.manifest.adapt}
    try:
        meta = overridden_meta(from_mapping(MetaConfig, source["recipe"]["meta"], where="adaptation recipe"),
                               inner_steps=inner_steps, inner_lr=inner_lr, inner_lr_rows=inner_lr_rows,
                               offset_steps=offset_steps, offset_prior=offset_prior)
        loop = _inner_loop(model, meta, inner_lr is not None or inner_lr_rows is not None, ckpt, served,
                           source["recipe"])
        batches, total = _batches(protocol, Path(data), schema, k, query_slots)
        batches = scored_batches(batches, total, progress)
        res = evaluate_protocol(model, rows, batches, loop, adapt=meta.adapts, task_key=schema.task_key)
    finally:
        if served is not None:
            served.close()
    source.pop("recipe", None)
    div = res.get("inner_diverged")
    if div:
        from delivery.adapt_select import DIVERGED_WARN

        if div["share"] > DIVERGED_WARN:
            log.warning("inner step diverged", extra=kv(what=divergence_text(div), inner_steps=meta.inner_steps,
                                                        inner_lr=meta.inner_lr))
    return {"protocol": protocol, "data": str(data), "source": source, "meta": to_dict(meta),
            **({"k": k} if protocol == "first-k" else {}), **res}


def overridden_meta(meta: Any, *, inner_steps: int | None = None, inner_lr: float | None = None,
                    inner_lr_rows: float | None = None, offset_steps: int | None = None,
                    offset_prior: float | None = None) -> Any:
    """The model's ``[meta]`` with ``metaps evaluate``'s recipe flags applied (None: the model's value;
    ``inner_steps=0`` without ``offset_steps`` turns the offset off too: base only).

    Args:
        meta: the model's :class:`~models.meta_config.MetaConfig`.
        inner_steps / inner_lr / inner_lr_rows / offset_steps / offset_prior: the flags' values.

    Raises:
        ConfigError: the result is not a valid recipe (the MetaConfig's message).
    """
    over: dict[str, Any] = {}
    if inner_steps is not None:
        over["inner_steps"] = inner_steps
    if inner_lr is not None:
        over["inner_lr"] = inner_lr
    if inner_lr_rows is not None:
        over["inner_lr_rows"] = inner_lr_rows
    if offset_steps is not None:
        over["offset_steps"] = offset_steps
    elif inner_steps == 0:  # base only, unless --offset-steps asks for the offset alone
        over["offset_steps"] = 0
    if offset_prior is not None:
        over["offset_prior"] = offset_prior
    try:
        return dataclasses.replace(meta, **over)
    except ValueError as exc:
        raise ConfigError(f"metaps evaluate: {exc}") from None


FIRST_K_TASKS_PER_BATCH = 64
"""Episodes per first-k meta batch (:func:`workers.eval_protocols.protocol_batches`' default)."""


def _batches(protocol: str, data: Path, schema: Any, k: int, query_slots: int) -> tuple[Iterator[Any], int]:
    """``(the protocol's batches, how many there will be)`` (0: not known ahead: plain).

    episodes: the Meta-IO dataset's batch count; first-k: its episodes / ``FIRST_K_TASKS_PER_BATCH``,
    from the rows read once (the layout is computed before the batches are cut).
    """
    from meta_io.layout import INDEX_NAME, MANIFEST_NAME
    from workers.eval_protocols import protocol_batches

    meta_io = data.is_dir() and (data / MANIFEST_NAME).is_file() and (data / INDEX_NAME).is_file()
    if protocol == "first-k" and data.exists() and not meta_io:
        from meta_io.firstk import first_k_batches, first_k_layout, read_table

        table = read_table(data, schema)
        if schema.timestamp and k >= 1 and query_slots >= 1:
            lay = first_k_layout(table.column(schema.task_key).to_numpy(), table.column(schema.timestamp).to_numpy(), k)
            episodes = int(lay.episodes(query_slots).task.shape[0])
            total = -(-episodes // FIRST_K_TASKS_PER_BATCH)
        else:
            total = 0  # first_k_batches names what is wrong
        return first_k_batches(table, schema, k, query_slots, FIRST_K_TASKS_PER_BATCH), total
    batches = protocol_batches(protocol, data, schema, k=k, query_slots=query_slots)
    if protocol == "episodes":
        from meta_io.reader import MetaIODataset

        return batches, int(MetaIODataset(data).total_batches)
    return batches, 0


def scored_batches(batches: Iterable[Any], total: int, progress: ProgressHook | None) -> Iterator[Any]:
    """``batches`` as they are, telling ``progress("evaluate", done, total)`` before the first and after each is
    scored (the consumer asked for the next); a total of 0 stays unknown, a low one grows to ``done``."""
    if progress is None:
        yield from batches
        return
    done = 0
    progress(EVALUATE_STAGE, 0, total)
    for b in batches:
        yield b
        done += 1
        progress(EVALUATE_STAGE, done, max(total, done) if total else 0)


EVALUATE_STAGE = "evaluate"
"""The progress stage ``metaps evaluate`` tells (units: batches scored)."""


def _evaluate(args: argparse.Namespace) -> int:
    from common.atomic_write import write_text_atomic
    from metaps.progress import command_progress
    from metaps.roles.deliver import set_threads

    set_threads(args.threads, "metaps evaluate")
    with command_progress(args.no_progress) as progress:
        report = evaluate_report(args.data, args.protocol, checkpoint=args.checkpoint, bundle=args.bundle, k=args.k,
                                 query_slots=args.query_slots, inner_steps=args.inner_steps, inner_lr=args.inner_lr,
                                 inner_lr_rows=args.inner_lr_rows,
                                 offset_steps=args.offset_steps, offset_prior=args.offset_prior, progress=progress)
    text = json.dumps(report, default=float)
    if args.out is not None:
        write_text_atomic(args.out, text + "\n")
    if sys.stdout.isatty():
        print(_summary(report))
    else:
        print(text)
    return 0


def divergence_text(div: dict[str, Any]) -> str:
    """``inner step raised the support loss on 37% of 240 episodes`` from a report's ``inner_diverged``."""
    return f"inner step raised the support loss on {100 * div['share']:.0f}% of {div['episodes']} episodes"


def _summary(report: dict[str, Any]) -> str:
    lines = [f"evaluate {report['protocol']}: {report['rows']:,} rows, {report.get('tasks') or '-'} tasks "
             f"({report['data']})"]
    for head, m in report["base"].items():
        line = f"  {head:<11} base auc {m['auc']:.4f}"
        if "gauc" in m:
            line += f" gauc {m['gauc']:.4f}"
        if "adapted" in report and head in report["adapted"]:
            a = report["adapted"][head]
            line += f" | adapted auc {a['auc']:.4f} ({a['auc'] - m['auc']:+.4f})"
        lines.append(line)
    if report.get("inner_diverged"):
        lines.append(f"  {divergence_text(report['inner_diverged'])}")
    return "\n".join(lines)
