"""``metaps predict``: score data with a published bundle; evaluate only when labels are present.

Input: a Parquet/CSV file or folder read with the bundle's schema, or a Meta-IO
dataset. Serving data usually has no labels and never has the generator's
oracle columns, so the file columns read are the model's features only (id,
multi-hot, text, vector, dense columns and the scenario column), plus each
label column that *every* input file has. Heads whose label is present are
evaluated (streaming AUC over the real rows); the others are only scored.

With ``support`` (labeled rows of the same schema), each task key's rows are
scored after adapting on that task's support rows (grouped by the task key column,
also when it is of kind ``key``, i.e. not a feature) (``ServingModel.adapt``:
vectorized over tasks); tasks without support are scored by the base model. The
adaptation is the bundle's served recipe (:mod:`delivery.adapt`): the one the deliver
gate chose on its holdout (``gate.adapt.choice``), else the configured one; the result
names it (``recipe``, ``recipe_from``).
When more than ``warn_unknown`` of the looked-up ids are unknown to the bundle,
a warning is logged (and printed by the CLI): the data is probably not from
the model's domain.

Output: one Parquet file, ``row`` (0-based input row), ``p_<head>`` per head, and
the ``keep_columns`` copied verbatim from the input (e.g. a key and a label:
a string task key comes out as the raw string, not its int64 hash),
written beside ``--out`` and renamed over it at the end
(:func:`common.atomic_write.atomic_output`), so a failure at any point leaves no
file (or the previous one) at ``--out``.

Example::

    res = predict_to_parquet("bundles/", "day2.parquet", "scores.parquet")
    res.rows, res.auc          # {} when the data has no labels
"""

from __future__ import annotations

import dataclasses
import logging
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from delivery.bundle import DeliveryError
from meta_io.batch import FeatureBatch
from meta_io.schema import ID_KINDS, ColumnKind, Schema
from common.atomic_write import atomic_output
from common.evaluation import StreamingAUC
from common.log import kv

log = logging.getLogger(__name__)

FEATURE_KINDS = (*ID_KINDS, ColumnKind.VECTOR, ColumnKind.DENSE)


@dataclass(frozen=True)
class PredictResult:
    """What one ``metaps predict`` wrote.

    Args:
        bundle: the bundle version used.
        rows: rows scored (written).
        out: the output file.
        unknown_ids: ids not in the bundle (scored with zero rows).
        labels: the label columns found (evaluated heads); empty for unlabeled data.
        auc: head -> AUC over the real rows (only heads whose label is present).
        looked_up_ids: distinct ids looked up, summed over batches (the denominator of the share).
        unknown_share: unknown_ids / looked_up_ids.
        warn_unknown: the share is above the warning threshold.
        adapted: rows were scored after per-task adaptation on ``--support``.
        recipe: the adaptation applied (:attr:`delivery.adapt.Recipe.name`; '' without ``--support``).
        recipe_from: ``gate`` (chosen on the deliver gate's holdout) or ``configured``.
    """

    bundle: str
    rows: int
    out: Path
    unknown_ids: int
    labels: list[str] = field(default_factory=list)
    auc: dict[str, float] = field(default_factory=dict)
    looked_up_ids: int = 0
    unknown_share: float = 0.0
    warn_unknown: bool = False
    adapted: bool = False
    recipe: str = ""
    recipe_from: str = ""


def serving_schema(schema: Schema, files: list[Path], task_key: bool = False) -> Schema:
    """The columns ``metaps predict`` reads: features, the scenario, and the labels every file has.

    Args:
        schema: the bundle's (training) schema.
        files: the input files (their column names decide which labels are present).
        task_key: read the task key column too (``--support`` groups rows by it), also
            when it is of kind ``key`` (not a feature).
    """
    from meta_io.source.files import _file_columns

    have = [set(_file_columns(f).names) for f in files]
    present = [lab for lab in schema.labels if all(lab in h for h in have)]
    cols = [c for c in schema.columns if c.kind in FEATURE_KINDS or c.name == schema.scenario or c.name in present
            or (task_key and c.name == schema.task_key)]
    return dataclasses.replace(schema, columns=cols, labels=present, oracle={}, timestamp="")


def _batches(
    data: Path, schema: Schema, batch_rows: int, with_keys: bool = False
) -> tuple[Iterator[tuple[FeatureBatch, np.ndarray | None]], list[str]]:
    """((feature batch, task key per row or None), labels present) for a Meta-IO dataset or Parquet/CSV input.

    Args:
        with_keys: read the task key column of Parquet/CSV input (its int64 keys, for ``--support``).
    """
    from meta_io.layout import INDEX_NAME, MANIFEST_NAME, MASK_COL

    if not data.exists():
        raise DeliveryError(f"{data}: data to score not found")
    if data.is_dir() and (data / MANIFEST_NAME).is_file() and (data / INDEX_NAME).is_file():
        from delivery.gate import holdout_batches

        return ((fb, None) for fb in holdout_batches(data, schema, batch_rows)), list(schema.labels)
    from meta_io.reader import BatchConverter
    from meta_io.source import iter_source, list_source_files

    view = serving_schema(schema, list_source_files(data), task_key=with_keys)
    conv = BatchConverter(view)

    def gen() -> Iterator[tuple[FeatureBatch, np.ndarray | None]]:
        for sb in iter_source(data, view, batch_rows, validate_schema=False):
            tab = sb.table.append_column(MASK_COL, pa.array(np.ones(sb.num_rows, dtype=bool)))
            for rb in tab.to_batches(max_chunksize=batch_rows):
                keys = rb.column(schema.task_key).to_numpy(zero_copy_only=False) if with_keys else None
                yield conv.plain(rb).features, keys

    return gen(), list(view.labels)


class _RawColumns:
    """Input columns passed through verbatim (``--keep-columns``), streamed in the scoring order.

    Files are read in the order :func:`meta_io.source.list_source_files` gives
    (the order ``iter_source`` scores them); :meth:`take` hands out the next ``n`` rows.
    """

    def __init__(self, files: list[Path], names: list[str]) -> None:
        from meta_io.source.files import _file_columns

        for f in files:
            have = set(_file_columns(f).names)
            missing = [n for n in names if n not in have]
            if missing:
                raise DeliveryError(f"{f}: --keep-columns names {missing}, not columns of this file "
                                    f"(it has {sorted(have)[:12]})")
        self.files, self.names = files, names
        self._it = self._batches()
        self._buf: list[pa.Table] = []
        self._have = 0

    def _batches(self) -> Iterator[pa.Table]:
        import pyarrow.csv as pacsv

        for f in self.files:
            if f.suffix.lower() in (".csv", ".tsv"):
                opts = pacsv.ParseOptions(delimiter="\t" if f.suffix.lower() == ".tsv" else ",")
                reader = pacsv.open_csv(f, parse_options=opts,
                                        convert_options=pacsv.ConvertOptions(include_columns=self.names))
                for rb in reader:
                    yield pa.Table.from_batches([rb])
            else:
                for rb in pq.ParquetFile(f).iter_batches(columns=self.names):
                    yield pa.Table.from_batches([rb])

    def take(self, n: int) -> pa.Table:
        while self._have < n:
            try:
                t = next(self._it)
            except StopIteration:
                raise DeliveryError(f"--keep-columns: the input has fewer rows than were scored ({self._have} < {n})") from None
            self._buf.append(t)
            self._have += t.num_rows
        whole = pa.concat_tables(self._buf)
        out, rest = whole.slice(0, n), whole.slice(n)
        self._buf, self._have = [rest], rest.num_rows
        return out.select(self.names)

    def leftover(self) -> int:
        return self._have + sum(t.num_rows for t in self._it)


def _support(model: Any, path: Path, batch_rows: int) -> tuple[FeatureBatch, np.ndarray]:
    """Flat labeled support rows and their task keys (the whole support file, in memory)."""
    from meta_io.layout import MASK_COL
    from meta_io.reader import BatchConverter
    from meta_io.source import iter_source, list_source_files

    if not path.exists():
        raise DeliveryError(f"{path}: support data not found")
    view = serving_schema(model.schema, list_source_files(path), task_key=True)
    missing = [h for h in model.heads if h not in view.labels]
    if missing:
        raise DeliveryError(f"{path}: support data lacks label columns {missing}; adaptation trains on labeled rows")
    parts = [sb.table for sb in iter_source(path, view, batch_rows, validate_schema=False)]
    tab = pa.concat_tables(parts).combine_chunks()
    if tab.num_rows == 0:
        raise DeliveryError(f"{path}: support data has no rows")
    tab = tab.append_column(MASK_COL, pa.array(np.ones(tab.num_rows, dtype=bool)))
    fb = BatchConverter(view).plain(tab.combine_chunks().to_batches()[0]).features
    return fb, tab.column(model.schema.task_key).to_numpy()


def _task_keys(schema: Schema, fb: FeatureBatch, where: Path) -> np.ndarray:
    """Task keys of a Meta-IO dataset's rows: only a ``sparse`` task key is among the features."""
    key = schema.task_key
    if key not in fb.ids:
        raise DeliveryError(f"{where}: task key '{key}' is not a feature of the bundle's schema (kind "
                            f"'{schema.column(key).kind.value}'); with --support give Parquet/CSV data, "
                            f"which is grouped by the key column itself")
    return fb.ids[key].reshape(fb.mask.shape[0], -1)[:, 0].numpy()


def predict_to_parquet(
    bundle: str | Path, data: str | Path, out: str | Path, batch_rows: int = 4096, *,
    support: str | Path | None = None, keep_columns: Sequence[str] = (), warn_unknown: float = 0.5,
    progress: Callable[[int], None] | None = None, tasks_per_batch: int = 256,
) -> PredictResult:
    """Score ``data`` with the bundle at ``bundle`` into the Parquet file ``out`` (atomically).

    Args:
        bundle: a publish root (its LATEST) or a bundle directory.
        data: Parquet/CSV file or folder, or a Meta-IO dataset.
        out: the output Parquet file (replaced only when everything succeeded).
        batch_rows: rows per prediction batch.
        support: labeled rows (Parquet/CSV) to adapt on per task key before scoring; rows of
            tasks without support are scored by the base model.
        keep_columns: input columns copied verbatim into the output (e.g. a key and a label).
        warn_unknown: warn when more than this share of looked-up ids is unknown to the bundle.
        progress: called with the rows scored so far after every batch.
        tasks_per_batch: tasks adapted together (``--support``).

    Raises:
        DeliveryError / DataError / SchemaError: bad bundle or data; nothing is
            left at ``out`` (a previous file there is kept).
    """
    from delivery.loader import load_bundle

    if batch_rows < 1:
        raise DeliveryError(f"--batch-rows must be >= 1, got {batch_rows}")
    if not 0.0 <= warn_unknown <= 1.0:
        raise DeliveryError(f"--warn-unknown must be a share in [0, 1], got {warn_unknown}")
    keep = list(keep_columns)
    clash = [c for c in keep if c == "row" or c.startswith("p_")]
    if clash or len(set(keep)) != len(keep):
        raise DeliveryError(f"--keep-columns {keep}: names must be distinct and not 'row' or 'p_*' (output columns)")
    out, data = Path(out), Path(data)
    model = load_bundle(bundle)
    try:
        batches, labels = _batches(data, model.schema, batch_rows, with_keys=support is not None)
        raw = None
        if keep:
            from meta_io.layout import MANIFEST_NAME
            from meta_io.source import list_source_files

            if data.is_dir() and (data / MANIFEST_NAME).is_file():
                raise DeliveryError(f"{data}: --keep-columns needs Parquet/CSV input, not a Meta-IO dataset")
            raw = _RawColumns(list_source_files(data), keep)
        predictor = None
        if support is not None:
            sup, sup_keys = _support(model, Path(support), batch_rows)
            predictor = model.adapt(sup, sup_keys, tasks_per_batch)
        evaluated = [h for h in model.heads if h in labels]
        accs = {h: StreamingAUC() for h in evaluated}
        rows = 0
        if not out.parent.is_dir():
            raise DeliveryError(f"{out}: its folder {out.parent} does not exist")
        with atomic_output(out) as tmp:
            writer = None
            try:
                for fb, fb_keys in batches:
                    if predictor is not None:
                        keys = fb_keys if fb_keys is not None else _task_keys(model.schema, fb, data)
                        probs = predictor.predict(fb, keys)
                    else:
                        probs = model.predict(fb)
                    n = fb.mask.numel()
                    cols = {"row": pa.array(np.arange(rows, rows + n, dtype=np.int64))}
                    cols.update({f"p_{h}": pa.array(probs[h].reshape(-1).numpy()) for h in model.heads})
                    tab = pa.table(cols)
                    if raw is not None:
                        kept = raw.take(n)
                        for name in keep:
                            tab = tab.append_column(name, kept.column(name))
                    if writer is None:
                        writer = pq.ParquetWriter(str(tmp), tab.schema)
                    writer.write_table(tab)
                    mask = fb.mask.reshape(-1).numpy()
                    for h, acc in accs.items():
                        acc.update(fb.labels[h].reshape(-1).numpy(), probs[h].reshape(-1).numpy(), mask)
                    rows += n
                    if progress is not None:
                        progress(rows)
            finally:
                if writer is not None:
                    writer.close()
            if writer is None:
                raise DeliveryError(f"{data}: no rows to score")
            if raw is not None and raw.leftover():
                raise DeliveryError(f"{data}: --keep-columns read more rows than were scored; input changed while reading?")
        share = model.unknown_ids / model.looked_up_ids if model.looked_up_ids else 0.0
        res = PredictResult(bundle=model.version, rows=rows, out=out, unknown_ids=model.unknown_ids,
                            labels=evaluated, auc={h: acc.value() for h, acc in accs.items()},
                            looked_up_ids=model.looked_up_ids, unknown_share=share,
                            warn_unknown=share > warn_unknown, adapted=predictor is not None,
                            recipe=predictor.adapting.recipe.name if predictor is not None else "",
                            recipe_from=predictor.adapting.recipe_from if predictor is not None else "")
    finally:
        model.close()
    if res.warn_unknown:
        log.warning("many ids unknown to the bundle", extra=kv(bundle=res.bundle, unknown=res.unknown_ids,
                                                               looked_up=res.looked_up_ids, share=round(share, 4)))
    log.info("predicted", extra=kv(bundle=res.bundle, rows=rows, out=out, labels=",".join(evaluated) or "-",
                                   recipe=res.recipe or "-", recipe_from=res.recipe_from or "-"))
    return res
