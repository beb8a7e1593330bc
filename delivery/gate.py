"""The validation gate: a staged bundle is published only if it is consistent and not worse.

Two checks, in order:

1. **Consistency** (always): every file matches its manifest sha256; the
   manifest's tables are exactly the schema's tables (and the dense network's);
   dims agree with the model config; every stored value has the table's row size
   and no NaN/inf (a full scan of this bundle's rows; parents were scanned when
   they were published); the delta chain resolves.
2. **Quality** (when a holdout is configured): the bundle (with its chain) is
   loaded exactly as serving loads it, scored on the holdout, and its AUC per
   head compared with the currently published version's. The published AUC is
   the one recorded in its manifest when it was measured on the same holdout,
   else it is measured now on the same rows. A drop larger than
   ``max_auc_drop`` on any head refuses the bundle.
3. **Adaptation choice** (when a holdout is configured and the bundle carries an
   adaptation recipe): :func:`delivery.adapt_select.select_recipe` scores 16
   adaptation recipes (none; an offset alone at priors 1, 4, 16; inner steps at
   three rates; each rate + an offset at each prior, so the prior is chosen too)
   on the holdout's users (first-k, ``adapt_k`` support rows; a Meta-IO meta
   holdout: its episodes) and picks the best mean AUC over heads, so the served
   adaptation is never worse than none on those users; an inner loop that raised
   the support loss on more than 10% of the episodes is named (``diverged``).
   Every candidate is a recipe ``metaps evaluate`` can score (``choice_evaluate``:
   the choice's flags). The figures and
   the choice go into the report's ``adapt`` record, which :meth:`GateReport.record`
   puts in the manifest's ``gate`` field; serving reads the choice from there
   (:mod:`delivery.adapt`). Without a holdout, or when the holdout cannot give
   episodes (no timestamp, a plain layout), the configured recipe ships and
   ``adapt`` says why (the selection never refuses a bundle; a bundle without an
   adaptation recipe gets no ``adapt`` record).

Example::

    report = run_gate(staging, published=root / "v000004", holdout="holdout.parquet", max_auc_drop=0.01)
    if not report.ok:
        print("refused:", "; ".join(report.reasons))
    report.adapt_summary     # "adaptation chosen on 240 validation episodes (first-k, k=8): inner(1x0.03)+offset(4, prior 1), ..."
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import numpy as np
import pyarrow as pa

from delivery.bundle import (
    EMBEDDINGS, INDEX, BundleKind, DeliveryError, EmbeddingReader, read_index, read_manifest, row_fingerprints,
    verify_checksums,
)
from delivery.holdout import Holdout
from meta_io.batch import FeatureBatch, MetaBatch
from meta_io.schema import Schema, schema_from_dict
from common.errors import MetapsError
from common.eta import ProgressHook
from common.evaluation import auc
from common.log import kv

log = logging.getLogger(__name__)


@dataclass
class GateReport:
    """The gate's verdict.

    Args:
        ok: publish or not.
        reasons: why not (empty when ok).
        auc: head -> AUC of the new bundle on the holdout (empty without a holdout).
        published_auc: head -> AUC of the published version on the same holdout.
        rows: holdout rows evaluated.
        adapt: the adaptation choice (:meth:`delivery.adapt_select.Selection.record`: candidates'
            validation figures and ``choice``, or ``selected: false`` and the reason); empty for an
            inconsistent bundle.
        adapt_summary: the choice in one line, for the deliver report.
    """

    ok: bool
    reasons: list[str] = field(default_factory=list)
    auc: dict[str, float] = field(default_factory=dict)
    published_auc: dict[str, float] = field(default_factory=dict)
    rows: int = 0
    adapt: dict[str, Any] = field(default_factory=dict)
    adapt_summary: str = ""

    def record(self, holdout: str) -> dict[str, Any]:
        """What goes into the published manifest's ``gate`` field (``adapt``: the served adaptation's choice)."""
        out: dict[str, Any] = {"gated": True, "holdout": holdout, "rows": self.rows, "auc": self.auc,
                               "published_auc": self.published_auc}
        if self.adapt:
            out["adapt"] = self.adapt
        return out


# -- consistency ------------------------------------------------------------------------
def check_consistency(bundle_dir: str | Path) -> list[str]:
    """Problems that make a bundle unpublishable ([] = consistent).

    Example::

        assert check_consistency(staging) == []
    """
    d = Path(bundle_dir)
    try:
        m = read_manifest(d)
    except DeliveryError as exc:
        return [str(exc)]
    problems = verify_checksums(d, m)
    if problems:
        return problems  # do not read files that are known to be wrong
    try:
        schema = schema_from_dict(m.schema, where=f"{d}: manifest schema")
    except MetapsError as exc:
        return [str(exc)]
    want = set(schema.tables)
    have = set(m.tables)
    if want - have:
        problems.append(f"{d}: tables {sorted(want - have)} of the schema are missing from the bundle")
    if have - want:
        problems.append(f"{d}: bundle has tables {sorted(have - want)} that the schema does not use")
    dense_tables = set(m.dense.get("tables", []))
    if dense_tables - have:
        problems.append(f"{d}: the dense network needs tables {sorted(dense_tables - have)} the bundle lacks")
    try:
        from models.config import ModelConfig
        from common.config import from_mapping

        dims = from_mapping(ModelConfig, m.model, where=f"{d}: manifest model").embedding_dims(schema.tables)
    except (MetapsError, ValueError) as exc:
        return problems + [str(exc)]
    for t, info in m.tables.items():
        if t in dims and dims[t] != info.dim:
            problems.append(f"{d}: table '{t}': manifest dim {info.dim}, model config dim {dims[t]}")
    if problems:
        return problems
    try:
        index = read_index(d / INDEX)
    except DeliveryError as exc:
        return [str(exc)]
    reader = EmbeddingReader(d / EMBEDDINGS, {t: i.dim for t, i in m.tables.items()}, m.dtype)
    try:
        total = sum(i.written for i in m.tables.values())
        if reader.entries() != total:
            problems.append(f"{d / EMBEDDINGS}: holds {reader.entries()} rows, manifest says {total}")
        for t, info in m.tables.items():
            try:
                ids, rows = reader.scan(t, info.written)
            except DeliveryError as exc:
                problems.append(str(exc))
                continue
            assert rows is not None
            bad = ~np.isfinite(rows).all(axis=1)
            if bad.any():
                problems.append(
                    f"{d}: table '{t}': {int(bad.sum())} rows with NaN/inf, first id {int(ids[np.flatnonzero(bad)[0]])}"
                )
            idx_ids, idx_fp = index.get(t, (np.zeros(0, np.int64), np.zeros(0, np.uint64)))
            fp = row_fingerprints(rows.astype(m.dtype.numpy.newbyteorder("<")))
            if not (np.array_equal(idx_ids, ids) and np.array_equal(idx_fp, fp)):
                problems.append(f"{d / INDEX}: table '{t}': index does not match the rows in {EMBEDDINGS}")
    finally:
        reader.close()
    if m.kind is BundleKind.DELTA:
        from delivery.loader import bundle_chain

        try:
            bundle_chain(d)
        except DeliveryError as exc:
            problems.append(str(exc))
    return problems


# -- holdout ----------------------------------------------------------------------------
def holdout_batches(path: str | Path, schema: Schema, batch_rows: int = 4096) -> Iterator[FeatureBatch]:
    """Feature batches of a holdout: a Meta-IO dataset dir, or Parquet/CSV read with ``schema``.

    Meta batches yield their support and query halves (every real row is evaluated).
    """
    p = Path(path)
    if not p.exists():
        raise DeliveryError(f"{p}: holdout not found")
    from meta_io.layout import INDEX_NAME, MANIFEST_NAME, MASK_COL

    if p.is_dir() and (p / MANIFEST_NAME).is_file() and (p / INDEX_NAME).is_file():
        from meta_io.reader import MetaIODataset

        ds = MetaIODataset(p)
        for b in ds.iter_all():
            if isinstance(b, MetaBatch):
                yield b.support
                yield b.query
            else:
                yield b.features
        for b in ds.leftover():
            yield b.features
        return
    from meta_io.reader import BatchConverter
    from meta_io.source import iter_source

    conv = BatchConverter(schema)
    for sb in iter_source(p, schema, batch_rows):
        tab = sb.table.append_column(MASK_COL, pa.array(np.ones(sb.num_rows, dtype=bool)))
        for rb in tab.to_batches(max_chunksize=batch_rows):
            yield conv.plain(rb).features


def evaluate(
    model: Any, holdout: str | Path | Holdout, max_rows: int = 0, batch_rows: int = 4096,
) -> tuple[dict[str, float], int]:
    """AUC per head of a loaded :class:`~delivery.loader.ServingModel` on a holdout.

    Args:
        model: the loaded bundle.
        holdout: a path, or a :class:`~delivery.holdout.Holdout` (read once, shared by the gate's scorers).
        max_rows: evaluate at most this many rows (0: all).
        batch_rows: rows per batch of a path's Parquet/CSV.

    Returns:
        ``(head -> auc, rows evaluated)``; an AUC is nan when the holdout lacks a class.
    """
    source = holdout if isinstance(holdout, Holdout) else Holdout(holdout, model.schema, batch_rows)
    scores: dict[str, list[np.ndarray]] = {h: [] for h in model.heads}
    labels: dict[str, list[np.ndarray]] = {h: [] for h in model.heads}
    masks: list[np.ndarray] = []
    rows = 0
    for fb in source.feature_batches():
        probs = model.predict(fb)
        mask = fb.mask.reshape(-1).numpy().astype(bool)
        if max_rows and rows + int(mask.sum()) > max_rows:
            keep = np.cumsum(mask) <= (max_rows - rows)
            mask = mask & keep
        masks.append(mask)
        for h in model.heads:
            if h not in fb.labels:
                raise DeliveryError(f"{holdout}: holdout has no label '{h}' for head '{h}'")
            scores[h].append(probs[h].reshape(-1).numpy())
            labels[h].append(fb.labels[h].reshape(-1).numpy())
        rows += int(mask.sum())
        if max_rows and rows >= max_rows:
            break
    if rows == 0:
        raise DeliveryError(f"{holdout}: holdout has no rows")
    m = np.concatenate(masks)
    out = {h: float(auc(np.concatenate(labels[h]), np.concatenate(scores[h]), mask=m)) for h in model.heads}
    return out, rows


def run_gate(
    staging: str | Path,
    published: str | Path | None = None,
    holdout: str = "",
    max_auc_drop: float = 0.01,
    holdout_rows: int = 0,
    adapt_k: int = 8,
    progress: ProgressHook | None = None,
) -> GateReport:
    """Decide whether the staged bundle may replace the published one, and choose its adaptation.

    The holdout is read once (:class:`~delivery.holdout.Holdout`): the staged bundle's AUC, the
    adaptation choice and the published bundle's AUC (when measured now) score the same rows in memory.

    Args:
        staging: the staged bundle directory (its parents are looked up next to it).
        published: the currently published bundle directory (None if none).
        holdout: holdout path ('' = consistency checks only; the configured adaptation ships).
        max_auc_drop: largest allowed AUC drop per head.
        holdout_rows: cap on holdout rows (0 = all); also caps the adaptation selection's query rows.
        adapt_k: support rows per holdout user when choosing the adaptation (first-k).
        progress: told ``(DeliverStage.GATE, done, total)``: step 1 the consistency check, step 2 the
            staged bundle's holdout AUC, then one step per adaptation candidate scored (a selection
            that cannot run skips them), the last the published bundle's AUC; without a holdout one
            step. None: nothing told.
    """
    from delivery.adapt_select import not_selected, planned_candidates, select_or_configured
    from delivery.export import DeliverStage

    def tell(done: int, total: int) -> None:
        if progress is not None:
            progress(DeliverStage.GATE, done, total)

    if not holdout:
        tell(0, 1)
        problems = check_consistency(staging)
        tell(1, 1)
        if problems:
            log.warning("gate refused an inconsistent bundle", extra=kv(bundle=staging, problems=len(problems)))
            return GateReport(ok=False, reasons=problems)
        sel = not_selected(read_manifest(staging), "no holdout to validate on")
        return GateReport(ok=True, adapt=sel.record() if sel.configured else {}, adapt_summary=sel.summary())
    planned = len(planned_candidates(read_manifest(staging)))
    total = 3 + planned
    tell(0, total)
    problems = check_consistency(staging)
    tell(1, total)
    if problems:
        log.warning("gate refused an inconsistent bundle", extra=kv(bundle=staging, problems=len(problems)))
        tell(total, total)
        return GateReport(ok=False, reasons=problems)
    from delivery.loader import load_bundle

    new = load_bundle(staging, verify=False)  # just verified above
    try:
        data = Holdout(holdout, new.schema)
        new_auc, rows = evaluate(new, data, holdout_rows)
        tell(2, total)
        sel = select_or_configured(new, data, adapt_k, holdout_rows,
                                   on_scored=lambda _s, done, _n: tell(2 + min(done, planned), total))
    finally:
        new.close()
    tell(2 + planned, total)
    # a bundle without an adaptation recipe (exported before adaptation shipped) has nothing to choose
    report = GateReport(ok=True, auc=new_auc, rows=rows, adapt=sel.record() if sel.configured else {},
                        adapt_summary=sel.summary())
    if published is not None:  # after closing the staged bundle: a test gates a bundle against itself
        _compare_published(report, Path(published), data, holdout, holdout_rows, max_auc_drop)
    if all(math.isnan(a) for a in new_auc.values()):
        report.reasons.append(f"{holdout}: no head has a defined AUC (a label has only one class)")
    tell(total, total)
    report.ok = not report.reasons
    log.info("gate", extra=kv(bundle=staging, ok=report.ok, auc=new_auc, published_auc=report.published_auc, rows=rows))
    return report


def _compare_published(report: GateReport, published: Path, data: Holdout, holdout: str, holdout_rows: int,
                       max_auc_drop: float) -> None:
    """``report.published_auc`` and a reason per head whose AUC dropped more than ``max_auc_drop``.

    The published AUC is the one its manifest recorded on the same holdout path and row count, else it is
    measured now on the same rows (``data``: nothing is read again).
    """
    from delivery.loader import load_bundle

    pm = read_manifest(published)
    recorded = pm.gate
    if recorded.get("holdout") == str(holdout) and recorded.get("rows") == report.rows and recorded.get("auc"):
        old_auc = {h: float(v) for h, v in recorded["auc"].items()}
    else:
        old = load_bundle(published, verify=False)
        try:
            old_auc, _ = evaluate(old, data, holdout_rows)
        finally:
            old.close()
    report.published_auc = old_auc
    for h, a in report.auc.items():
        b = old_auc.get(h)
        if b is None or math.isnan(b) or math.isnan(a):
            continue
        if a < b - max_auc_drop:
            report.reasons.append(
                f"head '{h}': holdout AUC {a:.5f} is {b - a:.5f} below the published {pm.version}'s {b:.5f} "
                f"(allowed drop {max_auc_drop})"
            )
