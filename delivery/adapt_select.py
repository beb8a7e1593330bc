"""Choose the adaptation a bundle serves on validation users: never worse than not adapting.

The configured inner loop (``[meta] inner_steps`` / ``inner_lr``, optionally a per-task logit
offset) can lower a model's quality on new users: a plain-trained base adapted with the default
inner loop scored 0.794 -> 0.790 click AUC under first-k K=8 (issue 29). So before a bundle ships,
the deliver gate scores a small candidate set of :class:`~delivery.adapt.Recipe` s on its holdout
(users the model did not train on) and the bundle serves the best::

    candidates (simplest first, 16)                      scored on the holdout's episodes
      none            0 inner steps, no offset             first-k: per user the first K rows by time
      offset          Newton offset on the base logits,    are the support, every later row is a
                      priors OFFSET_PRIORS (1, 4, 16)       query row scored once (meta_io.firstk)
      inner           the configured steps at inner_lr x    (a Meta-IO meta holdout: its episodes)
                      LR_SCALES (1 = the configured rate)
      inner+offset    each inner rate + the offset at      -> AUC per head over every query row,
                      each prior of OFFSET_PRIORS             the mean over heads with an AUC
      (the configured recipe, and its offset prior, are always candidates)
                                          |
    chosen = the simplest candidate whose mean AUC is within ``tie_tol`` of the best

The offset's prior is chosen with the rest of the recipe: a weak prior (1) keeps most of an offset's
gain where users truly differ, a strong one (16) guards against noise on a few support rows; which
wins depends on the data, so every prior is tried alone and after each inner rate. The "+ offset"
candidates of one inner rate share its adaptation: the offset is a per-task shift of the adapted
logits (:func:`delivery.adapt.offset_probs`), so the three priors cost three Newton fits of ``[T]``
scalars per head, not three inner loops.

"No adaptation" is the first candidate, so the chosen recipe's mean validation AUC is never below
the base's: either "none" itself is chosen, or a candidate beat it by more than ``tie_tol``.
Every candidate is scored on the same episodes, with the bundle's own rows and parameters
(:class:`~delivery.adapt.AdaptingModel`), vectorized over tasks (``vmap``); no loop over rows.

The result (:class:`Selection`) goes into the gate's record (``manifest.json`` ``gate.adapt``:
the candidates' figures, the configured recipe, the choice), and serving reads the choice from
there (:func:`delivery.adapt.served_choice`). When the selection cannot run (no holdout, a holdout
without a timestamp or labels, a bundle without an adaptation recipe) the configured recipe ships
and the record says why.

Example::

    sel = select_recipe(load_bundle(staging, verify=False), "holdout/", k=8)
    sel.chosen.name, sel.record()["candidates"]
"""

from __future__ import annotations

import dataclasses
import logging
import math
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from delivery.adapt import AdaptingModel, Recipe
from delivery.bundle import BundleManifest, DeliveryError
from delivery.holdout import Holdout
from meta_io.batch import FeatureBatch, MetaBatch
from meta_io.schema import Schema
from common.errors import MetapsError
from common.evaluation import auc
from common.log import kv

log = logging.getLogger(__name__)

DEFAULT_K = 8
"""Support rows per validation user (first-k), the cold-start setting of issue 29."""
LR_SCALES = (0.1, 0.3, 1.0)
"""Multiples of the configured ``inner_lr`` tried (1.0: the configured rate)."""
OFFSET_PRIORS = (1.0, 4.0, 16.0)
"""Prior precisions of the offset-only candidates."""
OFFSET_STEPS = 4
"""Newton iterations of an added offset (the fit is converged well before; the configured count is kept when set)."""
TIE_TOL = 1e-4
"""Mean AUCs within this of the best are a tie: the simpler recipe wins (then the one whose inner step
diverged on fewer episodes)."""
DIVERGED_WARN = 0.1
"""An inner loop that raised the support loss (or left it non-finite) on more than this share of the
validation episodes is named in the gate's record (``diverged``), its summary line and a warning log."""


@dataclass(frozen=True)
class Scored:
    """One candidate's validation figures.

    Args:
        recipe: the candidate.
        auc: head -> AUC over the validation query rows (nan: the head's labels have one class).
        mean_auc: mean over heads with an AUC (nan when none has one).
        diverged: validation episodes whose inner steps raised the support loss or left it non-finite
            (:func:`models.meta.adapt_tasks`' check; 0 without inner steps).
        adapted: validation episodes the inner steps ran on (0 without inner steps).
    """

    recipe: Recipe
    auc: dict[str, float]
    mean_auc: float
    diverged: int = 0
    adapted: int = 0

    @property
    def diverged_share(self) -> float:
        """``diverged / adapted`` (0.0 without inner steps)."""
        return self.diverged / self.adapted if self.adapted else 0.0

    def divergence(self) -> str:
        """E.g. ``inner step raised the support loss on 37% of 240 validation episodes`` ('' without inner steps)."""
        if not self.adapted:
            return ""
        return (f"inner step raised the support loss on {100 * self.diverged_share:.0f}% of {self.adapted} "
                f"validation episodes")

    def to_dict(self) -> dict[str, Any]:
        out = {"name": self.recipe.name, "recipe": self.recipe.to_dict(), "auc": self.auc, "mean_auc": self.mean_auc}
        if self.adapted:
            out["inner_diverged"] = {"episodes": self.adapted, "diverged": self.diverged,
                                     "share": self.diverged_share}
        return out


@dataclass
class Selection:
    """The outcome of :func:`select_recipe` (or why it did not run).

    Args:
        selected: the candidates were scored and ``chosen`` is the best of them.
        configured: the recipe the bundle's ``[meta]`` config runs.
        chosen: the recipe to serve (``configured`` when not selected).
        reason: why the selection did not run ('' when it did).
        protocol: ``first-k`` or ``episodes``.
        k: support rows per user (first-k).
        tasks: validation episodes scored.
        rows: validation query rows scored.
        candidates: every candidate's figures, simplest first.
        learned_rates: the bundle's inner rates are learned (``[meta] learn_inner_lr``): the choice's
            ``metaps evaluate`` flags leave the rate out.
    """

    selected: bool
    configured: Recipe | None
    chosen: Recipe | None
    reason: str = ""
    protocol: str = ""
    k: int = 0
    tasks: int = 0
    rows: int = 0
    candidates: list[Scored] = field(default_factory=list)
    learned_rates: bool = False

    def record(self) -> dict[str, Any]:
        """The manifest's ``gate.adapt`` record (``choice`` only when selected: serving reads it)."""
        out: dict[str, Any] = {"selected": self.selected,
                               "configured": self.configured.to_dict() if self.configured else None}
        if not self.selected:
            out["reason"] = self.reason
            return out
        assert self.chosen is not None
        by = {s.recipe: s for s in self.candidates}
        base, best = self.base(), by[self.chosen]
        conf = by.get(self.configured) if self.configured else None
        out.update({
            "protocol": self.protocol, "k": self.k, "tasks": self.tasks, "rows": self.rows,
            "candidates": [s.to_dict() for s in self.candidates],
            "choice": self.chosen.to_dict(), "choice_name": self.chosen.name,
            "choice_evaluate": self.chosen.evaluate_args(self.learned_rates),
            "choice_auc": best.auc, "base_auc": base.auc,
            "configured_auc": conf.auc if conf is not None else None,
            "diverged": self.diverging(),
        })
        return out

    def diverging(self) -> list[str]:
        """One line per inner loop (candidates sharing it count once) that raised the support loss on more
        than :data:`DIVERGED_WARN` of the validation episodes, e.g. ``inner(1x1): inner step raised the
        support loss on 37% of 240 validation episodes``."""
        return list(self._diverging_loops().values())

    def _diverging_loops(self) -> dict[Recipe, str]:
        """:meth:`diverging`'s lines keyed by the inner loop (:attr:`~delivery.adapt.Recipe.inner_loop`)."""
        out: dict[Recipe, str] = {}
        for s in self.candidates:
            if s.adapted and s.diverged_share > DIVERGED_WARN:
                loop = s.recipe.inner_loop
                out.setdefault(loop, f"{loop.name}: {s.divergence()}")
        return out

    def base(self) -> Scored:
        """The "no adaptation" candidate's figures (always scored when selected)."""
        return next(s for s in self.candidates if s.recipe.kind == "none")

    def summary(self) -> str:
        """One line for a report: the choice and its gain over no adaptation and over the configured recipe."""
        if not self.selected:
            return f"adaptation not selected ({self.reason}); the configured recipe ships"
        by = {s.recipe: s for s in self.candidates}
        assert self.chosen is not None
        best = by[self.chosen].mean_auc
        base = self.base().mean_auc
        conf = by[self.configured].mean_auc if self.configured in by else float("nan")
        line = (f"adaptation chosen on {self.tasks} validation episodes ({self.protocol}, k={self.k}): "
                f"{self.chosen.name}, mean AUC {best:.5f} (no adaptation {base:.5f}, configured {conf:.5f})")
        if by[self.chosen].diverged:
            line += f"; its {by[self.chosen].divergence()}"
        others = [d for loop, d in self._diverging_loops().items() if loop != self.chosen.inner_loop]
        if others:
            line += "; diverging: " + "; ".join(others)
        return line


def candidate_recipes(
    configured: Recipe, learned_rates: bool = False, lr_scales: Sequence[float] = LR_SCALES,
    offset_priors: Sequence[float] = OFFSET_PRIORS, offset_steps: int = OFFSET_STEPS,
) -> list[Recipe]:
    """The candidate set, simplest first, no duplicates; ``Recipe(0, lr)`` (no adaptation) is first.

    ``1 + P + R + R x P`` recipes for ``R`` inner rates and ``P`` offset priors (16 with the defaults):
    none; an offset alone at each prior; each inner rate alone; each inner rate + an offset at each
    prior (the prior is chosen with the rate, not fixed); the configured recipe when it is none of these.

    Args:
        configured: the bundle's configured recipe (always a candidate).
        learned_rates: the inner rates are learned (Meta-SGD): only the configured rate is tried.
        lr_scales: multiples of the configured ``inner_lr`` (and ``inner_lr_rows`` when set) for the inner
            candidates.
        offset_priors: priors of the offset candidates, alone and after each inner rate
            (:func:`offset_candidate_priors`: the configured prior is added).
        offset_steps: Newton iterations of an added offset (the configured count when it has one).
    """
    lr, rows = configured.inner_lr, configured.inner_lr_rows
    steps = configured.inner_steps or 1
    o_steps = configured.offset_steps or offset_steps
    priors = offset_candidate_priors(configured, offset_priors)
    scales = (1.0,) if learned_rates else tuple(lr_scales)
    out = [Recipe(0, lr)]
    out += [Recipe(0, lr, o_steps, p) for p in priors]
    out += [Recipe(steps, lr * s, inner_lr_rows=rows * s) for s in scales]
    out += [Recipe(steps, lr * s, o_steps, p, rows * s) for s in scales for p in priors]
    out.append(configured)
    seen: dict[Recipe, None] = {}
    for r in out:
        seen.setdefault(_canonical(r), None)
    return sorted(seen, key=lambda r: r.simplicity)  # stable: the order above within a kind


def offset_candidate_priors(configured: Recipe, offset_priors: Sequence[float] = OFFSET_PRIORS) -> tuple[float, ...]:
    """The offset priors the candidates try: ``offset_priors`` in order, then the configured recipe's prior
    when it has an offset and the prior is not among them.

    Args:
        configured: the bundle's configured recipe.
        offset_priors: the priors tried whatever the configuration (:data:`OFFSET_PRIORS`).
    """
    priors = [float(p) for p in offset_priors]
    if configured.offset_steps:
        priors.append(float(configured.offset_prior))
    return tuple(dict.fromkeys(priors))


def _canonical(r: Recipe) -> Recipe:
    """Without an offset its prior is irrelevant, without inner steps the rows' rate: normalized (to 16, 0) so
    equal recipes deduplicate."""
    return Recipe(r.inner_steps, r.inner_lr, r.offset_steps, r.offset_prior if r.offset_steps else 16.0,
                  r.inner_lr_rows if r.inner_steps else 0.0)


def choose(scored: Sequence[Scored], tie_tol: float = TIE_TOL) -> Scored:
    """The simplest candidate whose mean AUC is within ``tie_tol`` of the best (candidates with a nan mean lose);
    among equally simple ones, the one whose inner step diverged on the smallest share of episodes (so a
    diverging loop never wins a tie against a stable one), then the first.

    Raises:
        DeliveryError: no candidate has a mean AUC.
    """
    good = [s for s in scored if not math.isnan(s.mean_auc)]
    if not good:
        raise DeliveryError("adaptation selection: no candidate has a validation AUC (every head's labels have one class)")
    best = max(s.mean_auc for s in good)
    return min((s for s in good if s.mean_auc >= best - tie_tol), key=lambda s: (s.recipe.simplicity, s.diverged_share))


def planned_candidates(manifest: BundleManifest) -> list[Recipe]:
    """The candidates :func:`select_recipe` scores for a bundle (without ``extra``), from its manifest alone
    ([] for a bundle without an adaptation recipe or with an unreadable one): the gate's progress total."""
    from common.config import from_mapping
    from models.meta_config import InnerLr, MetaConfig

    if not manifest.adapt:
        return []
    try:
        trained = from_mapping(MetaConfig, manifest.adapt.get("meta") or {}, where="adapt.meta")
    except (MetapsError, ValueError):
        return []
    return candidate_recipes(_canonical(Recipe.configured(trained)), InnerLr(trained.learn_inner_lr) is not InnerLr.OFF)


def validation_episodes(
    holdout: str | Path | Holdout, schema: Schema, k: int = DEFAULT_K, query_slots: int = 32,
    tasks_per_batch: int = 64,
) -> tuple[str, Iterator[MetaBatch]]:
    """``(protocol, meta batches)`` of a holdout: first-k of Parquet/CSV rows, or a Meta-IO meta dataset's episodes.

    Args:
        holdout: a path, or the gate's :class:`~delivery.holdout.Holdout` (rows it already read are not read again).

    Raises:
        DeliveryError: the holdout cannot give episodes (a plain Meta-IO layout, no timestamp column), named.
    """
    from common.errors import DataError

    data = holdout if isinstance(holdout, Holdout) else Holdout(holdout, schema)
    p = data.path
    if data.is_meta_io:
        if data.dataset().manifest.get("layout", "meta") != "meta":
            raise DeliveryError(f"{p}: a plain-layout Meta-IO holdout has no support/query episodes; "
                                f"give Parquet/CSV rows with a timestamp (first-k) or a meta layout")
        return "episodes", data.meta_batches()
    if not schema.timestamp:
        raise DeliveryError(f"{p}: the bundle's schema has no timestamp column; first-k orders each user's rows by time")
    from meta_io.firstk import first_k_batches

    try:
        return "first-k", first_k_batches(data.table(), schema, k, query_slots, tasks_per_batch)
    except DataError as exc:
        raise DeliveryError(f"{p}: cannot lay out first-k episodes: {exc}") from None


OnScored = Callable[[Scored, int, int], None]
"""Told ``(candidate's figures, candidates scored so far, candidates in all)`` as each candidate is done."""


@dataclass
class _Episodes:
    """One validation meta batch, prepared once for every candidate: its rows and lookup indices."""

    support: FeatureBatch
    query: FeatureBatch
    real: torch.Tensor
    uniq: dict[str, torch.Tensor]
    rows: dict[str, torch.Tensor]
    sup_idx: Any
    qry_idx: Any


def _prepare(adapting: AdaptingModel, batches: Iterable[MetaBatch], max_rows: int
             ) -> tuple[list[_Episodes], dict[str, np.ndarray], int, int]:
    """The validation batches with their rows and lookup indices, the targets per head, episodes, query rows."""
    heads = adapting.model.heads
    out: list[_Episodes] = []
    targets: dict[str, list[np.ndarray]] = {h.name: [] for h in heads}
    rows = tasks = 0
    for mb in batches:
        real = mb.query.mask.bool()
        if not bool(real.any()):
            continue
        uniq, table_rows = adapting.rows_for([mb.support, mb.query])
        sup_idx = adapting.model.lookup_index(mb.support, uniq, table_rows)
        qry_idx = adapting.model.lookup_index(mb.query, uniq, table_rows)
        out.append(_Episodes(mb.support, mb.query, real, uniq, table_rows, sup_idx, qry_idx))
        for h in heads:
            targets[h.name].append(h.target(mb.query)[real].numpy().astype(np.float64))
        rows += int(real.sum())
        tasks += int(real.any(dim=1).sum())
        if max_rows and rows >= max_rows:
            break
    if rows == 0:
        raise DeliveryError("adaptation selection: the holdout gave no validation episode (no user has more than k rows)")
    return out, {h: np.concatenate(v) for h, v in targets.items()}, tasks, rows


def _group_probs(adapting: AdaptingModel, group: Sequence[Recipe], ep: _Episodes, learner: Any
                 ) -> tuple[list[dict[str, torch.Tensor]], int, int]:
    """Head -> ``[T, Q]`` probabilities of each recipe of ``group`` (one inner loop, or none, shared by all),
    and ``(episodes whose inner steps raised the support loss or left it non-finite, episodes adapted)``
    (``0, 0`` without inner steps).

    The inner loop is :func:`models.meta.adapt_tasks` (the trainer's own adaptation path): the inner
    candidate's adapted query probabilities and, for its "+ offset" twins, the adapted query and support
    logits, which each twin shifts by its per-task Newton offset (:func:`delivery.adapt.offset_probs`:
    the offset is post-hoc, it never enters the inner loop); its divergence check comes with it.
    """
    from delivery.adapt import offset_probs

    model = adapting.model
    plain = any(r.offset_steps == 0 for r in group)
    shifted = any(r.offset_steps > 0 for r in group)
    diverged = adapted = 0
    if group[0].inner_steps == 0:
        with torch.no_grad():
            out: dict[str, Any] = {}
            if plain:
                out["p"] = model(ep.query, ep.rows, index=ep.qry_idx, probabilities=True)
            if shifted:
                out["zq"] = model(ep.query, ep.rows, index=ep.qry_idx)
                out["zs"] = model(ep.support, ep.rows, index=ep.sup_idx)
    else:
        from models.meta import adapt_tasks

        res = adapt_tasks(model, ep.support, ep.query, ep.rows, ep.uniq, learner, probs=plain, logits=shifted,
                          index=(ep.sup_idx, ep.qry_idx), measure=True)
        out = {"p": res.probs, "zq": res.query_logits, "zs": res.support_logits}
        diverged, adapted = int((res.diverged & res.real).sum()), int(res.real.sum())
    with torch.no_grad():
        probs = [out["p"] if r.offset_steps == 0 else
                 offset_probs(model.heads, out["zs"], out["zq"], ep.support, r.offset_steps, r.offset_prior)
                 for r in group]
    return probs, diverged, adapted


def score_recipes(
    adapting: AdaptingModel, batches: Iterable[MetaBatch], recipes: Sequence[Recipe], max_rows: int = 0,
    on_scored: OnScored | None = None,
) -> tuple[list[Scored], int, int]:
    """Every recipe's AUC per head on the query rows of ``batches`` (the same rows for all).

    Work is shared, results are each recipe's own: the batches are read and their rows and lookup
    indices built once; recipes with the same inner loop (``inner_steps``, ``inner_lr``; none for the
    offset-only ones) share one adaptation per batch, whose adapted logits their offsets shift.

    Args:
        adapting: the bundle's eager model, rows and parameters.
        batches: validation episodes (support ``[T, K]``, query ``[T, Q]``).
        recipes: the candidates.
        max_rows: stop after the batch that reaches this many query rows (0: all).
        on_scored: told each candidate's figures as it is done (the gate's progress); None: nothing told.

    Returns:
        ``(scored in the order of recipes, episodes, query rows)``.
    """
    import time

    eps, y, tasks, rows = _prepare(adapting, batches, max_rows)
    groups: dict[Recipe | None, list[int]] = {}  # the inner loop (None: no inner steps) -> its recipes
    for i, r in enumerate(recipes):
        groups.setdefault(r.inner_loop if r.inner_steps else None, []).append(i)
    log.info("scoring adaptation candidates", extra=kv(candidates=len(recipes), loops=len(groups), tasks=tasks,
                                                       rows=rows, batches=len(eps)))
    out: list[Scored | None] = [None] * len(recipes)
    done = 0
    for loop, idx in groups.items():
        t0 = time.monotonic()
        group = [recipes[i] for i in idx]
        learner = adapting.learner_for(loop.meta(adapting.trained)) if loop is not None else None
        per: list[dict[str, list[np.ndarray]]] = [{h: [] for h in y} for _ in group]
        diverged = adapted = 0
        for ep in eps:
            probs_of, d, n = _group_probs(adapting, group, ep, learner)
            diverged, adapted = diverged + d, adapted + n
            for j, probs in enumerate(probs_of):
                for h in y:
                    per[j][h].append(probs[h][ep.real].detach().numpy().astype(np.float64))
        for i, r, p in zip(idx, group, per):
            a = {h: float(auc(y[h], np.concatenate(v))) for h, v in p.items()}
            defined = [v for v in a.values() if not math.isnan(v)]
            out[i] = s = Scored(r, a, float(np.mean(defined)) if defined else float("nan"), diverged, adapted)
            done += 1
            log.info("adaptation candidate scored", extra=kv(
                candidate=r.name, mean_auc=round(s.mean_auc, 5), auc={h: round(v, 5) for h, v in a.items()},
                inner_diverged=round(s.diverged_share, 4), done=f"{done}/{len(recipes)}", left=len(recipes) - done,
                seconds=round(time.monotonic() - t0, 2)))
            if on_scored is not None:
                on_scored(s, done, len(recipes))
    return [s for s in out if s is not None], tasks, rows


def select_recipe(
    serving: Any, holdout: str | Path | Holdout, k: int = DEFAULT_K, *, max_rows: int = 0, tie_tol: float = TIE_TOL,
    lr_scales: Sequence[float] = LR_SCALES, offset_priors: Sequence[float] = OFFSET_PRIORS,
    extra: Sequence[Recipe] = (), tasks_per_batch: int = 64, on_scored: OnScored | None = None,
) -> Selection:
    """Score the candidate recipes on ``holdout``'s users and choose (module docstring).

    Args:
        serving: a loaded bundle (:class:`delivery.loader.ServingModel`) with an adaptation recipe.
        holdout: validation rows of users the model did not train on (Parquet/CSV with a timestamp:
            first-k; or a Meta-IO meta dataset: its episodes); a path or the gate's
            :class:`~delivery.holdout.Holdout`.
        k: support rows per user (first-k).
        max_rows: cap on the validation query rows (0: all).
        tie_tol: mean AUCs within this of the best tie (the simpler wins).
        lr_scales: multiples of the configured ``inner_lr`` tried.
        offset_priors: priors of the offset-only candidates.
        extra: more candidates (a test's deliberately harmful one).
        tasks_per_batch: episodes adapted together (one ``vmap``).
        on_scored: told each candidate's figures as it is done; None: nothing told.

    Raises:
        DeliveryError: the bundle cannot adapt, or the holdout gives no episodes / no AUC.
    """
    from models.meta_config import InnerLr

    adapting = AdaptingModel(serving)
    configured = _canonical(Recipe.configured(adapting.trained))
    learned = InnerLr(adapting.trained.learn_inner_lr) is not InnerLr.OFF
    recipes = candidate_recipes(configured, learned, lr_scales, offset_priors)
    for r in extra:
        if _canonical(r) not in recipes:
            recipes.append(_canonical(r))
    recipes.sort(key=lambda r: r.simplicity)
    protocol, batches = validation_episodes(holdout, serving.schema, k, tasks_per_batch=tasks_per_batch)
    scored, tasks, rows = score_recipes(adapting, batches, recipes, max_rows, on_scored)
    best = choose(scored, tie_tol)
    sel = Selection(True, configured, best.recipe, protocol=protocol, k=k if protocol == "first-k" else 0,
                    tasks=tasks, rows=rows, candidates=scored, learned_rates=learned)
    log.info("adaptation selected", extra=kv(bundle=serving.path, choice=best.recipe.name, mean_auc=round(best.mean_auc, 5),
                                             candidates=len(scored), tasks=tasks, rows=rows, protocol=protocol))
    for line in sel.diverging():
        log.warning("inner loop diverged on validation episodes", extra=kv(bundle=serving.path, loop=line))
    return sel


def select_or_configured(serving: Any, holdout: str | Path | Holdout, k: int = DEFAULT_K, max_rows: int = 0,
                         on_scored: OnScored | None = None) -> Selection:
    """:func:`select_recipe`, or the configured recipe (:func:`not_selected`, the reason logged) when the
    bundle carries no adaptation recipe or the holdout gives no episodes / no AUC (the gate's call).

    Args:
        serving: the loaded bundle.
        holdout: the gate's holdout (a path or its :class:`~delivery.holdout.Holdout`).
        k: support rows per user (first-k).
        max_rows: cap on the validation query rows (0: all).
        on_scored: told each candidate's figures as it is done; None: nothing told.
    """
    if not serving.manifest.adapt:
        return not_selected(serving.manifest, "the bundle carries no adaptation recipe")
    try:
        return select_recipe(serving, holdout, k, max_rows=max_rows, on_scored=on_scored)
    except DeliveryError as exc:
        log.warning("adaptation not selected; the configured recipe ships", extra=kv(bundle=serving.path, reason=str(exc)))
        return not_selected(serving.manifest, str(exc))


def not_selected(manifest: BundleManifest, reason: str) -> Selection:
    """The record of a bundle whose configured recipe ships unselected (``reason`` says why).

    Args:
        manifest: the bundle's manifest (its ``adapt`` record names the configured recipe).
        reason: why no selection ran.
    """
    configured = None
    if manifest.adapt:
        from common.config import from_mapping
        from models.meta_config import MetaConfig

        try:
            configured = Recipe.configured(from_mapping(MetaConfig, manifest.adapt.get("meta") or {}, where="adapt.meta"))
        except (MetapsError, ValueError):  # the record only; AdaptingModel names a bad config when serving
            configured = None
    return Selection(False, configured, configured, reason=reason)
