"""Serving side: load a published bundle (a base plus its deltas) and predict.

``load_bundle(path)`` accepts a publish root (follows ``LATEST``) or one bundle
directory. A delta bundle is served by stacking its chain, newest first::

    lookup(ids) of table t:
      v000007 (delta): ids in removed.arrow -> gone;  found in LMDB -> row
      v000006 (delta): same, for ids still unresolved
      v000005 (full):  found -> row;  never found -> unknown

Unknown ids (never trained, evicted, or removed) read as the **PS's initial row**
of the id (deterministic per table, id and seed; the spec is the manifest's
``adapt.init``), which is what a PS pull returns for them in training-time
evaluation: one rule in both places. Bundles without that record (exported
before it existed) serve zero rows. ``ServingModel.unknown_ids`` counts them.

Every lookup is one C-level pass per bundle of the chain over the batch's
unique ids of a table (``b"".join(map(txn.get, keys, ...))``), then one
``np.frombuffer`` over the joined values (see ``EmbeddingReader.get``).

Example::

    model = load_bundle("bundles")                 # LATEST
    probs = model.predict(batch)                   # {"click": tensor[B], ...}
    rows = model.lookup("item", np.array([5, 9]))  # float32 [2, dim]
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch

from delivery.bundle import (
    DENSE, EMBEDDINGS, MANIFEST, REMOVED, BundleKind, BundleManifest, DeliveryError, EmbeddingReader,
    read_manifest, read_removed, verify_checksums,
)
from delivery.dense import flat_inputs, load_scripted
from delivery.publish import LATEST, Publisher
from meta_io.batch import FeatureBatch, PlainBatch
from meta_io.schema import Schema, schema_from_dict
from common.errors import DataError
from common.log import kv

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ChainLink:
    """One bundle of a chain: its directory, manifest, rows and removed ids."""

    path: Path
    manifest: BundleManifest
    reader: EmbeddingReader
    removed: dict[str, np.ndarray]


def resolve_bundle_dir(path: str | Path) -> Path:
    """A bundle directory from a publish root (via ``LATEST``) or a bundle directory.

    Raises:
        DeliveryError: neither a bundle nor a publish root with a valid ``LATEST``.
    """
    p = Path(path)
    if not p.exists():
        raise DeliveryError(f"{p}: bundle path does not exist")
    if (p / MANIFEST).is_file():
        return p
    if (p / LATEST).is_file():
        version = Publisher(p).latest()
        assert version is not None
        return p / version
    raise DeliveryError(f"{p}: neither a bundle (no {MANIFEST}) nor a publish root (no {LATEST})")


def bundle_chain(bundle_dir: str | Path) -> list[tuple[Path, BundleManifest]]:
    """The bundle and its parents (looked up next to it), newest first, verified.

    Raises:
        DeliveryError: a missing parent, a parent that is not the named version,
            a chain not ending at a full bundle, or bundles that disagree on dims/dtype.
    """
    d = Path(bundle_dir)
    m = read_manifest(d)
    chain = [(d, m)]
    seen = {m.version}
    while m.kind is BundleKind.DELTA:
        assert m.parent is not None
        pd = d.parent / m.parent
        if not (pd / MANIFEST).is_file():
            raise DeliveryError(f"{chain[-1][0]}: parent bundle {m.parent} not found at {pd}; the chain is broken")
        pm = read_manifest(pd)
        if pm.version != m.parent:
            raise DeliveryError(f"{pd}: manifest says version {pm.version}, but the child names parent {m.parent}")
        if pm.version in seen:
            raise DeliveryError(f"{pd}: bundle chain loops at {pm.version}")
        if pm.row_watermark > m.row_watermark:
            raise DeliveryError(f"{chain[-1][0]}: parent {pm.version} is newer (row watermark) than its child")
        seen.add(pm.version)
        chain.append((pd, pm))
        d, m = pd, pm
    newest = chain[0][1]
    if chain[-1][1].version != newest.base and newest.base:
        raise DeliveryError(f"{chain[0][0]}: chain ends at {chain[-1][1].version}, manifest names base {newest.base}")
    for pd, pm in chain[1:]:
        if pm.dtype != newest.dtype:
            raise DeliveryError(f"{pd}: dtype {pm.dtype.value} differs from {newest.version}'s {newest.dtype.value}")
        for t, info in newest.tables.items():
            if t not in pm.tables:
                raise DeliveryError(f"{pd}: table '{t}' of {newest.version} is missing from parent {pm.version}")
            if pm.tables[t].dim != info.dim:
                raise DeliveryError(
                    f"{pd}: table '{t}' dim {pm.tables[t].dim} differs from {newest.version}'s dim {info.dim}"
                )
    return chain


class ServingModel:
    """A loaded bundle chain: embedding lookups and the TorchScript dense network.

    Args:
        chain: ``(dir, manifest)`` newest first, as :func:`bundle_chain` returns.
    """

    def __init__(self, chain: list[tuple[Path, BundleManifest]]) -> None:
        self.path = chain[0][0]
        self.manifest = chain[0][1]
        self.version = self.manifest.version
        self.dims = {t: info.dim for t, info in self.manifest.tables.items()}
        self.links = [
            ChainLink(p, m, EmbeddingReader(p / EMBEDDINGS, {t: i.dim for t, i in m.tables.items()}, m.dtype),
                      read_removed(p / REMOVED))
            for p, m in chain
        ]
        self.schema: Schema = schema_from_dict(self.manifest.schema, where=f"{self.path / MANIFEST}: schema")
        self.dense_spec = dict(self.manifest.dense)
        self.heads: list[str] = list(self.dense_spec["heads"])
        self._inputs: list[str] = list(self.dense_spec["inputs"])
        self._tables: list[str] = list(self.dense_spec["tables"])
        self.module = load_scripted(str(self.path / DENSE))
        self.unknown_ids = 0
        self.looked_up_ids = 0
        from delivery.adapt import unseen_initializers

        # One rule for unseen ids, the same as a PS pull in training: the PS's initial row of the id.
        self._unseen = unseen_initializers(self.manifest.adapt, self.dims)
        self._adapting: Any = None

    # -- embeddings ------------------------------------------------------------------
    def _lookup_unique(self, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
        """``(found, rows)`` for sorted unique ids, walking the chain newest first."""
        if table not in self.dims:
            raise DeliveryError(f"{self.path}: unknown table '{table}'; bundle tables: {sorted(self.dims)}")
        out = np.zeros((ids.shape[0], self.dims[table]), dtype=np.float32)
        found = np.zeros(ids.shape[0], dtype=bool)
        pending = np.arange(ids.shape[0])
        for link in self.links:
            if pending.size == 0:
                break
            hit, rows = link.reader.get(table, ids[pending])
            out[pending[hit]] = rows[hit]
            found[pending[hit]] = True
            # Removed in this version (and not re-added later, which a newer link would have found).
            gone = link.removed.get(table)
            resolved = hit | (np.isin(ids[pending], gone, assume_unique=True) if gone is not None else False)
            pending = pending[~resolved]
        init = self._unseen.get(table)
        if init is not None and not found.all():
            out[~found] = init(ids[~found])
        return found, out

    def count_lookups(self, found: np.ndarray) -> None:
        """Add one lookup's ids to ``looked_up_ids`` / ``unknown_ids``."""
        self.looked_up_ids += int(found.shape[0])
        self.unknown_ids += int((~found).sum())

    def lookup(self, table: str, ids: np.ndarray | torch.Tensor) -> np.ndarray:
        """Rows of ``ids`` (any order, duplicates allowed) as float32 ``[n, dim]``; unknown ids read as their initial row (zeros in bundles without adapt.init).

        Example::

            rows = model.lookup("user", np.array([7, 7, 123]))
        """
        arr = ids.numpy() if isinstance(ids, torch.Tensor) else np.asarray(ids)
        arr = arr.astype(np.int64, copy=False).reshape(-1)
        uniq, inv = np.unique(arr, return_inverse=True)
        found, rows = self._lookup_unique(table, uniq)
        self.count_lookups(found)
        return rows[inv]

    def contains(self, table: str, ids: np.ndarray) -> np.ndarray:
        """bool per id: does the bundle hold a row for it."""
        arr = np.asarray(ids, dtype=np.int64).reshape(-1)
        uniq, inv = np.unique(arr, return_inverse=True)
        return self._lookup_unique(table, uniq)[0][inv]

    # -- prediction ----------------------------------------------------------------------
    def batch_rows(self, features: FeatureBatch) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``(unique_ids, rows)`` per table for a batch (unique ids computed from its id columns)."""
        try:
            gathered = features.unique_ids(self.schema.id_columns, self._tables)
        except DataError as exc:
            raise DeliveryError(str(exc)) from None
        uniq: dict[str, torch.Tensor] = {}
        rows: dict[str, torch.Tensor] = {}
        for t, u in gathered.items():
            if u.numel() == 0:
                # The traced graph indexes position 0; a batch with no id of this table gets one dummy.
                u = torch.zeros(1, dtype=torch.int64)
            found, r = self._lookup_unique(t, u.numpy())
            self.count_lookups(found)
            uniq[t] = u
            rows[t] = torch.from_numpy(r)
        return uniq, rows

    @torch.no_grad()
    def predict(self, batch: FeatureBatch | PlainBatch) -> dict[str, torch.Tensor]:
        """Head -> probabilities ``[*L]`` for every row of ``batch`` (padding rows included).

        Example::

            probs = model.predict(plain_batch)["click"]
        """
        features = batch.features if isinstance(batch, PlainBatch) else batch
        lead = tuple(features.shape)
        features = features.flat()
        uniq, rows = self.batch_rows(features)
        try:
            out = self.module(*flat_inputs(self._inputs, features, uniq, rows))
        except RuntimeError as exc:
            raise DeliveryError(f"{self.path}: the dense network rejected the batch: {exc}") from None
        return {h: o.reshape(lead) for h, o in zip(self.heads, out)}

    def adapt(self, support: FeatureBatch, keys: np.ndarray, tasks_per_batch: int = 256) -> Any:
        """A predictor adapted per task on ``support`` (flat labeled rows, ``keys`` = their task keys).

        Returns a :class:`delivery.adapt.AdaptedPredictor`; see that module for the recipe.

        Example::

            probs = load_bundle("bundles").adapt(support, support_keys).predict(rows, row_keys)
        """
        from delivery.adapt import AdaptedPredictor, AdaptingModel

        if self._adapting is None:
            self._adapting = AdaptingModel(self)
        return AdaptedPredictor(self._adapting, support, keys, tasks_per_batch)

    def info(self) -> dict[str, Any]:
        return {"version": self.version, "chain": [link.manifest.version for link in self.links],
                "tables": {t: self.manifest.tables[t].rows for t in self.manifest.tables}}

    def close(self) -> None:
        for link in self.links:
            link.reader.close()


def load_bundle(path: str | Path, verify: bool = True) -> ServingModel:
    """Load a bundle (or the publish root's ``LATEST``) with its delta chain.

    Args:
        path: a publish root or a bundle directory.
        verify: check every file of the chain against its manifest sha256 first.

    Raises:
        DeliveryError: missing/corrupt files, a broken chain, a bad manifest.

    Example::

        model = load_bundle("/srv/bundles")
        print(model.version, model.predict(batch)["click"][:5])
    """
    chain = bundle_chain(resolve_bundle_dir(path))
    if verify:
        problems = [p for d, m in chain for p in verify_checksums(d, m)]
        if problems:
            raise DeliveryError("bundle failed verification: " + "; ".join(problems))
    model = ServingModel(chain)
    log.info("bundle loaded", extra=kv(path=model.path, version=model.version, chain=len(chain)))
    return model
