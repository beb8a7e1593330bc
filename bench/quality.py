"""The quality table: normalized AUC per model kind, and meta-learning vs no adaptation.

Run::

    python -m bench.quality [--quick] [--rows N] [--kinds dnn,deepfm,dcnv2,esmm]
    python -m bench.quality --smoke [--cold-only]   # 4k rows, 1 epoch (1 seed, inner steps 1,2; baselines: 3 L2
                                                    # values, 50 L-BFGS iterations); figures meaningless
    python -m bench.quality --cold-only --quick --first-k 8 --world hidden   # per-user effects no feature reveals
    python -m bench.quality_curve [--sizes 16000,64000,200000] [--seeds 3,4,5] [--worlds ...]   # the learning curve:
                                                    # every arm on the same held-out rows at each size (its docstring)
    python -m bench.quality deepfm-parity [--rows 32000] [--smoke]   # metaps deepfm vs a plain DeepFM
                                                    # (bench/deepfm_parity.py's docstring)

Data: the AntM2C-like generator (1M rows by default, 16k with ``--quick``,
60-64 rows a user on average), whose true probabilities give every figure a ceiling:
``norm_auc = (auc - 0.5) / (oracle_auc - 0.5)`` on the same rows.

1. **Plain CTR/CVR training, per model kind** (``train-local``, the same step
   engine and optimizers as a fleet): train on each user's earlier rows, score
   the later ones (a time split at the 80% quantile of ``log_time``). The oracle
   includes a per-user bias (std 0.8 logits) that only a user's own history
   reveals, so the split keeps the users and moves forward in time, which is
   what a deployed CTR model faces. Heads: click, and conversion scored as
   CTCVR (``p(click and convert)``) over all impressions.
2. **Cold-start users** (``meta_io.holdout.split_by_task``, 10% of users never
   seen in training; 25% with ``--quick``, which has only 250 users): each held-out user's episodes are scored on their query
   rows by the meta-trained model as is ("base"), after one inner step on the
   episode's support rows ("adapted"), and by a plain-trained model on the same
   rows (the usual no-adaptation baseline).

3. **The inner loop** (``--cold-only --seeds 3,4,5 --inner-steps 1,2,3,5 --learn-inner-lr element``):
   per seed, G-Meta with the configured inner loop (Meta-SGD rates when asked) is trained
   once per inner-step count; the count is chosen on a validation split of the *training*
   users (10%, ``split_by_task`` again, never the held-out users), and the held-out users
   are reported at the chosen count: base, adapted, and "plain model + the same
   fine-tuning" (the plain-trained model adapted with the fixed ``inner_lr`` and the
   same step count). Median and spread (min, max) over seeds; goals: adapted - base
   >= +0.02 click / +0.01 conversion AUC and adapted > plain + fine-tuning on both heads,
   on every seed. ``--meta-emb both`` trains every step count with and without MetaEmb
   (generated initial rows for unseen user ids, ``[meta] meta_emb``) and reports every
   variant under first-k side by side (``first_k_per_variant``).
   ``--first-k 4,8,16,32`` scores the held-out users under first-k for every K on the SAME
   trained models (``first_k_by_k``, per seed and over seeds; the first K listed also fills
   the ``first_k*`` keys); a larger K scores fewer, later rows, so compare within a K.
   ``--support-loss-weight W`` trains with ``[meta] support_loss_weight = W`` (the base also
   learns from the support rows). ``--inner-loss-reduction sum_per_support`` (``--cold-only``) sets
   ``[meta] inner_loss_reduction`` (inner step size grows with the task's support rows) for the meta
   trainings and the plain model's fine-tuning alike. ``--offset-steps N --offset-prior L``
   (``--cold-only``) sets ``[meta] offset_steps`` / ``offset_prior`` (a per-task logit offset per head,
   fitted by Newton on the support after the inner steps) for the meta trainings and the plain
   model's fine-tuning alike; both are recorded in the JSON.

4. **Standard baselines** (``--cold-only`` with ``--first-k``; ``--baselines off`` skips them): per
   seed, logistic regression (one-hot ids, pooled id lists, dense; L2 chosen on the validation users)
   and, where the ``lightgbm`` package is installed, LightGBM on target/count encodings (else
   ``"lightgbm": "not installed"``) train on the training users' rows (``bench.quality_baselines``).
   Per K, under first-k on the same scored rows: base and + a per-task Bayesian logit offset fitted
   on the K support rows (prior strength ``--baseline-offset-prior``, default 4) for each baseline
   and for the plain and the chosen meta model, beside plain + ft, meta adapted and the oracle
   (``first_k_by_k[k]["baselines"]``, AUC and logloss per head). ``goals``: adapted >= the best of
   (plain, logistic regression, LightGBM) + offset, per head and seed, with the margin. The Bayes
   ceiling of the same rows comes from ``python -m bench.quality_ceiling``, not from this bench.

The same run measures everything; the last line printed is a JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from bench.quality_setup import cold_generator_config, cold_sizes, cold_split, job_for  # noqa: F401 (re-exported)

import numpy as np

KINDS = ("dnn", "deepfm", "dcnv2", "esmm")
SMOKE_ROWS = 4_000
"""``--smoke``'s generated rows (250 users: the generator's floor here): every step runs, no figure means anything."""


def _progress(msg: str) -> None:
    print(msg, flush=True)


def time_split_baselines(past: Path, future: Path, schema: Any, tmp: Path, smoke: bool) -> dict[str, Any]:
    """Logistic regression (and LightGBM where installed) on the time split: trained on the past
    rows before the latest eighth of them, their L2 / boosting rounds chosen on that eighth (a time
    split of the past: validation is the past's future), scored on every row of the future.

    The metaps kinds train on the whole past for a fixed number of epochs; the baselines give up an
    eighth of it to tune on (the usual practice for them), so the comparison slightly favours metaps.
    """
    from bench.quality_baselines import score_rows, train_baselines
    from meta_io.batch import PlainBatch
    from meta_io.holdout import split_by_time
    from workers.eval_protocols import protocol_batches

    _progress("[plain baselines] logistic regression (and LightGBM where installed): past rows, tuned on "
              "the past's latest eighth, scored on the future")
    vsplit = split_by_time(past, schema, tmp / "tsplit-val", fraction=0.125)
    bl = train_baselines(vsplit.train_dir, vsplit.holdout_dir, schema, ("click", "conversion"), smoke=smoke)
    out: dict[str, Any] = {}
    for name, rows in bl.rows.items():
        batches = (b.features for b in protocol_batches("plain", future, schema, batch_rows=65_536)
                   if isinstance(b, PlainBatch))
        m: dict[str, Any] = dict(score_rows(batches, rows, ("click", "conversion")))
        m["train_s"] = bl.info[name]["train_s"]  # this model's training alone (not the others', not scoring)
        out[name] = m
        _progress(f"      {name}: click norm_auc {m['click'].get('norm_auc', float('nan')):.3f} (auc "
                  f"{m['click']['auc']:.4f}); conversion norm_auc {m['conversion'].get('norm_auc', float('nan')):.3f}")
    return out


def _metrics(ev: dict[str, Any], keys: tuple[str, ...] = ("auc", "oracle_auc", "norm_auc", "logloss")) -> dict[str, Any]:
    return {head: {k: m[k] for k in keys if k in m} | {"rows": m["rows"]} for head, m in ev.items()}


def _eval_adapted(worker: Any, data: Path, loop: Any) -> dict[str, Any]:
    """Base and adapted metrics of a trained worker's model on a meta dataset (any training mode)."""
    from meta_io.reader import MetaIODataset
    from workers.evaluation import evaluate

    worker.trainer.refresh_dense()
    ev = evaluate(worker.model, worker.rows, MetaIODataset(data).iter_all(), loop, adapt=True)
    return {kind: _metrics(m) for kind, m in ev.items()}


def cold_start_sweep(gen: Any, tmp: Path, seed: int, epochs: int, fraction: float, steps_list: list[int],
                     learn: str, inner_lr: float, first_k: int | list[int] = 0, emb_list: tuple[bool, ...] = (False,),
                     emb_cold_weight: float = 0.5, emb_labels: bool = False,
                     support_loss_weight: float = 0.0, inner_loss_reduction: str = "mean",
                     offset_steps: int = 0, offset_prior: float = 16.0, baselines: bool = False,
                     baseline_prior: float = 4.0, smoke: bool = False) -> dict[str, Any]:
    """One seed of the inner-loop study: the variant (inner steps x MetaEmb off/on) chosen on
    validation users, held-out users reported (and, with ``first_k``, every variant under first-k).

    Args:
        first_k: support sizes K of the first-k protocol (an int or a list; 0 / []: off). Every K
            scores the SAME trained models; the first K listed fills the ``first_k*`` keys, every K
            is under ``first_k_by_k``. A larger K scores fewer, later rows: compare within a K.
        support_loss_weight: ``[meta] support_loss_weight`` of the meta trainings.
        inner_loss_reduction: ``[meta] inner_loss_reduction`` of the meta trainings and of the plain
            model's fine-tuning ("the same fine-tuning"); ``sum_per_support`` divides by the layout's
            support size (``inner_support_size`` = 8 here).
        offset_steps: ``[meta] offset_steps`` (the per-task Newton logit offset) of the meta trainings
            and of the plain model's fine-tuning alike (0: off, no key added).
        offset_prior: ``[meta] offset_prior`` (with ``offset_steps``).
        baselines: with ``first_k``, also train the standard baselines (``bench.quality_baselines``) and
            score them, the plain model and the chosen meta model, each + a per-task offset, per K
            (``first_k_by_k[k]["baselines"]``).
        baseline_prior: the per-task offset's prior strength lambda.
        smoke: the baselines' smoke sizes (figures meaningless).
    """
    ks = [k for k in ([first_k] if isinstance(first_k, int) else list(first_k)) if k]
    from meta_io.build import MetaIOBuildConfig, build
    from meta_io.holdout import split_by_task
    from meta_io.schema import load_schema
    from models.meta import MetaConfig
    from workers.local import train_local

    split = cold_split(gen, tmp, seed, fraction)
    vsplit = split_by_task(split.train_dir, load_schema(split.schema_path), tmp / "vsplit", fraction=0.1, seed=seed + 1000)
    mcfg = MetaIOBuildConfig(support=8, query=8, rows_per_batch=256)
    red = shared_inner_keys(inner_loss_reduction, mcfg.support, offset_steps, offset_prior)
    mtrain = build(vsplit.train_dir, vsplit.schema_path, tmp / "m-train", mcfg).out_dir
    mval = build(vsplit.holdout_dir, vsplit.schema_path, tmp / "m-val", mcfg).out_dir
    mheld = build(split.holdout_dir, split.schema_path, tmp / "m-held", mcfg).out_dir
    runs: dict[str, Any] = {}
    workers: dict[str, Any] = {}
    n_steps: dict[str, int] = {}
    for steps in steps_list:
        for emb in emb_list:
            key = f"{steps}+meta_emb" if emb else str(steps)
            meta: dict[str, Any] = {"inner_steps": steps, "inner_lr": inner_lr, "adapt": "both", "first_order": True,
                                    "learn_inner_lr": learn, "support_loss_weight": support_loss_weight, **red}
            if emb:
                meta.update(meta_emb=True, meta_emb_tables=["user"], meta_emb_cold_weight=emb_cold_weight,
                            meta_emb_labels=emb_labels)
            _progress(f"  [seed {seed}] meta training, {steps} inner step(s), learn_inner_lr={learn}, meta_emb={emb}")
            _, w = train_local(job_for(mtrain, mval, tmp / f"run-meta-{key}", "meta", "dnn", epochs, meta),
                               tmp / f"run-meta-{key}", checkpoint=False)
            workers[key], n_steps[key] = w, steps
            runs[key] = {"val": _eval_adapted(w, mval, w.trainer.inner_loop),
                         "held": _eval_adapted(w, mheld, w.trainer.inner_loop),
                         "rates": {k: {n: float(v.float().mean()) for n, v in r.items()}
                                   for k, r in w.trainer.learner.inner_recipe().items() if k.endswith("_lr")
                                   and isinstance(r, dict)}}
            v = runs[key]["val"]["adapted"]
            _progress(f"      val adapted click {v['click']['auc']:.4f} conversion {v['conversion']['auc']:.4f}")
    chosen_key = max(runs, key=lambda k: runs[k]["val"]["adapted"]["click"]["auc"]
                     + runs[k]["val"]["adapted"]["conversion"]["auc"])
    chosen = n_steps[chosen_key]
    _progress(f"  [seed {seed}] plain training (baseline + the same fine-tuning, {chosen} step(s))")
    _, pw = train_local(job_for(mtrain, mval, tmp / "run-plain", "plain", "dnn", epochs), tmp / "run-plain",
                        checkpoint=False)
    plain = _eval_adapted(pw, mheld, MetaConfig(inner_steps=chosen, inner_lr=inner_lr, **red))
    held = runs[chosen_key]["held"]
    res: dict[str, Any] = {"chosen_inner_steps": chosen, "chosen_variant": chosen_key, "runs": runs, "plain": plain["base"],
                           "plain_finetuned": plain["adapted"], "base": held["base"], "adapted": held["adapted"]}
    if ks:
        # strict cold start (eval16's first-k): per held-out user the first K rows by time adapt,
        # every later row is scored once; every K on the same trained models
        from workers.eval_protocols import evaluate_protocol, protocol_batches

        schema = load_schema(split.schema_path)

        def fk(w: Any, loop: Any, k: int) -> dict[str, Any]:
            w.trainer.refresh_dense()
            batches = protocol_batches("first-k", split.holdout_dir, schema, k=k)
            return evaluate_protocol(w.model, w.rows, batches, loop, task_key=schema.task_key)

        res["first_k_by_k"] = {}
        for k in ks:
            p_fk = fk(pw, MetaConfig(inner_steps=chosen, inner_lr=inner_lr, **red), k)
            for key, w in workers.items():  # every variant side by side under first-k
                fk_k = fk(w, w.trainer.inner_loop, k)
                effect = effect_sizes(w, protocol_batches("first-k", split.holdout_dir, schema, k=k))
                runs[key].setdefault("first_k_by_k", {})[k] = {"first_k": fk_k, "first_k_effect_click": effect}
                if k == ks[0]:
                    runs[key]["first_k"], runs[key]["first_k_effect_click"] = fk_k, effect
                _progress(f"      first-k (k={k}) {key} click logit per task: {effect}")
                _progress(f"      first-k (k={k}) {key}: adapted - base click "
                          f"{fk_k['adapted']['click']['auc'] - fk_k['base']['click']['auc']:+.4f} conversion "
                          f"{fk_k['adapted']['conversion']['auc'] - fk_k['base']['conversion']['auc']:+.4f}; adapted "
                          f"click {fk_k['adapted']['click']['auc']:.4f} conversion "
                          f"{fk_k['adapted']['conversion']['auc']:.4f}")
            m_fk = runs[chosen_key]["first_k_by_k"][k]["first_k"]
            entry: dict[str, Any] = {"k": k, "meta": m_fk, "plain": p_fk}
            for head in ("click", "conversion"):
                entry[f"{head}_adapted_minus_base"] = m_fk["adapted"][head]["auc"] - m_fk["base"][head]["auc"]
                entry[f"{head}_adapted_minus_plain_finetuned"] = (m_fk["adapted"][head]["auc"]
                                                                  - p_fk["adapted"][head]["auc"])
                _progress(f"      first-k (k={k}) {head}: base {m_fk['base'][head]['auc']:.4f} adapted "
                          f"{m_fk['adapted'][head]['auc']:.4f} plain {p_fk['base'][head]['auc']:.4f} plain+ft "
                          f"{p_fk['adapted'][head]['auc']:.4f}")
            res["first_k_by_k"][k] = entry
        if baselines:
            first_k_baselines(res, ks, pw, workers[chosen_key], vsplit, split.holdout_dir, schema, baseline_prior, smoke)
        first = res["first_k_by_k"][ks[0]]  # the keys of a single --first-k, as before
        res["first_k"] = {"k": ks[0], "meta": first["meta"], "plain": first["plain"]}
        for head in ("click", "conversion"):
            for what in ("adapted_minus_base", "adapted_minus_plain_finetuned"):
                res[f"first_k_{head}_{what}"] = first[f"{head}_{what}"]
    for head in ("click", "conversion"):
        res[f"{head}_adapted_minus_base"] = held["adapted"][head]["auc"] - held["base"][head]["auc"]
        res[f"{head}_adapted_minus_plain_finetuned"] = held["adapted"][head]["auc"] - plain["adapted"][head]["auc"]
        _progress(f"      held-out {head}: base {held['base'][head]['auc']:.4f} adapted "
                  f"{held['adapted'][head]['auc']:.4f} plain {plain['base'][head]['auc']:.4f} plain+ft "
                  f"{plain['adapted'][head]['auc']:.4f}")
    return res


def first_k_baselines(res: dict[str, Any], ks: list[int], pw: Any, mw: Any, vsplit: Any, holdout_dir: Path,
                      schema: Any, prior: float, smoke: bool) -> None:
    """Train the standard baselines on the training users and score every arm + a per-task offset
    under first-k, per K: ``res["first_k_by_k"][k]["baselines"]`` (``bench.quality_baselines``).

    Args:
        res: one seed's result with ``first_k_by_k[k]["meta"/"plain"]`` filled.
        ks: the K values.
        pw / mw: the plain worker and the chosen meta variant's worker.
        vsplit: the training / validation user split (baselines train on its train users, tune on the others).
        holdout_dir: the held-out users' rows.
        schema: the data's schema.
        prior: the offset's lambda.
        smoke: the baselines' smoke sizes.
    """
    from bench.quality_baselines import compare_entry, model_logits, score_first_k, train_baselines
    from models.losses import heads_for_schema
    from workers.eval_protocols import protocol_batches

    heads = [h.name for h in heads_for_schema(schema)]
    _progress("  baselines: logistic regression (L2 on validation users), LightGBM where installed")
    bl = train_baselines(vsplit.train_dir, vsplit.holdout_dir, schema, heads, smoke)
    res["baselines"] = bl.info
    for w in (pw, mw):
        w.trainer.refresh_dense()
    sources = {"metaps_plain": model_logits(pw.model, pw.rows), "metaps_meta": model_logits(mw.model, mw.rows),
               **bl.sources}
    for k in ks:
        batches = list(protocol_batches("first-k", holdout_dir, schema, k=k))
        scored = {name: score_first_k(batches, src, heads, prior) for name, src in sources.items()}
        e = res["first_k_by_k"][k]
        e["baselines"] = compare_entry(e["meta"], e["plain"], scored, bl.info, heads, prior)
        for h in heads:
            g = e["baselines"]["goal"][h]
            arms = " ".join(f"{n} {e['baselines'][h][n]['base']['auc']:.4f}->{e['baselines'][h][n]['offset']['auc']:.4f}"
                            for n in ("metaps_plain", "metaps_meta", "logreg", "lightgbm")
                            if isinstance(e["baselines"][h][n], dict))
            _progress(f"      first-k (k={k}) {h} base->offset: {arms}; adapted {g['adapted']:.4f} vs {g['best']} "
                      f"{g['best_auc']:.4f} ({g['margin']:+.4f})")


def shared_inner_keys(inner_loss_reduction: str, support: int, offset_steps: int, offset_prior: float) -> dict[str, Any]:
    """The ``[meta]`` keys the meta trainings and the plain model's fine-tuning ("plain + ft") share.

    Defaults add no key (the job is the one of before): ``inner_loss_reduction = "mean"``, ``offset_steps = 0``.

    Args:
        inner_loss_reduction: ``[meta] inner_loss_reduction``.
        support: the layout's support rows per task (``inner_support_size`` of ``sum_per_support``).
        offset_steps: ``[meta] offset_steps`` (0: off).
        offset_prior: ``[meta] offset_prior`` (with ``offset_steps``).
    """
    keys: dict[str, Any] = ({} if inner_loss_reduction == "mean" else
                            {"inner_loss_reduction": inner_loss_reduction, "inner_support_size": support})
    if offset_steps:
        keys.update(offset_steps=offset_steps, offset_prior=offset_prior)
    return keys


def effect_sizes(w: Any, batches: Any, head: str = "click") -> dict[str, float]:
    """Per held-out task, how far adaptation moves the ``head`` logit vs how far it should move.

    Over first-k meta batches, per task (mean over its scored rows): ``residual`` =
    logit(oracle) - base logit (the task's own effect the base model misses: what adaptation
    should add), ``adapted`` = adapted - base logit, and, with MetaEmb, ``generated`` = the
    logit shift of the generated rows alone (0 inner steps). Returns their std over tasks and
    each shift's correlation with the residual.
    """
    import dataclasses

    import torch

    from models.meta import adapt_and_predict
    from models.meta_learner import MetaLearner

    learner = w.trainer.learner
    gen0 = None
    if learner is not None and learner.meta_emb:
        gen0 = MetaLearner(w.model, dataclasses.replace(learner.cfg, inner_steps=0, offset_steps=0))
        gen0.load_state_dict(learner.state_dict())
        gen0.set_init_rows(learner.init_rows or {})
    w.trainer.refresh_dense()
    w.model.eval()
    logit = lambda p: torch.logit(p.double().clamp(1e-6, 1 - 1e-6))  # noqa: E731
    per: dict[str, list[np.ndarray]] = {"residual": [], "adapted": [], "generated": []}
    for mb in batches:
        rows = {t: torch.from_numpy(r) for t, r in w.rows.pull({t: u.numpy() for t, u in mb.unique_ids.items()}).items()}
        m = mb.query.mask.bool() & mb.task_mask.bool()[:, None]
        cnt = m.sum(1)
        keep = cnt > 0
        mean = lambda x: ((x * m).sum(1) / cnt.clamp_min(1))[keep].numpy()  # noqa: E731
        base = logit(w.model.predict(mb.query, rows, mb.unique_ids)[head])
        per["residual"].append(mean(logit(mb.query.oracle[head]) - base))
        per["adapted"].append(mean(logit(adapt_and_predict(w.model, mb.support, mb.query, rows, mb.unique_ids,
                                                           learner)[head]) - base))
        if gen0 is not None:
            per["generated"].append(mean(logit(adapt_and_predict(w.model, mb.support, mb.query, rows, mb.unique_ids,
                                                                 gen0)[head]) - base))
    out: dict[str, float] = {}
    res = np.concatenate(per["residual"])
    out["tasks"] = float(res.shape[0])
    out["residual_std"] = float(res.std())
    for k in ("adapted", "generated"):
        if per[k]:
            v = np.concatenate(per[k])
            out[f"{k}_std"] = float(v.std())
            out[f"{k}_corr_residual"] = float(np.corrcoef(v, res)[0, 1])
    return out


def parse_first_k(text: str) -> list[int]:
    """``--first-k``: comma-separated support sizes K (``"4,8,16,32"``; ``"0"`` or ``""``: off).

    Raises:
        SystemExit: not a list of integers >= 1 (argparse-style message naming the flag).
    """
    try:
        ks = [int(x) for x in str(text).split(",") if x.strip()]
    except ValueError:
        raise SystemExit(f"--first-k: expected comma-separated integers (e.g. 4,8,16), got {text!r}") from None
    if ks == [0]:
        return []
    if any(k < 1 for k in ks) or len(set(ks)) != len(ks):
        raise SystemExit(f"--first-k: expected distinct integers >= 1, got {text!r}")
    return ks


def first_k_summary(per_seed: list[dict[str, Any]], ks: list[int]) -> dict[int, Any]:
    """Per K: median (min, max) over seeds of the chosen variant's first-k gains, and the goals per K."""
    out: dict[int, Any] = {}
    for k in ks:
        rs = [r["first_k_by_k"][k] for r in per_seed]
        out[k] = {f"{head}_{what}": _spread([r[f"{head}_{what}"] for r in rs])
                  for head in ("click", "conversion") for what in ("adapted_minus_base", "adapted_minus_plain_finetuned")}
        out[k]["goals_met_every_seed"] = {
            "click_adapted_minus_base>=0.02": all(r["click_adapted_minus_base"] >= 0.02 for r in rs),
            "conversion_adapted_minus_base>=0.01": all(r["conversion_adapted_minus_base"] >= 0.01 for r in rs),
            "adapted>plain_finetuned(both heads)": all(r["click_adapted_minus_plain_finetuned"] > 0
                                                       and r["conversion_adapted_minus_plain_finetuned"] > 0 for r in rs),
        }
    return out


def _spread(values: list[float]) -> dict[str, float]:
    return {"median": float(np.median(values)), "min": float(np.min(values)), "max": float(np.max(values))}


def _fk_gain(m: dict[str, Any], head: str, what: str) -> float:
    return float(m["adapted"][head]["auc"] - (m["base"][head]["auc"] if what == "adapted_minus_base" else 0.0))


def main_inner(args: argparse.Namespace) -> int:
    """``--cold-only``: the inner-loop study over seeds (no plain model table)."""
    from meta_io.synth import generate, world_config

    rows, users, items, fraction = cold_sizes(args.quick or args.smoke, args.rows or (SMOKE_ROWS if args.smoke else 0))
    epochs = 1 if args.smoke else 2 if rows <= 50_000 else 1
    steps_list = [int(x) for x in (args.inner_steps or ("1,2" if args.smoke else "1,2,3,5")).split(",") if x]
    seeds = [int(x) for x in (args.seeds or ("3" if args.smoke else "3,4,5")).split(",") if x]
    emb_list = {"off": (False,), "on": (True,), "both": (False, True)}[args.meta_emb]
    ks = parse_first_k(args.first_k)
    if args.baselines == "on" and not args.baseline_offset_prior > 0:
        raise SystemExit(f"--baseline-offset-prior: expected lambda > 0, got {args.baseline_offset_prior}")
    out: dict[str, Any] = {"first_k": ks, "support_loss_weight": args.support_loss_weight,
                           "offset_steps": args.offset_steps, "offset_prior": args.offset_prior,
                           "inner_loss_reduction": args.inner_loss_reduction, "baselines": args.baselines,
                           "baseline_offset_prior": args.baseline_offset_prior, "world": args.world, "rows": rows, "users": users, "epochs": epochs, "seeds": seeds, "inner_steps": steps_list,
                           "learn_inner_lr": args.learn_inner_lr, "inner_lr": args.inner_lr,
                           "meta_emb": args.meta_emb, "meta_emb_cold_weight": args.meta_emb_cold_weight,
                           "meta_emb_labels": args.meta_emb_labels,
                           "per_seed": {}}
    t_all = time.perf_counter()
    for seed in seeds:
        with tempfile.TemporaryDirectory(prefix="bench-quality-") as td:
            tmp = Path(td)
            _progress(f"[seed {seed}] generating {rows:,} rows ({users:,} users)")
            gen = generate(tmp / "raw", world_config(cold_generator_config(rows, users, items, seed), args.world),
                           progress=False)
            out["per_seed"][seed] = cold_start_sweep(gen, tmp, seed, epochs, fraction, steps_list,
                                                     args.learn_inner_lr, args.inner_lr, ks,
                                                     emb_list, args.meta_emb_cold_weight, args.meta_emb_labels,
                                                     args.support_loss_weight, args.inner_loss_reduction,
                                                     args.offset_steps, args.offset_prior,
                                                     args.baselines == "on", args.baseline_offset_prior, args.smoke)
    per = list(out["per_seed"].values())
    if ks:
        out["first_k_by_k"] = first_k_summary(per, ks)
    if ks and args.baselines == "on":
        from bench.quality_baselines import baseline_goals

        out["goals"] = baseline_goals(out["per_seed"], ks)
    if ks:  # each variant's first-k gains over seeds (side by side, same data)
        out["first_k_per_variant"] = {
            key: {f"{head}_{what}": _spread([_fk_gain(r["runs"][key]["first_k"], head, what) for r in per])
                  for head in ("click", "conversion") for what in ("adapted_minus_base", "adapted")}
            for key in per[0]["runs"]}
    for key in ("click_adapted_minus_base", "conversion_adapted_minus_base", "click_adapted_minus_plain_finetuned",
                "conversion_adapted_minus_plain_finetuned"):
        out[key] = _spread([r[key] for r in per])
    out["goals_met_every_seed"] = {
        "click_adapted_minus_base>=0.02": all(r["click_adapted_minus_base"] >= 0.02 for r in per),
        "conversion_adapted_minus_base>=0.01": all(r["conversion_adapted_minus_base"] >= 0.01 for r in per),
        "adapted>plain_finetuned(both heads)": all(r["click_adapted_minus_plain_finetuned"] > 0
                                                   and r["conversion_adapted_minus_plain_finetuned"] > 0 for r in per),
    }
    out["elapsed_s"] = time.perf_counter() - t_all
    print(json.dumps(out, default=float), flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    from meta_io.synth import WORLDS

    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["deepfm-parity"]:  # metaps's deepfm vs a plain DeepFM (bench/deepfm_parity.py)
        from bench.deepfm_parity import run

        return run(argv[1:])

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="16k rows instead of 1M (about a minute)")
    ap.add_argument("--rows", type=int, default=0, help="generated rows (default 1M, quick 16k)")
    ap.add_argument("--kinds", default=",".join(KINDS), help="model kinds of the plain table")
    ap.add_argument("--seed", type=int, default=3)
    ap.add_argument("--cold-only", action="store_true", help="only the inner-loop study (section 3)")
    ap.add_argument("--smoke", action="store_true",
                    help=f"smallest size that runs every code path and prints the JSON line ({SMOKE_ROWS} rows, 1 "
                         "epoch; --cold-only: seed 3, inner steps 1,2 unless given; seconds, figures meaningless)")
    ap.add_argument("--world", default="default", choices=sorted(WORLDS),
                    help="--cold-only: the generator's named world (hidden: per-user effects no feature reveals; "
                         "bench.quality_ceiling --world hidden gives its ceiling)")
    ap.add_argument("--seeds", default="", help="seeds of the inner-loop study (default 3,4,5; --smoke: 3)")
    ap.add_argument("--inner-steps", default="",
                    help="inner step counts to choose from (validation users; default 1,2,3,5; --smoke: 1,2)")
    ap.add_argument("--learn-inner-lr", default="element", choices=("off", "tensor", "element"))
    ap.add_argument("--inner-lr", type=float, default=0.1)
    ap.add_argument("--first-k", default="8",
                    help="also score held-out users under first-k, one or more K (e.g. 4,8,16,32; 0: off); "
                         "every K on the same trained models")
    ap.add_argument("--support-loss-weight", type=float, default=0.0,
                    help="[meta] support_loss_weight of the meta trainings (0: the G-Meta objective)")
    ap.add_argument("--inner-loss-reduction", choices=["mean", "sum_per_support"], default="mean",
                    help="--cold-only: [meta] inner_loss_reduction of the meta trainings and the plain "
                         "model's fine-tuning (sum_per_support: sum over support rows / the layout's support 8)")
    ap.add_argument("--offset-steps", type=int, default=0,
                    help="--cold-only: [meta] offset_steps (Newton iterations of a per-task logit offset) of the "
                         "meta trainings and the plain model's fine-tuning (0: off)")
    ap.add_argument("--offset-prior", type=float, default=16.0, help="--cold-only: [meta] offset_prior (lambda > 0)")
    ap.add_argument("--baselines", choices=("on", "off"), default="on",
                    help="train logistic regression and (where installed) LightGBM on the same rows and score them: "
                         "beside the plain table on the time split; --cold-only with --first-k: beside the plain "
                         "and the meta model, each + a per-task offset")
    ap.add_argument("--baseline-offset-prior", type=float, default=4.0,
                    help="--cold-only: prior strength lambda of the baselines' per-task logit offset")
    ap.add_argument("--meta-emb", default="off", choices=("off", "on", "both"),
                    help="MetaEmb cold user-id rows ([meta] meta_emb on the user table): off, on, or both side by side")
    ap.add_argument("--meta-emb-cold-weight", type=float, default=0.5, help="[meta] meta_emb_cold_weight")
    ap.add_argument("--meta-emb-labels", action="store_true", help="[meta] meta_emb_labels (support labels feed the generator)")
    args = ap.parse_args(argv)
    logging.basicConfig(level=logging.WARNING)
    if args.cold_only:
        return main_inner(args)
    from meta_io.build import MetaIOBuildConfig, build
    from meta_io.synth import GeneratorConfig, generate
    from meta_io.holdout import split_by_task, split_by_time
    from meta_io.layout import Layout
    from meta_io.schema import load_schema
    from workers.local import train_local

    rows = args.rows or (SMOKE_ROWS if args.smoke else 16_000 if args.quick else 1_000_000)
    epochs = 1 if args.smoke else 2 if rows <= 50_000 else 1
    users, items = max(250, rows // 64), max(200, rows // 80)
    out: dict[str, Any] = {"rows": rows, "users": users, "items": items, "epochs": epochs, "seed": args.seed}
    t_all = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="bench-quality-") as td:
        tmp = Path(td)
        _progress(f"[data] generating {rows:,} rows ({users:,} users, {items:,} items)")
        gen = generate(tmp / "raw", GeneratorConfig(rows=rows, users=users, items=items, seed=args.seed,
                                                    n_files=max(1, rows // 250_000),
                                                    row_group_rows=min(rows, 65_536)), progress=False)
        out["generator_oracle_auc"] = gen.oracle_auc
        out["generator_oracle_auc_global"] = gen.oracle_auc_global
        tsplit = split_by_time(gen.out_dir, load_schema(gen.schema_path), tmp / "tsplit", fraction=0.2)
        train_raw, eval_raw, tschema = tsplit.train_dir, tsplit.holdout_dir, tsplit.schema_path
        out["time_cut"] = tsplit.time_cut
        plain_cfg = MetaIOBuildConfig(layout=Layout.PLAIN, rows_per_batch=256)
        train = build(train_raw, tschema, tmp / "plain-train", plain_cfg).out_dir
        held = build(eval_raw, tschema, tmp / "plain-eval",
                     MetaIOBuildConfig(layout=Layout.PLAIN, rows_per_batch=2048)).out_dir

        table: dict[str, Any] = {}
        kinds = [k for k in args.kinds.split(",") if k]
        for i, kind in enumerate(kinds, 1):
            _progress(f"[plain {i}/{len(kinds)}] {kind}: train on earlier rows, score later rows of the same users")
            t0 = time.perf_counter()
            rep, _ = train_local(job_for(train, held, tmp / f"run-{kind}", "plain", kind, epochs), tmp / f"run-{kind}",
                                 checkpoint=False)
            m = _metrics(rep["eval"]["base"])
            m["train_s"] = time.perf_counter() - t0
            table[kind] = m
            _progress(f"      click norm_auc {m['click']['norm_auc']:.3f} (auc {m['click']['auc']:.4f} / oracle "
                      f"{m['click']['oracle_auc']:.4f}); conversion norm_auc {m['conversion']['norm_auc']:.3f}; "
                      f"{m['train_s']:.0f} s")
        if args.baselines == "on":
            table.update(time_split_baselines(train_raw, eval_raw, load_schema(tschema), tmp, args.smoke))
        out["plain_time_split"] = table

        fraction = 0.25 if args.quick or args.smoke else 0.1
        _progress(f"[cold start] hold out {fraction:.0%} of users, build meta episodes (support 8, query 8)")
        split = split_by_task(gen.out_dir, load_schema(gen.schema_path), tmp / "usplit", fraction=fraction,
                              seed=args.seed)
        meta_cfg = MetaIOBuildConfig(support=8, query=8, rows_per_batch=256)
        mtrain = build(split.train_dir, split.schema_path, tmp / "meta-train", meta_cfg).out_dir
        mheld = build(split.holdout_dir, split.schema_path, tmp / "meta-held", meta_cfg).out_dir
        meta = {"inner_steps": 1, "inner_lr": 0.1, "adapt": "both", "first_order": True,
                "support_loss_weight": args.support_loss_weight}
        _progress("[cold start 1/2] meta training (G-Meta, first order, adapt rows + dense)")
        rep, _ = train_local(job_for(mtrain, mheld, tmp / "run-meta", "meta", "dnn", epochs, meta), tmp / "run-meta",
                             checkpoint=False)
        base, adapted = _metrics(rep["eval"]["base"]), _metrics(rep["eval"]["adapted"])
        _progress("[cold start 2/2] plain training on the same train users (no adaptation baseline)")
        prep, _ = train_local(job_for(mtrain, mheld, tmp / "run-meta-plain", "plain", "dnn", epochs),
                              tmp / "run-meta-plain", checkpoint=False)
        plain = _metrics(prep["eval"]["base"])
        out["cold_start"] = {"held_out_users": split.holdout_tasks, "meta_base": base, "meta_adapted": adapted,
                             "plain": plain}
        for head in ("click", "conversion"):
            out[f"cold_{head}_adapted_minus_base_auc"] = adapted[head]["auc"] - base[head]["auc"]
            out[f"cold_{head}_adapted_minus_plain_auc"] = adapted[head]["auc"] - plain[head]["auc"]
            _progress(f"      {head}: plain {plain[head]['auc']:.4f}, meta base {base[head]['auc']:.4f}, "
                      f"meta adapted {adapted[head]['auc']:.4f} (oracle {adapted[head]['oracle_auc']:.4f})")
    for kind, m in out["plain_time_split"].items():
        out[f"{kind}_click_norm_auc"] = m["click"]["norm_auc"]
        out[f"{kind}_conversion_norm_auc"] = m["conversion"]["norm_auc"]
    out["elapsed_s"] = time.perf_counter() - t_all
    out["targets_met"] = {
        "plain_click_norm_auc>=0.8(all kinds)": all(m["click"]["norm_auc"] >= 0.8 for k, m in out["plain_time_split"].items()
                                                    if k in kinds),
        "cold_click_adapted>base": out["cold_click_adapted_minus_base_auc"] > 0,
    }
    print(json.dumps(out, default=float), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
