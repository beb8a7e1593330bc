"""``metaps predict``: score data with a published bundle; evaluate only when labels are present.

Input: a Parquet/CSV file or folder read with the bundle's schema, or a Meta-IO
dataset. Serving data usually has no labels and never has the generator's
oracle columns, so the file columns read are the model's features only (id,
multi-hot, text, vector, dense columns and the scenario column), plus each
label column that *every* input file has. Heads whose label is present are
evaluated (streaming AUC over the real rows); the others are only scored.

Output: one Parquet file, ``row`` (0-based input row) and ``p_<head>`` per head,
written beside ``--out`` and renamed over it at the end
(:func:`metaps.core.atomic_write.atomic_output`), so a failure at any point leaves no
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
from typing import Iterator

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from delivery.bundle import DeliveryError
from meta_io.batch import FeatureBatch
from meta_io.schema import ID_KINDS, ColumnKind, Schema
from metaps.core.atomic_write import atomic_output
from metaps.core.evaluation import StreamingAUC
from metaps.core.log import kv

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
    """

    bundle: str
    rows: int
    out: Path
    unknown_ids: int
    labels: list[str] = field(default_factory=list)
    auc: dict[str, float] = field(default_factory=dict)


def serving_schema(schema: Schema, files: list[Path]) -> Schema:
    """The columns ``metaps predict`` reads: features, the scenario, and the labels every file has.

    Args:
        schema: the bundle's (training) schema.
        files: the input files (their column names decide which labels are present).
    """
    from meta_io.source.files import _file_columns

    have = [set(_file_columns(f).names) for f in files]
    present = [lab for lab in schema.labels if all(lab in h for h in have)]
    cols = [c for c in schema.columns if c.kind in FEATURE_KINDS or c.name == schema.scenario or c.name in present]
    return dataclasses.replace(schema, columns=cols, labels=present, oracle={}, timestamp="")


def _batches(data: Path, schema: Schema, batch_rows: int) -> tuple[Iterator[FeatureBatch], list[str]]:
    """(feature batches, labels present) for a Meta-IO dataset or Parquet/CSV input."""
    from meta_io.layout import INDEX_NAME, MANIFEST_NAME, MASK_COL

    if not data.exists():
        raise DeliveryError(f"{data}: data to score not found")
    if data.is_dir() and (data / MANIFEST_NAME).is_file() and (data / INDEX_NAME).is_file():
        from delivery.gate import holdout_batches

        return holdout_batches(data, schema, batch_rows), list(schema.labels)
    from meta_io.reader import BatchConverter
    from meta_io.source import iter_source, list_source_files

    view = serving_schema(schema, list_source_files(data))
    conv = BatchConverter(view)

    def gen() -> Iterator[FeatureBatch]:
        for sb in iter_source(data, view, batch_rows, validate_schema=False):
            tab = sb.table.append_column(MASK_COL, pa.array(np.ones(sb.num_rows, dtype=bool)))
            for rb in tab.to_batches(max_chunksize=batch_rows):
                yield conv.plain(rb).features

    return gen(), list(view.labels)


def predict_to_parquet(bundle: str | Path, data: str | Path, out: str | Path, batch_rows: int = 4096) -> PredictResult:
    """Score ``data`` with the bundle at ``bundle`` into the Parquet file ``out`` (atomically).

    Args:
        bundle: a publish root (its LATEST) or a bundle directory.
        data: Parquet/CSV file or folder, or a Meta-IO dataset.
        out: the output Parquet file (replaced only when everything succeeded).
        batch_rows: rows per prediction batch.

    Raises:
        DeliveryError / DataError / SchemaError: bad bundle or data; nothing is
            left at ``out`` (a previous file there is kept).
    """
    from delivery.loader import load_bundle

    if batch_rows < 1:
        raise DeliveryError(f"--batch-rows must be >= 1, got {batch_rows}")
    out, data = Path(out), Path(data)
    model = load_bundle(bundle)
    try:
        batches, labels = _batches(data, model.schema, batch_rows)
        evaluated = [h for h in model.heads if h in labels]
        accs = {h: StreamingAUC() for h in evaluated}
        rows = 0
        if not out.parent.is_dir():
            raise DeliveryError(f"{out}: its folder {out.parent} does not exist")
        with atomic_output(out) as tmp:
            writer = None
            try:
                for fb in batches:
                    probs = model.predict(fb)
                    n = fb.mask.numel()
                    cols = {"row": pa.array(np.arange(rows, rows + n, dtype=np.int64))}
                    cols.update({f"p_{h}": pa.array(probs[h].reshape(-1).numpy()) for h in model.heads})
                    tab = pa.table(cols)
                    if writer is None:
                        writer = pq.ParquetWriter(str(tmp), tab.schema)
                    writer.write_table(tab)
                    mask = fb.mask.reshape(-1).numpy()
                    for h, acc in accs.items():
                        acc.update(fb.labels[h].reshape(-1).numpy(), probs[h].reshape(-1).numpy(), mask)
                    rows += n
            finally:
                if writer is not None:
                    writer.close()
            if writer is None:
                raise DeliveryError(f"{data}: no rows to score")
        res = PredictResult(bundle=model.version, rows=rows, out=out, unknown_ids=model.unknown_ids,
                            labels=evaluated, auc={h: acc.value() for h, acc in accs.items()})
    finally:
        model.close()
    log.info("predicted", extra=kv(bundle=res.bundle, rows=rows, out=out, labels=",".join(evaluated) or "-"))
    return res
