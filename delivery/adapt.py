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

The served recipe (the gate's choice, :mod:`delivery.adapt_select`): when the deliver gate had a
holdout, it scored a few adaptation recipes (:class:`Recipe`: no adaptation, an offset only, inner
steps at a few ``inner_lr`` scales, inner steps + offset) on the holdout's users under first-k and
recorded the candidates' figures and the winner in the manifest's gate record::

    manifest.json gate.adapt   {"selected": true, "protocol": "first-k", "k": 8, "candidates": [...],
                                "configured": {...}, "choice": {"inner_steps", "inner_lr",
                                "inner_lr_rows", "offset_steps", "offset_prior"}, "diverged": [...]}

The gate record is what the delivery job persists after the gate, so the choice lives there (the
``adapt`` record above is written at export, before the gate ran). :class:`AdaptingModel` serves
``gate.adapt.choice`` when present, else the configured recipe (``adapt.meta``'s inner steps, rate
and offset). A choice with ``inner_steps = 0`` is served without the inner loop: ``offset_steps = 0``
scores every row with the base network (no adaptation), ``offset_steps > 0`` adds each task's
Newton logit offset (:func:`models.meta_offset.fit_offsets`) fitted on the base model's support
logits (the offset-only recipe of ``[meta]``, ``inner_steps = 0`` with ``offset_steps > 0``). A choice with
inner steps serves its dense rate ``inner_lr`` and rows rate ``inner_lr_rows`` (the gate scales both).
Learned inner rates (``learn_inner_lr``) and MetaEmb ride along with any choice that has
inner steps; ``inner_lr`` of a choice replaces the fixed rate only (the selector varies it only
when the rates are not learned).

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

import dataclasses
import logging
import math
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np
import torch

from delivery.bundle import BundleManifest, DeliveryError
from meta_io.batch import FeatureBatch, PlainBatch
from meta_io.schema import PAD_ID, Schema
from common.config import from_mapping, to_dict
from common.errors import ConfigError
from common.log import kv

if TYPE_CHECKING:
    from models.meta_config import MetaConfig
    from models.meta_learner import MetaLearner


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


@dataclass(frozen=True)
class Recipe:
    """One way to adapt a task at serving time (what the gate chooses among, what a bundle serves).

    Args:
        inner_steps: inner SGD steps on the task's support rows (0: none).
        inner_lr: their fixed rate of the dense parameters (``[meta] inner_lr``; ignored without inner
            steps, and when the rates are learned).
        offset_steps: Newton iterations of the per-task logit offset (0: none); with
            ``inner_steps = 0`` the offset is fitted on the base model's logits.
        offset_prior: the offset's prior precision (> 0).
        inner_lr_rows: the embedding rows' fixed rate (``[meta] inner_lr_rows``; 0: ``inner_lr``, one rate
            for both; ignored like ``inner_lr``). The gate scales it with ``inner_lr``.
    """

    inner_steps: int
    inner_lr: float
    offset_steps: int = 0
    offset_prior: float = 16.0
    inner_lr_rows: float = 0.0

    @property
    def kind(self) -> str:
        """``none``, ``offset``, ``inner`` or ``inner+offset``."""
        if self.inner_steps == 0:
            return "offset" if self.offset_steps else "none"
        return "inner+offset" if self.offset_steps else "inner"

    @property
    def simplicity(self) -> int:
        """0 (no adaptation) .. 3 (inner steps + offset): ties go to the lower."""
        return ("none", "offset", "inner", "inner+offset").index(self.kind)

    @property
    def name(self) -> str:
        """A short label, e.g. ``inner(1x0.03)+offset(4, prior 16)``, ``inner(1x0.03, rows 0.3)``."""
        parts = []
        if self.inner_steps:
            rows = f", rows {self.inner_lr_rows:g}" if self.inner_lr_rows else ""
            parts.append(f"inner({self.inner_steps}x{self.inner_lr:g}{rows})")
        if self.offset_steps:
            parts.append(f"offset({self.offset_steps}, prior {self.offset_prior:g})")
        return "+".join(parts) or "none"

    @property
    def inner_loop(self) -> "Recipe":
        """This recipe without its offset: the inner loop its "+ offset" variants share (the gate adapts once
        for all of them)."""
        return Recipe(self.inner_steps, self.inner_lr, inner_lr_rows=self.inner_lr_rows)

    def to_dict(self) -> dict[str, Any]:
        return {"kind": self.kind, "inner_steps": self.inner_steps, "inner_lr": self.inner_lr,
                "inner_lr_rows": self.inner_lr_rows, "offset_steps": self.offset_steps,
                "offset_prior": self.offset_prior}

    @classmethod
    def from_dict(cls, raw: Any, where: str) -> "Recipe":
        """A recipe from its :meth:`to_dict` record.

        Raises:
            DeliveryError: a field is missing or out of range (named, with ``where``).
        """
        if not isinstance(raw, dict):
            raise DeliveryError(f"{where}: expected a recipe mapping, got {type(raw).__name__}")
        try:
            r = cls(int(raw["inner_steps"]), float(raw["inner_lr"]), int(raw.get("offset_steps", 0)),
                    float(raw.get("offset_prior", 16.0)), float(raw.get("inner_lr_rows", 0.0)))
        except (KeyError, TypeError, ValueError) as exc:
            raise DeliveryError(f"{where}: bad recipe {raw!r}: {exc!r}") from None
        if r.inner_steps < 0 or r.offset_steps < 0:
            raise DeliveryError(f"{where}: inner_steps and offset_steps must be >= 0, got {r.inner_steps}, {r.offset_steps}")
        if not (r.inner_lr > 0 and math.isfinite(r.inner_lr)) or not (r.offset_prior > 0 and math.isfinite(r.offset_prior)):
            raise DeliveryError(f"{where}: inner_lr and offset_prior must be finite and > 0, "
                                f"got {r.inner_lr}, {r.offset_prior}")
        if not (r.inner_lr_rows >= 0 and math.isfinite(r.inner_lr_rows)):
            raise DeliveryError(f"{where}: inner_lr_rows must be finite and >= 0 (0: inner_lr), got {r.inner_lr_rows}")
        return r

    @classmethod
    def configured(cls, cfg: "MetaConfig") -> "Recipe":
        """The recipe a ``[meta]`` config runs (its inner steps, rate and offset; ``inner_steps = 0`` with
        ``offset_steps > 0`` is the offset-only recipe)."""
        return cls(cfg.inner_steps, cfg.inner_lr, cfg.offset_steps, cfg.offset_prior, cfg.inner_lr_rows)

    def meta(self, trained: "MetaConfig") -> "MetaConfig":
        """``trained`` with this recipe's inner loop and offset (``inner_steps = 0``: none, or the offset alone)."""
        return dataclasses.replace(trained, inner_steps=self.inner_steps, inner_lr=self.inner_lr,
                                   inner_lr_rows=self.inner_lr_rows, offset_steps=self.offset_steps,
                                   offset_prior=self.offset_prior)

    def evaluate_args(self, learned_rates: bool = False) -> list[str]:
        """The ``metaps evaluate`` flags that score this recipe on a bundle or checkpoint (every recipe the gate
        can serve is one ``metaps evaluate`` can score): the inner steps, the rates, the offset's steps and prior.

        Args:
            learned_rates: the model's inner rates are learned (``[meta] learn_inner_lr``): no ``--inner-lr`` /
                ``--inner-lr-rows`` (they would replace the learned rates by fixed ones; the gate varies the
                rates only when fixed).

        Example::

            >>> Recipe(1, 0.03, 4, 1.0).evaluate_args()
            ['--inner-steps', '1', '--inner-lr', '0.03', '--inner-lr-rows', '0.0', '--offset-steps', '4', '--offset-prior', '1.0']
        """
        out = ["--inner-steps", str(self.inner_steps)]
        if self.inner_steps and not learned_rates:
            out += ["--inner-lr", repr(float(self.inner_lr)), "--inner-lr-rows", repr(float(self.inner_lr_rows))]
        out += ["--offset-steps", str(self.offset_steps)]
        if self.offset_steps:
            out += ["--offset-prior", repr(float(self.offset_prior))]
        return out


def served_choice(manifest: BundleManifest, where: str) -> Recipe | None:
    """The gate's chosen recipe recorded in ``manifest.gate["adapt"]["choice"]`` (None: not selected).

    Raises:
        DeliveryError: the record is malformed.
    """
    rec = (manifest.gate or {}).get("adapt") or {}
    raw = rec.get("choice") if isinstance(rec, dict) else None
    return None if raw is None else Recipe.from_dict(raw, f"{where}: gate.adapt.choice")


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


def offset_only_probs(
    model: Any, support: FeatureBatch, query: FeatureBatch, uniq: dict[str, torch.Tensor],
    rows: dict[str, torch.Tensor], steps: int, prior: float,
) -> dict[str, torch.Tensor]:
    """Head -> ``sigmoid(base query logit + the task's Newton offset)`` ``[T, Q]``, the offset fitted on the
    base model's support logits (:func:`models.meta_offset.fit_offsets`, one task per ``vmap`` slot).

    Args:
        model: the eager model (its logits are the ones the loss sees: ESMM's CTCVR logit).
        support: ``[T, S]`` labeled support rows.
        query: ``[T, Q]`` rows to score.
        uniq: table -> sorted ids of both.
        rows: table -> their rows.
        steps: Newton iterations (>= 1).
        prior: the offset's prior precision (> 0).
    """
    return offset_probs(model.heads, model(support, rows, uniq), model(query, rows, uniq), support, steps, prior)


def offset_probs(
    heads: Any, z_s: dict[str, torch.Tensor], z_q: dict[str, torch.Tensor], support: FeatureBatch, steps: int,
    prior: float,
) -> dict[str, torch.Tensor]:
    """Head -> ``sigmoid(z_q + the task's Newton offset fitted on z_s)`` ``[T, Q]``: the offset is a post-hoc
    per-task shift of given logits (the base model's, or an inner loop's adapted ones), one task per ``vmap`` slot.

    Args:
        heads: the model's heads (their training targets).
        z_s: head -> ``[T, S]`` support logits; z_q: head -> ``[T, Q]`` query logits.
        support: ``[T, S]`` labeled support rows (labels and mask).
        steps: Newton iterations (>= 1); prior: the offset's prior precision (> 0).
    """
    from torch.func import vmap

    from models.meta_offset import fit_offsets, shift

    def one(z: dict[str, torch.Tensor], labels: dict[str, torch.Tensor], mask: torch.Tensor) -> dict[str, torch.Tensor]:
        fb = FeatureBatch(ids={}, dense=mask, vectors={}, labels=labels, mask=mask, scenario=mask)
        return fit_offsets(z, fb, heads, steps, prior)

    offsets = vmap(one)(z_s, support.labels, support.mask)  # head -> [T]
    shifted = shift(z_q, {h: b[:, None] for h, b in offsets.items()})
    return {h: torch.sigmoid(z) for h, z in shifted.items()}


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
            self.trained = from_mapping(MetaConfig, rec["meta"], where=f"{where}: adapt.meta")
            model_cfg = from_mapping(ModelConfig, m.model, where=f"{where}: model")
        except ConfigError as exc:
            raise DeliveryError(str(exc)) from None
        choice = served_choice(m, where)
        self.recipe: Recipe = choice if choice is not None else Recipe.configured(self.trained)
        """The recipe served: the gate's choice, else the configured one."""
        self.recipe_from = "gate" if choice is not None else "configured"
        self.cfg: MetaConfig = self.recipe.meta(self.trained) if self.recipe.inner_steps else self.trained
        """The inner loop of the served recipe (the trained ``[meta]`` when it has no inner steps)."""
        self.serving = serving
        self.model = build_model(serving.schema, model_cfg)
        path = serving.path / str(rec.get("params", ADAPT_PARAMS))
        try:
            with np.load(path) as z:
                values: dict[str, np.ndarray] = {k: z[k] for k in z.files}
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
        self._values = values
        self._params_path = path
        self.learner = self.learner_for(self.cfg)
        """The inner loop with its learned rates (``[meta] learn_inner_lr``): ``learner.inner_recipe()``."""

    def learner_for(self, cfg: "MetaConfig") -> "MetaLearner":
        """The inner loop ``cfg`` with the bundle's learned values (Meta-SGD rates, MetaEmb generators).

        Raises:
            DeliveryError: the bundle's parameters lack a learned value ``cfg`` needs.
        """
        from models.meta_learner import MetaLearner

        learner = MetaLearner(self.model, cfg)
        try:
            learner.load_dense(self._values)
            if learner.meta_emb:  # the one unseen rule: a row equal to the PS's initial row of its id
                learner.set_init_rows(unseen_initializers(self.serving.manifest.adapt, dict(self.model.dims)))
        except ConfigError as exc:
            raise DeliveryError(f"{self._params_path}: {exc}") from None
        return learner

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
        """Head -> ``[T, Q]`` after adapting each task on its support (``[T, S]``, labels needed) by the
        served recipe (:attr:`recipe`)."""
        uniq, rows = self.rows_for([support, query])
        return self.recipe_probs(self.recipe, support, query, uniq, rows, self.learner)

    def recipe_probs(
        self, recipe: Recipe, support: FeatureBatch, query: FeatureBatch, uniq: dict[str, torch.Tensor],
        rows: dict[str, torch.Tensor], learner: "MetaLearner | None" = None,
    ) -> dict[str, torch.Tensor]:
        """Head -> ``[T, Q]`` probabilities of the query rows adapted by ``recipe`` (no gradient kept).

        Args:
            recipe: the adaptation (module docstring: ``inner_steps = 0`` runs no inner loop).
            support: ``[T, S]`` labeled support rows.
            query: ``[T, Q]`` rows to score.
            uniq: table -> sorted ids of support and query (:meth:`rows_for`).
            rows: table -> their rows.
            learner: the inner loop of ``recipe`` (built by :meth:`learner_for` when None).
        """
        if recipe.inner_steps > 0:
            from models.meta import adapt_and_predict

            lrn = learner if learner is not None else self.learner_for(recipe.meta(self.trained))
            return adapt_and_predict(self.model, support, query, rows, uniq, lrn)
        with torch.no_grad():
            if recipe.offset_steps == 0:
                return self.model(query, rows, uniq, probabilities=True)
            return offset_only_probs(self.model, support, query, uniq, rows, recipe.offset_steps, recipe.offset_prior)


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
        if self.adapting.recipe.kind == "none":  # the gate chose no adaptation: the base scores every row
            return out
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
