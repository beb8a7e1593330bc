"""Adaptation ships: what a bundle carries to fine-tune per task at serving time, and the predictor.

A G-Meta model is meant to be served *adapted*: a few SGD steps on a task's
(user's) first interactions, then scoring. The TorchScript ``dense.pt`` cannot
run the inner loop (it needs gradients through the model), so a bundle also
carries::

    adapt_params.npz      the base dense parameters the inner loop starts from
                          (every ``model.named_parameters()`` tensor, so learned
                          inner rates that live in the model ship with it)
    manifest.json adapt   the recipe: {"version": 1, "meta": [meta] as trained
                          (inner_steps, inner_lr, adapt target, ...; every field of
                          MetaConfig, so new ones ship when they land), "meta_from",
                          "params": file name, "unseen": "init", "init": per table
                          {kind, scale, seed}, "init_from"}

Serving (``load_bundle(path).adapt(support, keys).predict(features, keys)``)
rebuilds the eager model from the manifest's schema and model config, loads the
base parameters, and runs the trainer's own :func:`models.meta.adapt_and_predict`
(``torch.func`` under ``vmap``: vectorized over tasks, no loop over rows or
tasks), so a bundle's adapted scores equal the trainer's adapted scores.

Unseen ids (one rule, training and serving): an id the bundle has no row for
reads as the **PS's initial row of that id** -- deterministic per (table, id,
seed), :class:`ps.initializer.RowInitializer` -- exactly what a PS pull returns
for it during training-time evaluation. The init spec comes from the
checkpoint's ``[ps]`` config (``init_from = "checkpoint"``), or the ``[ps]``
defaults when the checkpoint has none (``"defaults"``, logged as a warning).
Bundles exported before this recipe existed (no ``adapt`` in the manifest)
serve zero rows and cannot adapt.

Rows of query tasks without any support row are scored by the base model.

The per-task logit offset (``[meta] offset_steps`` / ``offset_prior``,
:mod:`models.meta_offset`) ships in the recipe's ``meta`` like every other
field and runs inside ``adapt_and_predict``, as in the trainer.

MetaEmb (``[meta] meta_emb``): the generator ships with the learned rates in
``adapt_params.npz`` (``meta_learner.meta_emb_*``), and adaptation replaces the
rows of unseen ids -- by the same rule as the trainer: a row equal to the
recipe's initial row of its id (:mod:`models.meta_emb`) -- with generated rows
before the inner loop, so a bundle adapts exactly as the trainer evaluates.

Example::

    served = load_bundle("bundles")
    pred = served.adapt(support_features, support_keys)     # flat [N] rows with labels + their task keys
    probs = pred.predict(query_features, query_keys)        # {"click": tensor[M], ...}
"""

from __future__ import annotations

import logging
from pathlib import Path
from typing import Any, Protocol

import numpy as np
import torch

from delivery.bundle import BundleManifest, DeliveryError
from meta_io.batch import FeatureBatch, PlainBatch
from meta_io.schema import PAD_ID, Schema
from metaps.core.config import from_mapping, to_dict
from metaps.core.errors import ConfigError
from metaps.core.log import kv


class ServingModel(Protocol):
    """What adaptation needs of a loaded bundle (``delivery.loader.ServingModel`` is one;
    typed here by a Protocol so the loader can import this module without a circle)."""

    path: Path
    manifest: BundleManifest
    schema: Schema
    heads: list[str]

    def _lookup_unique(self, table: str, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]: ...

    def count_lookups(self, found: np.ndarray) -> None: ...

    def predict(self, batch: FeatureBatch | PlainBatch) -> dict[str, torch.Tensor]: ...

log = logging.getLogger(__name__)

RECIPE_VERSION = 1
ADAPT_PARAMS = "adapt_params.npz"


def adapt_recipe(info: dict[str, Any], tables: list[str], where: str) -> dict[str, Any]:
    """The manifest's ``adapt`` record for a checkpoint's info (its ``[meta]`` and ``[ps]`` config).

    Args:
        info: the checkpoint manifest's ``info`` (``job`` holds the job config when a trainer wrote it).
        tables: the model's embedding tables.
        where: names the checkpoint in errors.

    Raises:
        DeliveryError: the checkpoint's ``[meta]`` or ``[ps]`` config is invalid.
    """
    from models.meta_config import MetaConfig
    from ps.config import PsConfig

    job = info.get("job") or {}
    meta_raw = info.get("meta") or job.get("meta")
    ps_raw = job.get("ps")
    try:
        meta = from_mapping(MetaConfig, meta_raw or {}, where=f"{where}: info.job.meta")
        ps = from_mapping(PsConfig, ps_raw or {}, where=f"{where}: info.job.ps")
        tcfgs = {t.name: t for t in ps.table_configs(list(tables))}
    except (ConfigError, ValueError) as exc:
        raise DeliveryError(str(exc)) from None
    if ps_raw is None:
        log.warning("checkpoint has no [ps] config; unseen ids will read the default initial rows",
                    extra=kv(checkpoint=where, seed=ps.seed))
    init = {t: {"kind": getattr(c.init, "value", c.init), "scale": float(c.init_scale), "seed": int(ps.seed)}
            for t, c in tcfgs.items()}
    return {
        "version": RECIPE_VERSION, "meta": to_dict(meta), "meta_from": "checkpoint" if meta_raw else "defaults",
        "params": ADAPT_PARAMS, "unseen": "init", "init": init, "init_from": "checkpoint" if ps_raw else "defaults",
    }


def learned_rate_names(src: Any, model: torch.nn.Module, recipe: dict[str, Any]) -> list[str]:
    """Names of the learned inner-loop values (``meta_learner.*``) a recipe's model has ([] when none).

    Args:
        src: the :class:`~delivery.export.CheckpointSource` (named in errors).
        model: the checkpoint's model.
        recipe: :func:`adapt_recipe`'s record (its ``meta``).
    """
    from models.meta_config import MetaConfig
    from models.meta_learner import MetaLearner

    learner = MetaLearner(model, from_mapping(MetaConfig, recipe["meta"], where=f"{src.path}: adapt.meta"))
    return [n for n, _ in learner.store_named_parameters()]


def learned_values(src: Any, names: list[str]) -> dict[str, np.ndarray]:
    """The checkpoint's values of the learned inner-loop parameters ``names`` (float32; {} for none): the
    ``meta_learner.*`` dense values, i.e. the Meta-SGD rates of ``[meta] learn_inner_lr`` and the MetaEmb
    generators of ``[meta] meta_emb`` (names from :func:`learned_rate_names`).

    Raises:
        DeliveryError: the checkpoint lacks one of them.
    """
    if not names:
        return {}
    values = src.dense(names)
    missing = [n for n in names if n not in values]
    if missing:
        raise DeliveryError(f"{src.path}: [meta] learn_inner_lr or meta_emb is set but the checkpoint lacks {missing[:3]}")
    return {n: np.asarray(values[n], np.float32) for n in names}


def write_adapt_params(model: torch.nn.Module, staging: Path, extra: dict[str, np.ndarray] | None = None) -> None:
    """``staging/adapt_params.npz``: every dense parameter of the trained model (float32), and
    ``extra`` (the learned inner rates, ``meta_learner.*``)."""
    values = {n: p.detach().cpu().numpy().astype(np.float32) for n, p in model.named_parameters()}
    values.update(extra or {})
    with open(staging / ADAPT_PARAMS, "wb") as fh:
        np.savez(fh, **values)  # type: ignore[arg-type]


def unseen_initializers(recipe: dict[str, Any], dims: dict[str, int]) -> dict[str, Any]:
    """table -> callable ids -> initial rows (the PS's), from a recipe's ``init`` record."""
    from ps.config import InitKind
    from ps.initializer import RowInitializer

    out: dict[str, Any] = {}
    for t, spec in (recipe.get("init") or {}).items():
        if t in dims:
            out[t] = RowInitializer(t, dims[t], InitKind(spec["kind"]), float(spec["scale"]), int(spec["seed"]))
    return out


def _group(keys: np.ndarray, tasks: np.ndarray) -> np.ndarray:
    """int64 ``[len(tasks), max rows]``: the rows of each (sorted) task in input order, -1 padded."""
    pos = np.searchsorted(tasks, keys).clip(max=max(tasks.shape[0] - 1, 0))
    valid = (tasks.shape[0] > 0) & (tasks[pos] == keys) if tasks.shape[0] else np.zeros(keys.shape[0], bool)
    rows = np.flatnonzero(valid)
    t = pos[rows]
    order = np.lexsort((rows, t))
    rows, t = rows[order], t[order]
    counts = np.bincount(t, minlength=tasks.shape[0])
    starts = np.concatenate([[0], np.cumsum(counts)[:-1]])
    slot = np.arange(rows.shape[0]) - starts[t]
    out = np.full((tasks.shape[0], int(counts.max()) if counts.size else 0), -1, dtype=np.int64)
    out[t, slot] = rows
    return out


def _gather(fb: FeatureBatch, idx: np.ndarray) -> FeatureBatch:
    """Rows ``idx`` ([T, S], -1 = padding) of a flat batch as a ``[T, S, ..]`` batch (padding masked, ids -1)."""
    it = torch.from_numpy(idx)
    pad = it < 0
    safe = it.clamp_min(0)
    g = fb.map(lambda x: x[safe])
    ids = {k: torch.where(pad[..., None], torch.full_like(v, PAD_ID), v) for k, v in g.ids.items()}
    return FeatureBatch(ids=ids, dense=g.dense, vectors=g.vectors, labels=g.labels, mask=g.mask.bool() & ~pad,
                        scenario=g.scenario, oracle=g.oracle)


def _flat(fb: FeatureBatch) -> FeatureBatch:
    lead = tuple(fb.mask.shape)
    if len(lead) == 1:
        return fb
    return fb.map(lambda t: t.reshape((-1,) + tuple(t.shape[len(lead):])))


class AdaptingModel:
    """The eager model of a bundle with its base parameters and inner-loop recipe.

    Args:
        serving: the loaded bundle (rows, schema, manifest).

    Raises:
        DeliveryError: the bundle carries no (or an unknown version of the) recipe,
            or its parameters do not fit the model.
    """

    def __init__(self, serving: ServingModel) -> None:
        from models.config import ModelConfig
        from models.factory import build_model
        from models.meta_config import MetaConfig

        m = serving.manifest
        rec = m.adapt
        where = f"{serving.path}/manifest.json"
        if not rec:
            raise DeliveryError(f"{where}: bundle carries no adaptation recipe (exported before adaptation "
                                f"shipped); deliver the checkpoint again to adapt")
        if rec.get("version") != RECIPE_VERSION:
            raise DeliveryError(f"{where}: adapt recipe version {rec.get('version')!r}; this reader knows {RECIPE_VERSION}")
        try:
            self.cfg = from_mapping(MetaConfig, rec["meta"], where=f"{where}: adapt.meta")
            model_cfg = from_mapping(ModelConfig, m.model, where=f"{where}: model")
        except ConfigError as exc:
            raise DeliveryError(str(exc)) from None
        self.serving = serving
        self.model = build_model(serving.schema, model_cfg)
        path = serving.path / str(rec.get("params", ADAPT_PARAMS))
        try:
            with np.load(path) as z:
                values = {k: z[k] for k in z.files}
        except (OSError, ValueError) as exc:
            raise DeliveryError(f"{path}: cannot read the base parameters: {exc}") from None
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                if name not in values:
                    raise DeliveryError(f"{path}: no value for parameter '{name}'")
                v = values[name]
                if v.size != p.numel():
                    raise DeliveryError(f"{path}: parameter '{name}': expected {tuple(p.shape)}, got {v.shape}")
                p.copy_(torch.from_numpy(np.asarray(v, np.float32).reshape(p.shape)))
        self.model.eval()
        from models.meta_learner import MetaLearner

        self.learner = MetaLearner(self.model, self.cfg)
        """The inner loop with its learned rates (``[meta] learn_inner_lr``): ``learner.inner_recipe()``."""
        try:
            self.learner.load_dense(values)
            if self.learner.meta_emb:  # the one unseen rule: a row equal to the PS's initial row of its id
                self.learner.set_init_rows(unseen_initializers(rec, dict(self.model.dims)))
        except ConfigError as exc:
            raise DeliveryError(f"{path}: {exc}") from None

    def rows_for(self, parts: list[FeatureBatch]) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``(unique_ids, rows)`` per model table over the id columns of ``parts`` (unseen ids: initial rows)."""
        tables = list(self.model.dims)
        per: dict[str, list[torch.Tensor]] = {t: [] for t in tables}
        for c in self.serving.schema.id_columns:
            if c.table_name in per:
                per[c.table_name] += [fb.ids[c.name].reshape(-1) for fb in parts]
        uniq: dict[str, torch.Tensor] = {}
        rows: dict[str, torch.Tensor] = {}
        for t, vs in per.items():
            v = torch.cat(vs) if vs else torch.zeros(0, dtype=torch.int64)
            u = torch.unique(v[v >= 0])
            found, r = self.serving._lookup_unique(t, u.numpy())
            self.serving.count_lookups(found)
            uniq[t], rows[t] = u, torch.from_numpy(r)
        return uniq, rows

    def adapted_probs(self, support: FeatureBatch, query: FeatureBatch) -> dict[str, torch.Tensor]:
        """Head -> ``[T, Q]`` after adapting each task on its support (``[T, S]``, labels needed)."""
        from models.meta import adapt_and_predict

        uniq, rows = self.rows_for([support, query])
        return adapt_and_predict(self.model, support, query, rows, uniq, self.learner)


class AdaptedPredictor:
    """Scores rows of tasks adapted on their support rows (see the module docstring).

    Args:
        adapting: the bundle's eager model and recipe.
        support: flat ``[N]`` support rows (labels required).
        keys: int64 ``[N]`` task key of each support row.
        tasks_per_batch: tasks adapted together (one ``vmap``).
    """

    def __init__(self, adapting: AdaptingModel, support: FeatureBatch, keys: np.ndarray, tasks_per_batch: int = 256) -> None:
        support = _flat(support)
        keys = np.asarray(keys, dtype=np.int64).reshape(-1)
        if keys.shape[0] != support.mask.shape[0]:
            raise DeliveryError(f"adapt: {keys.shape[0]} task keys for {support.mask.shape[0]} support rows")
        missing = [h for h in adapting.serving.heads if h not in support.labels]
        if missing:
            raise DeliveryError(f"adapt: the support rows have no label column for heads {missing}; "
                                f"adaptation trains on labeled support rows")
        if tasks_per_batch < 1:
            raise DeliveryError(f"adapt: tasks_per_batch must be >= 1, got {tasks_per_batch}")
        real = support.mask.numpy().astype(bool)
        self.adapting = adapting
        self.support = support
        self.keys = np.where(real, keys, np.iinfo(np.int64).min)  # padding rows belong to no task
        self.tasks = np.unique(keys[real])
        self.tasks_per_batch = tasks_per_batch

    def predict(self, features: FeatureBatch, keys: np.ndarray) -> dict[str, torch.Tensor]:
        """Head -> probabilities ``[M]`` for flat rows ``features`` of tasks ``keys``.

        Rows of a task with support rows are scored after adapting on them; the
        others by the base model (the bundle's TorchScript network).
        """
        features = _flat(features)
        keys = np.asarray(keys, dtype=np.int64).reshape(-1)
        if keys.shape[0] != features.mask.shape[0]:
            raise DeliveryError(f"predict: {keys.shape[0]} task keys for {features.mask.shape[0]} rows")
        out = {h: p.clone() for h, p in self.adapting.serving.predict(features).items()}
        tasks = np.intersect1d(self.tasks, keys)
        for lo in range(0, tasks.shape[0], self.tasks_per_batch):
            chunk = tasks[lo:lo + self.tasks_per_batch]
            s_idx, q_idx = _group(self.keys, chunk), _group(keys, chunk)
            probs = self.adapting.adapted_probs(_gather(self.support, s_idx), _gather(features, q_idx))
            sel = q_idx >= 0
            rows = torch.from_numpy(q_idx[sel])
            for h, p in probs.items():
                out[h][rows] = p[torch.from_numpy(sel)].to(out[h].dtype)
        return out
