"""What one long-lived delivery process reuses between incremental exports.

A periodic delivery job (:class:`delivery.job.PeriodicDelivery`) exports a delta
bundle every few minutes from the same training run: the schema, the model
config, the dense network's graph and the parent's live ids barely change, yet a
fresh export parses, builds, loads and reads them again each time (~0.1-0.3 s of
fixed cost against a few ms of changed rows at 1%). :class:`ExportCache` keeps
them in memory, every entry **keyed by the content it stands for**, so a changed
input is a cache miss, never a stale hit::

    entry                      key                                         proves
    parsed schema + config     canonical JSON of info.schema / info.model  same text -> same objects
    adaptation recipe, names   same JSON + info.meta, info.job.meta/ps,    same text -> same recipe
    of learned inner rates     tables                                      (rates read every export)
    built model (template)     same JSON                                   params reloaded every export
    example batch (checks)     schema JSON + table dims                    same seed -> same tensors
    traced dense network       sha256 of the dense.pt it equals            the parent manifest's sha
    parent live ids + fps      (version, index sha, removed sha) per       the chain's manifests' shas
                               bundle of the chain

What is never cached: the checkpoint's rows and dense values (read and verified
every export), the check of the dense network against eager ``model.predict``
(run every export), and the durability of the published bundle (fsynced by the
publisher every time).

The parent's live ids are *taken* out of the cache too when the next delta is exported
from them: their fingerprint array is updated in place into the new version's (no
16 B/row copy per delta) and put back under the new chain's key; the
:class:`~delivery.export.ParentState` they came from is marked spent and refused by a
later export.

A traced module is *taken* out of the cache (so a module whose parameters are
being replaced is never also reachable under its old key) and put back under the
sha256 of the ``dense.pt`` written from it. A module traced by this process
shares its parameter tensors with the cached model it was traced from, so its
state may move with that model's while cached: what its key vouches for is the
graph. Its every parameter and buffer is replaced (strict ``load_state_dict``)
and the result checked against eager ``model.predict`` before each use.

Example::

    cache = ExportCache()
    export_bundle(src, staging, "v000002", cfg, parent_state(chain, cache), cache=cache)
"""

from __future__ import annotations

import json
import logging
from collections import OrderedDict
from typing import TYPE_CHECKING, Any, Callable, Generic, Hashable, TypeVar

import numpy as np
import torch

from common.log import kv

if TYPE_CHECKING:
    from models.base import CtrModel

log = logging.getLogger(__name__)

V = TypeVar("V")

LiveKey = tuple[tuple[str, str, str], ...]
"""(version, sha256 of index.arrow, sha256 of removed.arrow or '') per bundle of a chain, newest first."""

Live = dict[str, tuple[np.ndarray, np.ndarray]]
"""table -> (sorted live ids, their row fingerprints)."""


def canonical(obj: Any) -> str:
    """A stable text of a JSON-able object (sorted keys): the cache key of what it configures."""
    return json.dumps(obj, sort_keys=True, separators=(",", ":"), default=str)


class _Lru(Generic[V]):
    """A small least-recently-used map (a job reuses the newest one or two entries)."""

    def __init__(self, size: int) -> None:
        self.size = size
        self._d: OrderedDict[Hashable, V] = OrderedDict()

    def get(self, key: Hashable) -> V | None:
        v = self._d.get(key)
        if v is not None:
            self._d.move_to_end(key)
        return v

    def pop(self, key: Hashable) -> V | None:
        return self._d.pop(key, None)

    def put(self, key: Hashable, value: V) -> None:
        self._d[key] = value
        self._d.move_to_end(key)
        while len(self._d) > self.size:
            self._d.popitem(last=False)

    def __len__(self) -> int:
        return len(self._d)


class ExportCache:
    """In-memory state reused across the exports of one process (see the module docstring).

    Args:
        size: entries kept per kind (the newest ones), except live ids: one chain's
            (16 bytes per live row: the newest bundle's, which the next delta needs).

    Attributes:
        hits, misses: per kind ('config', 'model', 'example', 'recipe', 'dense', 'live'), for logs and tests.
    """

    def __init__(self, size: int = 2) -> None:
        self._configs: _Lru[tuple[Any, Any]] = _Lru(size)
        self._models: _Lru[tuple["CtrModel", dict[str, torch.Tensor]]] = _Lru(size)
        self._examples: _Lru[Any] = _Lru(size)
        self._dense: _Lru[torch.jit.ScriptModule] = _Lru(size)
        self._recipes: _Lru[tuple[str, list[str]]] = _Lru(size)
        self._live: _Lru[Live] = _Lru(1)
        self.hits: dict[str, int] = {}
        self.misses: dict[str, int] = {}

    def _count(self, kind: str, hit: bool) -> None:
        book = self.hits if hit else self.misses
        book[kind] = book.get(kind, 0) + 1

    def _cached(self, lru: "_Lru[V]", kind: str, key: Hashable, make: Callable[[], V]) -> V:
        """``lru[key]``, counted as a hit or a miss of ``kind``; on a miss ``make()`` fills it."""
        got = lru.get(key)
        self._count(kind, got is not None)
        if got is None:
            got = make()
            lru.put(key, got)
        return got

    # -- configs and the model ---------------------------------------------------------
    def configs(self, key: str, parse: Callable[[], tuple[Any, Any]]) -> tuple[Any, Any]:
        """(schema, model config) parsed from the manifest text ``key`` (``parse`` on a miss)."""
        return self._cached(self._configs, "config", key, parse)

    def model(self, key: str, build: Callable[[], "CtrModel"]) -> "CtrModel":
        """The model built for ``key``, its buffers reset to their built values.

        The caller loads every parameter (strict) before use; buffers (not in the
        checkpoint) are put back to what ``build`` made, so the model equals a fresh one.
        """
        got = self._models.get(key)
        self._count("model", got is not None)
        if got is None:
            model = build()
            self._models.put(key, (model, {n: b.detach().clone() for n, b in model.named_buffers()}))
            return model
        model, buffers = got
        with torch.no_grad():
            for n, b in model.named_buffers():
                b.copy_(buffers[n])
        return model

    def example(self, key: Hashable, make: Callable[[], V]) -> V:
        """The example batch for ``key`` (deterministic: ``make`` seeds its own generator).

        Shared, not copied: the dense check only reads it (and a batch changed in place
        could only make the check fail, i.e. trace afresh, never pass a wrong network).
        """
        return self._cached(self._examples, "example", key, make)

    def recipe(self, key: str, make: Callable[[], tuple[str, list[str]]]) -> tuple[dict[str, Any], list[str]]:
        """The adaptation recipe and learned-rate names for ``key`` (the canonical text of
        everything they are derived from: schema/model config, info.meta, info.job.meta/ps,
        tables); ``make`` returns (recipe as canonical JSON, names). A fresh copy each call."""
        text, names = self._cached(self._recipes, "recipe", key, make)
        return json.loads(text), list(names)

    # -- the traced dense network ------------------------------------------------------
    def take_dense(self, sha: str | None) -> torch.jit.ScriptModule | None:
        """The traced module whose state equals the ``dense.pt`` with sha256 ``sha``; removed
        from the cache (its parameters are about to change)."""
        got = self._dense.pop(sha) if sha else None
        self._count("dense", got is not None)
        return got

    def put_dense(self, sha: str, module: torch.jit.ScriptModule) -> None:
        """Remember ``module`` as the content of a ``dense.pt`` with sha256 ``sha`` (saved from it)."""
        self._dense.put(sha, module)

    # -- the parent's live ids ---------------------------------------------------------
    def live(self, key: LiveKey) -> Live | None:
        """Live ids and fingerprints of the chain ``key`` (None: not seen)."""
        got = self._live.get(key)
        self._count("live", got is not None)
        return got

    def take_live(self, key: LiveKey) -> Live | None:
        """The live ids of chain ``key``, removed from the cache (the caller is about to update
        them in place into the next version's; not counted as a hit or a miss)."""
        return self._live.pop(key)

    def put_live(self, key: LiveKey, live: Live) -> None:
        self._live.put(key, live)
        log.debug("live ids cached", extra=kv(version=key[0][0], tables=len(live)))


def advance_live(parent: Live, written: Live, removed: dict[str, np.ndarray],
                 at: dict[str, tuple[np.ndarray, np.ndarray]] | None = None, inplace: bool = False) -> Live:
    """The live ids after a delta: ``parent`` minus ``removed``, rows in ``written`` added or replaced.

    All id arrays sorted unique; vectorized (searchsorted, ``np.delete`` / ``np.insert`` only
    when ids go or come; no re-sort of the parent's ids, no search of every parent id).

    Args:
        parent: table -> (sorted ids, fingerprints) at the parent version.
        written: table -> (sorted ids, fingerprints) of the rows this delta writes.
        removed: table -> sorted ids this delta removes (ids of ``parent``, none of them written).
        at: table -> (position in the parent's ids, found there) of each written id, when the
            caller has them (``np.searchsorted(parent ids, written ids)``); else searched here.
        inplace: the caller owns ``parent`` (taken out of the cache): fingerprints of replaced
            rows are updated in its arrays instead of a copy (16 B/row saved per delta); its
            arrays must not be read as the parent's afterwards.
    """
    out: Live = {}
    empty = (np.zeros(0, np.int64), np.zeros(0, np.uint64))
    for t in set(parent) | set(written) | set(removed):
        ids, fp = parent.get(t, empty)
        w_ids, w_fp = written.get(t, empty)
        if w_ids.size:
            pos, known = at[t] if at is not None and t in at else locate(ids, w_ids)
            if known.any():
                if not inplace:
                    fp = fp.copy()
                fp[pos[known]] = w_fp[known]
        gone = removed.get(t)
        if gone is not None and gone.size and ids.size:
            g_pos, g_found = locate(ids, gone)
            ids, fp = np.delete(ids, g_pos[g_found]), np.delete(fp, g_pos[g_found])
        if w_ids.size:
            fresh = ~known
            if fresh.any():  # (np.insert copies the whole table even when nothing is inserted)
                f_ids = w_ids[fresh]
                ins = np.searchsorted(ids, f_ids)
                ids, fp = np.insert(ids, ins, f_ids), np.insert(fp, ins, w_fp[fresh])
        out[t] = (ids, fp)
    return out


def locate(ref: np.ndarray, x: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """(position, found) of each ``x`` in the sorted array ``ref``: one searchsorted.

    ``position`` is where ``x`` is (found) or would be inserted (not found), as
    ``np.searchsorted(ref, x)``; for not found values it may equal ``ref.size``.
    """
    pos = np.searchsorted(ref, x)
    found = pos < ref.size
    found[found] = ref[pos[found]] == x[found]
    return pos, found
