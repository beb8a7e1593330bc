"""Cold-start figures over a learning curve (issue 40), every arm on the same held-out rows.

Run::

    python -m bench.quality_curve [--sizes 16000,64000,200000] [--seeds 3,4,5] [--worlds default,hidden,taste]
        [--first-k 8] [--priors 1,4,16] [--set meta.KEY=VALUE --set model.KEY=VALUE ...] [--out FILE]
    python -m bench.quality_curve --quick        # 16k rows, seed 3, the default world (about a minute, idle box)
    python -m bench.quality_curve --smoke        # 4k and 6k rows, seed 3, one world; figures meaningless

Per size (rows generated; users = rows / 64, at least 250, so a user has ~64 rows at every size), world
(``meta_io.synth.WORLDS``) and seed, on the data of ``bench.quality --cold-only`` (``cold_generator_config``,
``cold_split``; held out: 25% of users up to 1000 users, 10% above), the training users are split again
(10% validation users, never the held-out ones), and each model is trained ONCE:

* **G-Meta** (``train-local``, ``[train] mode = "meta"``): the ``[meta]`` of the shipped job
  (``configs/main_job.toml``, or ``--meta-from FILE``) with ``--set meta.KEY=VALUE`` over it;
* **plain** (``mode = "plain"``), the same model and ``--set model.* / ps.* / train.*``;
* **logistic regression** and **LightGBM** where installed (``bench.quality_baselines.train_baselines``).

Then, under first-k (K = 8: each held-out user's first K rows by time are the support, every later row is
scored once; ``workers.eval_protocols.protocol_batches("first-k")``), every arm scores the SAME rows:

=====================  =================================================================================
``gmeta``              G-Meta's base (no adaptation)
``gmeta_adapted``      G-Meta after its inner loop on the support rows (rows + dense, its own recipe)
``gmeta_rows_only``    the same inner loop adapting the embedding rows only (``adapt = "rows"``)
``plain``              the plain model
``plain_ft``           the plain model + the same fine-tuning (G-Meta's inner loop, fixed rates)
``logreg``/``lightgbm``  the baselines
``oracle``             the generator's true probabilities (``oracle_auc``)
=====================  =================================================================================

Each arm but ``gmeta_rows_only`` is also scored + a per-task Bayesian logit offset per head fitted on its
own support logits (``bench.quality_baselines.fit_task_offsets``, to convergence; for adapted arms on the
adapted support logits, as ``[meta] offset_steps`` does) at each prior of ``--priors``; per arm and head,
the option (no offset, or one prior) is chosen on the VALIDATION users' first-k AUC, the way the delivery
gate chooses, and the held-out figure is that option's. Every arm thus has its best recipe, chosen
without the held-out users.

Per run (size, world, seed), per head:

* ``adapted_minus_best_other`` = ``gmeta_adapted`` - the best on the held-out rows of {``plain``,
  ``plain_ft``, ``logreg``, ``lightgbm``} (each at its chosen option): the issue's comparison, with the
  rival that wins named (``best_other``);
* ``gap_split``: that difference as ``base`` (G-Meta's base - the best rival's base: ``plain`` for
  ``plain_ft``) + ``adaptation`` (the rest: G-Meta's adaptation gain - the rival's);
* ``rows_only_gain_share`` = (``gmeta_rows_only`` - ``gmeta``) / (``gmeta_adapted`` without offset -
  ``gmeta``) (null where rows + dense gain less than 0.001);
* ``ceiling`` (``--ceiling-samples`` > 0 and the world in ``--ceiling-worlds``, default taste): the Bayes
  ceiling of the same held-out rows (``bench.quality_ceiling.ceiling_for_split``): ``full_gain``
  (posterior - prior predictive AUC) and, where the ceiling module gives it, ``offset_only_gain``;
  ``taste_gain_share`` = ``adapted_minus_best_other`` / (``full_gain`` - ``offset_only_gain``).

Per (size, world) (``summary[SIZE][WORLD]``): median / min / max over seeds of those figures and of every
arm's AUC, and the ``*_min`` keys (also at the top level as ``KEY["SIZE/WORLD"][head]``:
``adapted_minus_best_other_min``, ``taste_gain_share_min``, ``rows_only_gain_share_min``), and ``goals``
(sizes >= ``--goal-min-rows``, default 64000): taste world: adapted - best other >= 0 on both heads and
``taste_gain_share_min`` >= 0.5, rows-only share >= 0.5; hidden and default worlds: adapted - best other
>= -0.002; each with its margin. Sizes below it are reported with the gap split (``small_data``).

Timings per run (``times_s``: generate, build, each training, baselines, scoring, ceiling). The JSON is
written to ``--out`` after every run (a long curve that is stopped keeps what ran) and printed as the last
line. Hot paths are array ops over batches (logits, offsets: numpy over ``[tasks, rows]``), never per row.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import logging
import sys
import tempfile
import time
import tomllib
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from common.errors import MetapsError

log = logging.getLogger(__name__)

ROOT = Path(__file__).resolve().parents[1]
SHIPPED_JOB = ROOT / "configs" / "main_job.toml"
SIZES = (16_000, 64_000, 200_000)
SMOKE_SIZES = (4_000, 6_000)
PRIORS = (1.0, 4.0, 16.0)
HEADS = ("click", "conversion")
RIVALS = ("plain", "plain_ft", "logreg", "lightgbm")
"""What a team would serve without meta-learning; each at its chosen option competes with ``gmeta_adapted``."""
GOAL_MIN_ROWS = 64_000
NEAR_ZERO_GAIN = 1e-3
"""Below this rows + dense gain (AUC) the rows-only share is not a ratio worth reporting (null)."""


class CurveError(MetapsError):
    """A bad ``bench.quality_curve`` flag, or arms that scored different rows."""


# -- flags -------------------------------------------------------------------------------------------


def parse_ints(text: str, flag: str) -> list[int]:
    """A comma-separated list of distinct positive integers (``--sizes``, ``--seeds``, ``--first-k``).

    Args:
        text: the flag's value.
        flag: the flag's name (in the error).

    Raises:
        CurveError: not such a list (naming the flag).
    """
    try:
        out = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CurveError(f"{flag}: expected comma-separated integers, got {text!r}") from None
    if not out or any(v < 1 for v in out) or len(set(out)) != len(out):
        raise CurveError(f"{flag}: expected distinct integers >= 1, got {text!r}")
    return out


def parse_priors(text: str) -> list[float]:
    """``--priors``: offset prior strengths (lambda > 0) the option choice tries.

    Args:
        text: the flag's value, e.g. ``"1,4,16"``.

    Raises:
        CurveError: not a list of positive numbers.
    """
    try:
        out = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise CurveError(f"--priors: expected comma-separated numbers > 0, got {text!r}") from None
    if any(not p > 0 or not np.isfinite(p) for p in out):
        raise CurveError(f"--priors: expected comma-separated numbers > 0, got {text!r}")
    return out


def parse_sets(items: Sequence[str]) -> dict[str, dict[str, Any]]:
    """``--set SECTION.KEY=VALUE`` (VALUE in TOML: ``0.1``, ``true``, ``"rows"``, ``[64, 32]``; a bare word
    is a string; ``KEY`` may be dotted: ``ps.table_defaults.optimizer.lr=0.02``) -> section -> key -> value
    (nested tables as dicts).

    Args:
        items: the ``--set`` values in order (a later one wins).

    Raises:
        CurveError: no ``SECTION.KEY=`` or a section other than meta, model, ps, train.
    """
    out: dict[str, dict[str, Any]] = {}
    for item in items:
        key, eq, text = item.partition("=")
        section, dot, name = key.partition(".")
        if not eq or not dot or not name:
            raise CurveError(f"--set: expected SECTION.KEY=VALUE, got {item!r}")
        if section not in ("meta", "model", "ps", "train"):
            raise CurveError(f"--set {key}: expected a section of meta, model, ps, train, got {section!r}")
        try:
            value = tomllib.loads(f"v = {text}")["v"]
        except tomllib.TOMLDecodeError:
            value = text
        node = out.setdefault(section, {})
        *path, leaf = name.split(".")
        for part in path:  # ps.table_defaults.optimizer.lr=0.02: nested tables
            node = node.setdefault(part, {})
        node[leaf] = value
    return out


def shipped_meta(path: Path) -> dict[str, Any]:
    """The ``[meta]`` table of a job file (the G-Meta arm's inner loop and objective).

    Args:
        path: the job file (``--meta-from``).

    Raises:
        CurveError: the file cannot be read or has no ``[meta]`` table.
    """
    try:
        meta = tomllib.loads(path.read_text()).get("meta")
    except (OSError, tomllib.TOMLDecodeError) as e:
        raise CurveError(f"--meta-from {path}: {e}") from None
    if not isinstance(meta, dict):
        raise CurveError(f"--meta-from {path}: expected a [meta] table, got none")
    return dict(meta)


def curve_sizes(rows: int) -> tuple[int, int, int, float]:
    """(rows, users, items, held-out user fraction) of one curve size: ~64 rows a user at every size.

    Args:
        rows: generated rows.
    """
    users = max(250, rows // 64)
    return rows, users, max(200, rows // 80), 0.25 if users <= 1000 else 0.1


# -- the scored rows and the arms' logits ------------------------------------------------------------


@dataclass
class FirstK:
    """One user set's first-k episodes, materialized, with their targets and masks (numpy, per batch).

    Args:
        batches: the meta batches (``protocol_batches("first-k")``).
        sm / qm: ``[T, K]`` / ``[T, Q]`` real support / scored rows of real tasks.
        ys / yq: head -> ``[T, K]`` / ``[T, Q]`` 0/1 targets (conversion = CTCVR).
        oracle: head -> the scored rows' true probabilities (flat), where the data has them.
    """

    batches: list[Any]
    sm: list[np.ndarray]
    qm: list[np.ndarray]
    ys: dict[str, list[np.ndarray]]
    yq: dict[str, list[np.ndarray]]
    oracle: dict[str, np.ndarray]

    @property
    def rows(self) -> int:
        """Scored rows."""
        return int(sum(int(q.sum()) for q in self.qm))


def load_first_k(data: Path, schema: Any, k: int, heads: Sequence[str]) -> FirstK:
    """The first-k episodes of the users in ``data`` (Parquet rows) and their targets.

    Args:
        data: the users' rows (a ``split_by_task`` folder).
        schema: their schema.
        k: support rows per user.
        heads: head names (conversion = CTCVR).

    Raises:
        CurveError: no scored rows.
    """
    from meta_io.batch import MetaBatch
    from workers.eval_protocols import protocol_batches
    from workers.evaluation import head_target

    batches = [b for b in protocol_batches("first-k", data, schema, k=k) if isinstance(b, MetaBatch)]
    sm = [(b.support.mask & b.task_mask[:, None]).numpy().astype(bool) for b in batches]
    qm = [(b.query.mask & b.task_mask[:, None]).numpy().astype(bool) for b in batches]
    ys = {h: [head_target(h, b.support.labels).numpy().astype(np.float64) for b in batches] for h in heads}
    yq = {h: [head_target(h, b.query.labels).numpy().astype(np.float64) for b in batches] for h in heads}
    oracle = {h: np.concatenate([b.query.oracle[h].numpy()[m] for b, m in zip(batches, qm)]).astype(np.float64)
              for h in heads if batches and h in batches[0].query.oracle}
    out = FirstK(batches, sm, qm, ys, yq, oracle)
    if not out.rows:
        raise CurveError(f"{data}: first-k (k={k}) left no scored rows")
    return out


Logits = dict[str, tuple[list[np.ndarray] | None, list[np.ndarray]]]
"""head -> (support logits per batch ``[T, K]`` or None, query logits per batch ``[T, Q]``)."""
Source = Callable[[Any], tuple[dict[str, np.ndarray] | None, dict[str, np.ndarray]]]


def collect(fk: FirstK, source: Source, heads: Sequence[str]) -> Logits:
    """Run a logit source over every batch once.

    Args:
        fk: the scored rows.
        source: the arm's logits per batch.
        heads: head names.
    """
    zs: dict[str, list[np.ndarray]] = {h: [] for h in heads}
    zq: dict[str, list[np.ndarray]] = {h: [] for h in heads}
    has_support = True
    for mb in fk.batches:
        s, q = source(mb)
        has_support = has_support and s is not None
        for h in heads:
            if s is not None:
                zs[h].append(np.asarray(s[h], dtype=np.float64))
            zq[h].append(np.asarray(q[h], dtype=np.float64))
    return {h: (zs[h] if has_support else None, zq[h]) for h in heads}


def adapted_source(model: Any, rows_src: Any, loop: Any, support: bool = True) -> Source:
    """Logits of the query (and, for the offset, the support) rows after each task's inner loop.

    ``models.meta.adapt_and_predict`` (what evaluation and delivery run) adapts on the support rows and
    predicts; the support logits are its prediction with the support rows as the query (the adapted
    model's logits of the rows it adapted on). Probabilities -> logits in float64, clamped at 1e-12
    (float32 probabilities within 1e-7 of 0 or 1 stay apart: a coarser clamp ties them, moving the AUC).

    Args:
        model: the trained model, dense parameters current.
        rows_src: ``pull(ids) -> rows``.
        loop: a ``MetaConfig`` or ``MetaLearner`` without an offset (the offset is fitted here).
        support: also the support logits (the offset needs them).
    """
    from models.meta import adapt_and_predict

    logit = _logit

    def src(mb: Any) -> tuple[dict[str, np.ndarray] | None, dict[str, np.ndarray]]:
        rows = _pulled_rows(rows_src, mb)
        was = model.training
        model.eval()
        try:
            q = {h: logit(p) for h, p in adapt_and_predict(model, mb.support, mb.query, rows, mb.unique_ids,
                                                           loop).items()}
            s = ({h: logit(p) for h, p in adapt_and_predict(model, mb.support, mb.support, rows, mb.unique_ids,
                                                            loop).items()} if support else None)
        finally:
            model.train(was)
        return s, q

    return src


def _logit(p: Any) -> np.ndarray:
    """Probabilities as float64 logits, clamped at 1e-12 (float32 scores near 0 or 1 stay apart)."""
    import torch

    return torch.logit(p.double().clamp(1e-12, 1 - 1e-12)).numpy()


def _pulled_rows(rows_src: Any, mb: Any) -> dict[str, Any]:
    """Table -> the rows of a meta batch's unique ids, pulled from ``rows_src`` as torch tensors."""
    import torch

    ids = {t: u.numpy() for t, u in mb.unique_ids.items()}
    return {t: torch.from_numpy(np.ascontiguousarray(r)) for t, r in rows_src.pull(ids).items()}


def base_source(model: Any, rows_src: Any) -> Source:
    """A metaps model's unadapted logits of the support and query rows: ``model.predict`` (the scores
    evaluation and serving use; for a kind whose conversion score is ``p(click) * p(cvr)`` that product,
    not the loss's logit), as logits in float64 clamped at 1e-12.

    Args:
        model: the trained model, dense parameters current.
        rows_src: ``pull(ids) -> rows``.
    """
    import torch

    logit = _logit

    @torch.no_grad()
    def src(mb: Any) -> tuple[dict[str, np.ndarray] | None, dict[str, np.ndarray]]:
        rows = _pulled_rows(rows_src, mb)
        was = model.training
        model.eval()
        try:
            s = {h: logit(p) for h, p in model.predict(mb.support, rows, mb.unique_ids).items()}
            q = {h: logit(p) for h, p in model.predict(mb.query, rows, mb.unique_ids).items()}
        finally:
            model.train(was)
        return s, q

    return src


def option_metrics(fk: FirstK, logits: Logits, priors: Sequence[float]) -> dict[str, dict[str, dict[str, float]]]:
    """Per head, AUC and logloss of the scored rows: ``none`` (the logits as they are) and ``prior_P`` (+ each
    task's offset fitted on its support logits at prior P; only where the support logits are there).

    Args:
        fk: the scored rows.
        logits: :func:`collect` of one arm on ``fk``.
        priors: the offset priors (lambda > 0).

    Raises:
        CurveError: logits whose shapes differ from the batches' masks.
    """
    from bench.quality_baselines import auc_logloss, fit_task_offsets

    out: dict[str, dict[str, dict[str, float]]] = {}
    for h, (zs, zq) in logits.items():
        if len(zq) != len(fk.qm) or any(z.shape != m.shape for z, m in zip(zq, fk.qm)):
            raise CurveError(f"{h}: query logits shaped {[z.shape for z in zq][:3]}, scored rows {[m.shape for m in fk.qm][:3]}")
        t = np.concatenate([y[m] for y, m in zip(fk.yq[h], fk.qm)])
        res = {"none": auc_logloss(_sig(np.concatenate([z[m] for z, m in zip(zq, fk.qm)])), t)}
        if zs is not None:
            for p in priors:
                shifted = []
                for s, q, y, sm, qm in zip(zs, zq, fk.ys[h], fk.sm, fk.qm):
                    b = fit_task_offsets(s, y, sm, p)
                    shifted.append((q + b[:, None])[qm])
                res[f"prior_{p:g}"] = auc_logloss(_sig(np.concatenate(shifted)), t)
        out[h] = res
    return out


def _sig(z: np.ndarray) -> np.ndarray:
    return 1.0 / (1.0 + np.exp(-z))


def choose(val: dict[str, dict[str, dict[str, float]]]) -> dict[str, str]:
    """Per head, the option with the best validation AUC (ties: the first, ``none`` before the priors).

    Args:
        val: :func:`option_metrics` on the validation users.
    """
    return {h: max(opts, key=lambda o: opts[o]["auc"]) for h, opts in val.items()}


def arm_entry(val: dict[str, Any], held: dict[str, Any]) -> dict[str, Any]:
    """One arm: its options on validation and held-out users, the chosen option and its held-out AUC.

    Args:
        val / held: :func:`option_metrics` on the validation / held-out users.
    """
    chosen = choose(val)
    return {"chosen": chosen, "auc": {h: held[h][chosen[h]]["auc"] for h in held},
            "logloss": {h: held[h][chosen[h]]["logloss"] for h in held}, "held": held, "val": val}


# -- one run ----------------------------------------------------------------------------------------


def run_figures(arms: dict[str, dict[str, Any]], heads: Sequence[str]) -> dict[str, Any]:
    """The run's comparison figures per head (module docstring) from its arms.

    Args:
        arms: arm name -> :func:`arm_entry` (``gmeta``, ``gmeta_adapted``, ``gmeta_rows_only`` and the
            rivals present).
        heads: head names.
    """
    out: dict[str, Any] = {"adapted_minus_best_other": {}, "best_other": {}, "gap_split": {},
                           "rows_only_gain": {}, "rows_dense_gain": {}, "rows_only_gain_share": {}}
    for h in heads:
        rivals = {r: arms[r]["auc"][h] for r in RIVALS if r in arms}
        best = max(rivals, key=lambda r: rivals[r])
        served = arms["gmeta_adapted"]["auc"][h]
        margin = served - rivals[best]
        base_of = "plain" if best == "plain_ft" else best
        base_gap = arms["gmeta"]["held"][h]["none"]["auc"] - arms[base_of]["held"][h]["none"]["auc"]
        out["adapted_minus_best_other"][h] = margin
        out["best_other"][h] = f"{best}[{arms[best]['chosen'][h]}]"
        out["gap_split"][h] = {"total": margin, "base": base_gap, "adaptation": margin - base_gap,
                               "rival_base": base_of}
        g_base = arms["gmeta"]["held"][h]["none"]["auc"]
        rows_gain = arms["gmeta_rows_only"]["held"][h]["none"]["auc"] - g_base
        full_gain = arms["gmeta_adapted"]["held"][h]["none"]["auc"] - g_base
        out["rows_only_gain"][h], out["rows_dense_gain"][h] = rows_gain, full_gain
        out["rows_only_gain_share"][h] = rows_gain / full_gain if full_gain >= NEAR_ZERO_GAIN else None
    return out


def ceiling_figures(cfg: Any, split: Any, k: int, samples: int) -> dict[str, Any]:
    """The Bayes ceiling of the same held-out first-k rows, per head (``bench.quality_ceiling.ceiling_gains``):
    ``full_gain`` (posterior - prior predictive AUC), ``offset_only_gain`` (the best one offset per user and
    head), ``non_offset_gain`` and the AUCs they come from.

    Args:
        cfg: the ``GeneratorConfig`` that generated the run's data.
        split: the run's ``split_by_task`` result (its held-out users).
        k: the first-k support size.
        samples: importance draws per user.
    """
    from bench.quality_ceiling import ceiling_gains

    res = ceiling_gains(cfg, split.holdout_dir, split.schema_path, k, samples, 0)
    return {"samples": samples, **{h: {key: (None if v is None else float(v)) for key, v in res[h].items()}
                                   for h in HEADS}}


def one_run(rows: int, world: str, seed: int, k: int, priors: Sequence[float], meta: dict[str, Any],
            sets: dict[str, dict[str, Any]], epochs: int, kind: str, ceiling_samples: int, smoke: bool,
            tmp: Path) -> dict[str, Any]:
    """Every arm of one (size, world, seed) on the same held-out first-k rows (module docstring).

    Args:
        rows: generated rows.
        world: a key of ``meta_io.synth.WORLDS``.
        seed: the generator's, the split's and the training's seed.
        k: the first-k support size.
        priors: the offset priors each arm may choose from (on validation users).
        meta: the G-Meta arm's ``[meta]`` table.
        sets: ``--set`` overrides (``meta`` already in ``meta``): model / ps / train sections of both jobs.
        epochs: training epochs of both metaps models.
        kind: the model kind.
        ceiling_samples: importance draws per user of the Bayes ceiling (0: no ceiling).
        smoke: the baselines' smoke sizes.
        tmp: scratch folder.
    """
    from bench.quality_baselines import train_baselines
    from bench.quality_setup import cold_generator_config, cold_split, job_for
    from meta_io.build import MetaIOBuildConfig, build
    from meta_io.holdout import split_by_task
    from meta_io.schema import load_schema
    from meta_io.synth import generate, world_config
    from models.losses import heads_for_schema
    from workers.eval_protocols import evaluate_protocol, protocol_batches
    from workers.local import train_local

    times: dict[str, float] = {}
    t = time.perf_counter()

    def lap(name: str) -> None:
        nonlocal t
        now = time.perf_counter()
        times[name] = round(now - t, 3)
        t = now

    rows, users, items, fraction = curve_sizes(rows)
    cfg = world_config(cold_generator_config(rows, users, items, seed), world)
    gen = generate(tmp / "raw", cfg, progress=False)
    lap("generate")
    split = cold_split(gen, tmp, seed, fraction)
    schema = load_schema(split.schema_path)
    vsplit = split_by_task(split.train_dir, schema, tmp / "vsplit", fraction=0.1, seed=seed + 1000)
    mcfg = MetaIOBuildConfig(support=8, query=8, rows_per_batch=256)
    mtrain = build(vsplit.train_dir, vsplit.schema_path, tmp / "m-train", mcfg).out_dir
    mval = build(vsplit.holdout_dir, vsplit.schema_path, tmp / "m-val", mcfg).out_dir
    heads = [h.name for h in heads_for_schema(schema)]
    held_fk = load_first_k(split.holdout_dir, schema, k, heads)
    val_fk = load_first_k(vsplit.holdout_dir, schema, k, heads)
    lap("split_build")

    _, mw = train_local(job_for(mtrain, mval, tmp / "run-meta", "meta", kind, epochs, meta, sets), tmp / "run-meta",
                        checkpoint=False)
    lap("train_gmeta")
    _, pw = train_local(job_for(mtrain, mval, tmp / "run-plain", "plain", kind, epochs, None, sets), tmp / "run-plain",
                        checkpoint=False)
    lap("train_plain")
    bl = train_baselines(vsplit.train_dir, vsplit.holdout_dir, schema, heads, smoke)
    lap("train_baselines")

    for w in (mw, pw):
        w.trainer.refresh_dense()
    no_offset = {"offset_steps": 0}
    g_loop = loop_variant(mw, **no_offset)
    ft_loop = dataclasses.replace(mw.trainer.meta_cfg, learn_inner_lr="off", meta_emb=False, offset_steps=0,
                                  support_loss_weight=0.0)
    sources: dict[str, tuple[Source, bool]] = {
        "gmeta": (base_source(mw.model, mw.rows), True),
        "gmeta_adapted": (adapted_source(mw.model, mw.rows, g_loop), True),
        "gmeta_rows_only": (adapted_source(mw.model, mw.rows, loop_variant(mw, adapt="rows", **no_offset),
                                           support=False), False),
        "plain": (base_source(pw.model, pw.rows), True),
        "plain_ft": (adapted_source(pw.model, pw.rows, ft_loop), True),
        **{n: (s, True) for n, s in bl.sources.items()},
    }
    arms: dict[str, Any] = {}
    for name, (src, _) in sources.items():
        val = option_metrics(val_fk, collect(val_fk, src, heads), priors)
        held = option_metrics(held_fk, collect(held_fk, src, heads), priors)
        arms[name] = arm_entry(val, held)
    # the G-Meta arms' logits against the project's own evaluation of the same rows
    ev = evaluate_protocol(mw.model, mw.rows, protocol_batches("first-k", split.holdout_dir, schema, k=k), g_loop,
                           task_key=schema.task_key)
    for arm, kind_ in (("gmeta", "base"), ("gmeta_adapted", "adapted")):
        for h in heads:
            a, b = arms[arm]["held"][h]["none"]["auc"], ev[kind_][h]["auc"]
            if abs(a - b) > 1e-3 or ev[kind_][h]["rows"] != held_fk.rows:
                raise CurveError(f"{arm} {h}: AUC {a:.6f} on {held_fk.rows} rows from its logits, evaluate_protocol "
                                 f"{b:.6f} on {ev[kind_][h]['rows']} rows")
    lap("score")
    out: dict[str, Any] = {"rows": rows, "users": users, "held_out_users": split.holdout_tasks,
                           "held_out_fraction": fraction, "scored_rows": held_fk.rows, "val_scored_rows": val_fk.rows,
                           "oracle_auc": {h: float(ev["base"][h].get("oracle_auc", float("nan"))) for h in heads},
                           "baselines": bl.info, "arms": arms, **run_figures(arms, heads)}
    if ceiling_samples:
        out["ceiling"] = ceiling_figures(cfg, split, k, ceiling_samples)
        share: dict[str, float | None] = {}
        for h in heads:
            c = out["ceiling"][h]
            reach = c.get("non_offset_gain")
            share[h] = out["adapted_minus_best_other"][h] / reach if reach and reach > NEAR_ZERO_GAIN else None
        out["taste_gain_share"] = share
        lap("ceiling")
    out["times_s"] = times
    return out


def loop_variant(worker: Any, **changes: Any) -> Any:
    """The trained worker's inner loop with ``changes`` to its ``[meta]`` (``adapt``, ``offset_steps``): a
    ``MetaConfig`` replaced, or a new ``MetaLearner`` holding the trained learner's rates (and MetaEmb
    generator) for what it still adapts.

    Args:
        worker: the trained G-Meta worker.
        changes: ``MetaConfig`` fields to replace.
    """
    from models.meta_config import MetaConfig
    from models.meta_learner import MetaLearner

    loop = worker.trainer.inner_loop
    if isinstance(loop, MetaConfig):
        return dataclasses.replace(loop, **changes)
    new = MetaLearner(worker.model, dataclasses.replace(loop.cfg, **changes))
    new.load_state_dict(loop.state_dict(), strict=False)
    new.set_init_rows(loop.init_rows or {})
    return new


# -- the summary ---------------------------------------------------------------------------------


def _spread(values: Sequence[float | None]) -> dict[str, float | None]:
    v = [x for x in values if x is not None]
    if not v:
        return {"median": None, "min": None, "max": None, "seeds": 0}
    return {"median": float(np.median(v)), "min": float(np.min(v)), "max": float(np.max(v)), "seeds": len(v)}


def summarize(per_seed: dict[int, dict[str, Any]], heads: Sequence[str] = HEADS) -> dict[str, Any]:
    """One (size, world): each figure's spread over seeds, and the ``*_min`` keys the goals read.

    Args:
        per_seed: seed -> :func:`one_run`'s result.
        heads: head names.
    """
    runs = list(per_seed.values())
    out: dict[str, Any] = {"seeds": sorted(per_seed)}
    for key in ("adapted_minus_best_other", "rows_only_gain_share", "rows_only_gain", "rows_dense_gain",
                "taste_gain_share"):
        if all(key in r for r in runs):
            out[key] = {h: _spread([r[key][h] for r in runs]) for h in heads}
            out[f"{key}_min"] = {h: out[key][h]["min"] for h in heads}
    out["gap_split"] = {h: {part: _spread([r["gap_split"][h][part] for r in runs]) for part in ("total", "base",
                                                                                                  "adaptation")}
                        for h in heads}
    out["arms_auc"] = {arm: {h: _spread([r["arms"][arm]["auc"][h] for r in runs]) for h in heads}
                       for arm in runs[0]["arms"]}
    out["oracle_auc"] = {h: _spread([r["oracle_auc"][h] for r in runs]) for h in heads}
    if all("ceiling" in r for r in runs):
        out["ceiling"] = {h: {key: _spread([r["ceiling"][h].get(key) for r in runs])
                              for key in ("full_gain", "offset_only_gain")} for h in heads}
    return out


def goals(summary: dict[str, dict[str, dict[str, Any]]], min_rows: int, heads: Sequence[str] = HEADS) -> dict[str, Any]:
    """The issue's goals per (size, world) for sizes >= ``min_rows``: met / missed with margins (module
    docstring); a figure that could not be computed (no ceiling, no gain) counts as missed.

    Args:
        summary: size -> world -> :func:`summarize`.
        min_rows: the smallest size judged.
        heads: head names.
    """

    def low(d: dict[str, Any], key: str, h: str) -> float | None:
        v = d.get(f"{key}_min", {}).get(h)
        return None if v is None else float(v)

    out: dict[str, Any] = {}
    for size, worlds in summary.items():
        if int(size) < min_rows:
            continue
        for world, s in worlds.items():
            g: dict[str, Any] = {}
            if world == "taste":
                for h in heads:
                    m, share, rows = (low(s, "adapted_minus_best_other", h), low(s, "taste_gain_share", h),
                                      low(s, "rows_only_gain_share", h))
                    g[f"{h}_adapted>=best_other"] = {"margin": m, "met": m is not None and m >= 0}
                    g[f"{h}_taste_gain_share>=0.5"] = {"margin": None if share is None else share - 0.5,
                                                       "met": share is not None and share >= 0.5}
                    g[f"{h}_rows_only_gain_share>=0.5"] = {"margin": None if rows is None else rows - 0.5,
                                                           "met": rows is not None and rows >= 0.5}
            else:
                for h in heads:
                    m = low(s, "adapted_minus_best_other", h)
                    g[f"{h}_adapted>=best_other-0.002"] = {"margin": None if m is None else m + 0.002,
                                                           "met": m is not None and m >= -0.002}
            g["met"] = all(v["met"] for v in g.values())
            out[f"{size}/{world}"] = g
    out["all_met"] = all(v["met"] for v in out.values() if isinstance(v, dict)) if out else False
    return out


# -- main -------------------------------------------------------------------------------------------


def main(argv: list[str] | None = None) -> int:
    """The command line (module docstring); the last line printed is the JSON.

    Args:
        argv: the arguments (default ``sys.argv[1:]``).
    """
    from meta_io.synth import WORLDS

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--sizes", default="", help="generated rows per curve point (default 16000,64000,200000)")
    ap.add_argument("--seeds", default="", help="seeds (default 3,4,5)")
    ap.add_argument("--worlds", default="", help=f"worlds of meta_io.synth.WORLDS (default: all of {','.join(WORLDS)})")
    ap.add_argument("--first-k", type=int, default=8, help="support rows K of the first-k protocol")
    ap.add_argument("--priors", default=",".join(f"{p:g}" for p in PRIORS),
                    help="offset priors every arm may choose from on the validation users")
    ap.add_argument("--meta-from", type=Path, default=SHIPPED_JOB, help="job file whose [meta] G-Meta trains with")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                    help="override a [meta]/[model]/[ps]/[train] key of the metaps arms (repeatable)")
    ap.add_argument("--kind", default="dnn", help="model kind of the metaps arms")
    ap.add_argument("--epochs", type=int, default=0, help="training epochs (0: 2 up to 50k rows, else 1)")
    ap.add_argument("--ceiling-samples", type=int, default=2000, help="Bayes ceiling draws per user (0: off)")
    ap.add_argument("--ceiling-worlds", default="taste", help="worlds whose ceiling is computed")
    ap.add_argument("--goal-min-rows", type=int, default=GOAL_MIN_ROWS, help="smallest size the goals judge")
    ap.add_argument("--out", type=Path, default=None, help="write the JSON here after every run too")
    ap.add_argument("--quick", action="store_true", help="16000 rows, seed 3, the default world")
    ap.add_argument("--smoke", action="store_true", help="4000 and 6000 rows, seed 3, one world; meaningless")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    try:
        smoke_world = "taste" if "taste" in WORLDS else "hidden"
        sizes = parse_ints(args.sizes, "--sizes") if args.sizes else (
            list(SMOKE_SIZES) if args.smoke else [16_000] if args.quick else list(SIZES))
        seeds = parse_ints(args.seeds, "--seeds") if args.seeds else [3] if args.smoke or args.quick else [3, 4, 5]
        worlds = [w for w in args.worlds.split(",") if w] or (
            [smoke_world] if args.smoke else ["default"] if args.quick else list(WORLDS))
        for w in worlds:
            if w not in WORLDS:
                raise CurveError(f"--worlds: expected names of {', '.join(WORLDS)}, got {w!r}")
        priors = parse_priors(args.priors)
        sets = parse_sets(args.set)
        meta = {**shipped_meta(args.meta_from), **sets.pop("meta", {})}
    except CurveError as e:
        raise SystemExit(str(e)) from None
    ceiling_worlds = {w for w in args.ceiling_worlds.split(",") if w}
    samples = 200 if args.smoke else args.ceiling_samples
    min_rows = sizes[-1] if args.smoke else args.goal_min_rows
    out: dict[str, Any] = {"sizes": sizes, "seeds": seeds, "worlds": worlds, "first_k": args.first_k,
                           "priors": priors, "meta": meta, "sets": sets, "kind": args.kind,
                           "goal_min_rows": min_rows, "runs": {}, "summary": {}}
    t0 = time.perf_counter()
    for rows in sizes:
        epochs = args.epochs or (1 if args.smoke else 2 if rows <= 50_000 else 1)
        for world in worlds:
            per: dict[int, Any] = {}
            for seed in seeds:
                print(f"[{rows} rows, {world}, seed {seed}] training G-Meta, plain and the baselines", flush=True)
                with tempfile.TemporaryDirectory(prefix="bench-quality-curve-") as td:
                    r = one_run(rows, world, seed, args.first_k, priors, meta, sets, epochs, args.kind,
                                samples if world in ceiling_worlds else 0, args.smoke, Path(td))
                per[seed] = r
                out["runs"].setdefault(str(rows), {}).setdefault(world, {})[str(seed)] = r
                _print_run(r)
                out["summary"].setdefault(str(rows), {})[world] = summarize(per)
                for key in ("adapted_minus_best_other_min", "taste_gain_share_min", "rows_only_gain_share_min"):
                    out[key] = {f"{size}/{w}": s[key] for size, ws in out["summary"].items() for w, s in ws.items()
                                if key in s}
                out["goals"] = goals(out["summary"], min_rows)
                out["elapsed_s"] = time.perf_counter() - t0
                if args.out:
                    args.out.write_text(json.dumps(out, default=float))
    print(json.dumps(out, default=float), flush=True)
    return 0


def _print_run(r: dict[str, Any]) -> None:
    for h in HEADS:
        arms = " ".join(f"{a} {e['auc'][h]:.4f}[{e['chosen'][h]}]" for a, e in r["arms"].items())
        gs = r["gap_split"][h]
        print(f"    {h}: {arms}; adapted - best other ({r['best_other'][h]}) {gs['total']:+.4f} = base "
              f"{gs['base']:+.4f} + adaptation {gs['adaptation']:+.4f}; rows-only share "
              f"{r['rows_only_gain_share'][h]}", flush=True)
    print(f"    times_s {r['times_s']}", flush=True)


if __name__ == "__main__":
    sys.exit(main())
