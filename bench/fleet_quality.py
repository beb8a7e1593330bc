"""Fleet quality vs local quality: the same meta job under ``metaps launch`` and ``train-local``.

Run::

    python -m bench.fleet_quality [--quick] [--seeds 3,4,5] [--ps 2] [--workers 2] [--set ps.sync=sync]
    python -m bench.fleet_quality --smoke   # 4k rows, 1 seed, 1 epoch, a 1 PS x 1 worker fleet; figures meaningless

Issue 29 item 4 measured, once, a fleet (2 PS, 2 workers) training a worse conversion
model than one process on the same job (0.832 vs 0.838 AUC). This bench repeats that
comparison over seeds, with nothing but the process layout changed:

* **Data** per seed: the AntM2C-like generator (``bench.quality_setup.cold_generator_config``,
  the seed is also the generator's), held-out users split off with
  ``bench.quality_setup.cold_split`` (25% of users with ``--quick`` / ``--smoke``, 10% at full
  size); the training users' rows built as meta episodes (support 8, query 8, 256 rows a batch).
* **Job**: ``bench.quality_setup.job_for`` (meta mode, ``dnn``, G-Meta first order, one inner step of
  lr 0.1 adapting rows and dense, ``overlap = false``), ``[train] seed`` = the seed, no
  ``[data] eval`` (both models are scored below, by the same code). One mapping: ``train-local``
  reads it as is (in this process, :func:`workers.local.train_local`, checkpoint written);
  the fleet gets it as a TOML file and runs as real processes (``python -m metaps launch
  --ps P --workers W``, controller, PS and worker processes on loopback; ``--set`` overrides
  apply to the fleet only, to test a suspect setting).
* **Scoring**: both final checkpoints through :func:`metaps.evaluate.evaluate_report` (what
  ``metaps evaluate`` runs) on the held-out users' raw rows: ``all`` = the base model on every
  held-out row (``--protocol plain``); ``first_k`` = first-k with K=8 (the first 8 rows of each
  held-out user by time adapt, every later row is scored once), base and adapted.

Per seed, per evaluation (``all``, ``first_k_base``, ``first_k_adapted``) and head (click,
conversion): local AUC, fleet AUC and ``fleet - local``. ``goal``: "fleet within 0.003 of local
on both heads, every seed" over every evaluation, one-sided (a fleet better than local passes):
``met`` and ``worst_margin`` = 0.003 - max(local - fleet) (negative: missed by that much), with
where the worst gap is. ``max_abs_diff`` is the largest gap either way.

**Finding the cause** of a gap: ``--variant LABEL=SPEC`` (repeatable) trains another fleet per seed
beside the main one, on the same data against the same train-local model, with its own layout
and overrides (``1x1``, ``ps.sync=sync``, ``train.dense_sync=allreduce``,
``controller.dds.batches_per_shard=100000`` = one shard per file, i.e. train-local's data order);
each is reported under ``variants`` with its own goal.

**The noise floor**: ``--local-shuffles N`` trains ``train-local`` N times per seed on the same data,
its ``[controller.dds] seed`` 0..N-1 (seed 0, the job's default, is the compared run). train-local
reads its batches in the order the DDS would lease them to one worker
(:func:`common.shard_order.shard_order`: shards of ``batches_per_shard`` batches, shuffled per
``seed + epoch``; a 1 PS x 1 worker fleet reproduces it exactly), so N shuffle seeds show how far
the data order alone moves one process's AUC. ``local_spread`` per evaluation and head: per seed ``min``,
``max``, ``range``, ``std`` and ``mean`` of those N AUCs and the fleet's AUC minus that mean, and
over seeds ``mean_std``, ``max_range`` and ``fleet_minus_mean``; ``fleet_in_range`` counts the
seed/evaluation/head cells whose fleet AUC lies inside train-local's range (a fleet gap smaller
than the order noise is not evidence against the fleet).

``--smoke`` (the test suite's run): 4,000 rows, seed 3, 1 epoch, a 1 PS x 1 worker fleet, so every
step runs once (data, local training, a launched fleet, both evaluations, the goal); seconds of
CPU; the figures mean nothing. The last line printed is a JSON object.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

HEADS = ("click", "conversion")
EVALS = ("all", "first_k_base", "first_k_adapted")
"""The compared evaluations: every held-out row (base), first-k K=8 base and adapted."""
TOLERANCE = 0.003
SMOKE_ROWS = 4_000
FIRST_K = 8
REPO = Path(__file__).resolve().parents[1]


def _progress(msg: str) -> None:
    print(msg, flush=True)


def job_mapping(train: Path, run_dir: Path, epochs: int, seed: int) -> dict[str, Any]:
    """The job both runs train: ``bench.quality_setup.job_for``'s meta job, ``[train] seed``, no eval set.

    Args:
        train: the meta-episode training set.
        run_dir: ``[run] dir`` (train-local's; the fleet gets ``--run-dir``).
        epochs: ``[train] epochs``.
        seed: ``[train] seed`` (the dense initialisation, the same in both runs).
    """
    from bench.quality_setup import job_for

    meta = {"inner_steps": 1, "inner_lr": 0.1, "adapt": "both", "first_order": True}
    data: dict[str, Any] = job_for(train, train, run_dir, "meta", "dnn", epochs, meta).to_dict()
    data["data"]["eval"] = ""
    data["train"]["seed"] = seed
    data["rpc"]["token"] = "bench-fleet-quality"
    return data


def run_local(mapping: dict[str, Any], run_dir: Path) -> Path:
    """``train-local`` of ``mapping`` in this process; the run dir holding its final checkpoint."""
    from metaps.job import job_from_mapping
    from workers.local import train_local

    train_local(job_from_mapping(mapping, where="<bench.fleet_quality>"), run_dir, checkpoint=True)
    return run_dir


def run_fleet(mapping: dict[str, Any], d: Path, ps: int, workers: int, sets: list[str],
              timeout_s: float = 3600.0) -> Path:
    """``python -m metaps launch`` of ``mapping`` (P PS x W workers, ``--set`` overrides); its run dir.

    Raises:
        RuntimeError: the launch failed (the tail of its output in the message).
    """
    from common.toml_writer import write

    d.mkdir(parents=True)
    config = write(d / "job.toml", mapping)
    run = d / "run"
    cmd = [sys.executable, "-m", "metaps", "launch", "--config", str(config), "--ps", str(ps), "--workers",
           str(workers), "--run-dir", str(run), "--no-progress", "--timeout", str(timeout_s)]
    for s in sets:
        cmd += ["--set", s]
    env = dict(os.environ, PYTHONPATH=str(REPO), OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    with (d / "launch.log").open("w") as log:
        rc = subprocess.run(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT,
                            timeout=timeout_s + 120).returncode
    if rc != 0:
        raise RuntimeError(f"metaps launch failed (rc {rc}); its output ends:\n"
                           + (d / "launch.log").read_text(errors="replace")[-3000:])
    return run


def score(checkpoint: Path, holdout: Path) -> dict[str, dict[str, float]]:
    """AUC per evaluation (:data:`EVALS`) and head of a run's newest checkpoint on the held-out rows."""
    from metaps.evaluate import evaluate_report

    everything = evaluate_report(holdout, "plain", checkpoint=checkpoint)
    fk = evaluate_report(holdout, "first-k", checkpoint=checkpoint, k=FIRST_K)
    return {"all": {h: float(everything["base"][h]["auc"]) for h in HEADS},
            "first_k_base": {h: float(fk["base"][h]["auc"]) for h in HEADS},
            "first_k_adapted": {h: float(fk["adapted"][h]["auc"]) for h in HEADS}}


def compare(local: dict[str, dict[str, float]], fleet: dict[str, dict[str, float]]) -> dict[str, Any]:
    """Per evaluation and head: ``{"local", "fleet", "diff"}`` with ``diff = fleet - local``."""
    return {e: {h: {"local": local[e][h], "fleet": fleet[e][h], "diff": fleet[e][h] - local[e][h]}
                for h in HEADS} for e in EVALS}


def parse_variant(text: str) -> tuple[str, int | None, int | None, list[str]]:
    """``--variant LABEL=SPEC``: another fleet trained beside the main one (train-local runs once per seed).

    ``SPEC`` is comma-separated tokens: ``PxW`` (e.g. ``1x1``) sets the fleet's PS shards and workers,
    every other token is a ``metaps launch --set`` override (``SECTION.KEY=VALUE``; a value holding
    a comma cannot be given here). ``"sync=ps.sync=sync"``, ``"order=1x1,controller.dds.batches_per_shard=100000"``.

    Returns:
        (label, ps or None, workers or None, overrides); None: the main fleet's count.

    Raises:
        SystemExit: no label, no ``=``, or an empty spec (argparse-style, naming the flag).
    """
    import re

    label, sep, spec = text.partition("=")
    tokens = [t.strip() for t in spec.split(",") if t.strip()]
    if not sep or not label.strip() or not tokens:
        raise SystemExit(f"--variant: expected LABEL=SPEC (SPEC: PxW and/or SECTION.KEY=VALUE, comma-separated), "
                         f"got {text!r}")
    ps = workers = None
    sets = []
    for t in tokens:
        m = re.fullmatch(r"(\d+)x(\d+)", t)
        if m and int(m[1]) >= 1 and int(m[2]) >= 1:
            ps, workers = int(m[1]), int(m[2])
        elif "=" in t and "." in t.split("=", 1)[0]:
            sets.append(t)
        else:
            raise SystemExit(f"--variant {text!r}: token {t!r} is neither PxW (e.g. 1x1) nor SECTION.KEY=VALUE")
    return label.strip(), ps, workers, sets


def parity_goal(per_seed: dict[Any, dict[str, Any]], tol: float = TOLERANCE) -> dict[str, Any]:
    """The goal "fleet within ``tol`` of local on both heads, every seed", over every evaluation.

    One-sided: a seed/evaluation/head passes when ``local - fleet <= tol`` (a better fleet passes).

    Args:
        per_seed: seed -> :func:`compare`'s result.
        tol: the allowed AUC shortfall of the fleet.

    Returns:
        ``met``, ``worst_margin`` (``tol - max(local - fleet)``; < 0: missed by that much),
        ``worst`` (seed, evaluation, head of that gap), ``max_abs_diff`` and ``tolerance``.

    Raises:
        ValueError: no seeds.
    """
    cells = [(seed, e, h, c[e][h]["diff"]) for seed, c in per_seed.items() for e in EVALS for h in HEADS]
    if not cells:
        raise ValueError("parity_goal: no seeds to judge")
    seed, e, h, diff = min(cells, key=lambda x: x[3])
    margin = tol + diff
    return {"goal": f"fleet within {tol} of local on both heads, every seed", "tolerance": tol,
            "met": margin >= 0, "worst_margin": margin, "worst": {"seed": seed, "eval": e, "head": h, "diff": diff},
            "max_abs_diff": max(abs(c[3]) for c in cells)}


def one_seed(seed: int, rows: int, epochs: int, ps: int, workers: int, sets: list[str], smoke: bool,
             quick: bool, variants: list[tuple[str, int, int, list[str]]] | None = None,
             local_shuffles: int = 0) -> dict[str, Any]:
    """Data, train-local, the fleet (and each variant fleet) and the scorings of one seed (a scratch
    folder, removed after). ``variants``: (label, ps, workers, overrides) of :func:`parse_variant`, resolved.
    ``local_shuffles`` >= 2: train-local again with ``[controller.dds] seed`` 1..N-1 (``local_runs``)."""
    from bench.quality_setup import cold_generator_config, cold_sizes, cold_split
    from meta_io.build import MetaIOBuildConfig, build
    from meta_io.synth import generate

    rows, users, items, fraction = cold_sizes(quick or smoke, rows)
    with tempfile.TemporaryDirectory(prefix="bench-fleet-quality-") as td:
        tmp = Path(td)
        _progress(f"[seed {seed}] generating {rows:,} rows ({users:,} users), holding out {fraction:.0%} of users")
        gen = generate(tmp / "raw", cold_generator_config(rows, users, items, seed), progress=False)
        split = cold_split(gen, tmp, seed, fraction)
        train = build(split.train_dir, split.schema_path, tmp / "m-train",
                      MetaIOBuildConfig(support=8, query=8, rows_per_batch=256)).out_dir
        mapping = job_mapping(train, tmp / "local", epochs, seed)
        t0 = time.perf_counter()
        _progress(f"[seed {seed}] train-local")
        local = score(run_local(mapping, tmp / "local"), split.holdout_dir)
        t1 = time.perf_counter()
        _progress(f"[seed {seed}] metaps launch: {ps} PS x {workers} worker(s)" + (f", {' '.join(sets)}" if sets else ""))
        fleet = score(run_fleet(mapping, tmp / "fleet", ps, workers, sets), split.holdout_dir)
        t2 = time.perf_counter()
        res = compare(local, fleet)
        _show(res)
        extra: dict[str, Any] = {}
        for i, (label, vps, vw, vsets) in enumerate(variants or []):
            _progress(f"[seed {seed}] variant {label}: metaps launch {vps} PS x {vw} worker(s) {' '.join(vsets)}")
            extra[label] = compare(local, score(run_fleet(mapping, tmp / f"variant-{i}", vps, vw, vsets),
                                                split.holdout_dir))
            _show(extra[label])
        runs: dict[int, dict[str, dict[str, float]]] = {0: local} if local_shuffles >= 2 else {}
        for shuffle in range(1, local_shuffles):
            _progress(f"[seed {seed}] train-local, controller.dds.seed = {shuffle}")
            m = json.loads(json.dumps(mapping))
            m.setdefault("controller", {}).setdefault("dds", {})["seed"] = shuffle
            runs[shuffle] = score(run_local(m, tmp / f"local-{shuffle}"), split.holdout_dir)
            _progress("      " + "; ".join(f"{e} {h} {runs[shuffle][e][h]:.4f}" for e in EVALS for h in HEADS))
    return {**res, "held_out_users": split.holdout_tasks, "local_s": t1 - t0, "fleet_s": t2 - t1,
            **({"variants": extra} if variants else {}), **({"local_runs": runs} if runs else {})}


def local_spread(per_seed: dict[Any, dict[int, dict[str, dict[str, float]]]],
                 fleet: dict[Any, dict[str, dict[str, dict[str, float]]]]) -> dict[str, Any]:
    """train-local's AUC spread over DDS shuffle seeds (the order noise), and where the fleet falls in it.

    Args:
        per_seed: seed -> shuffle seed -> :func:`score`'s result (at least 2 shuffles per seed).
        fleet: seed -> :func:`compare`'s result of the main fleet (its ``fleet`` AUCs are placed).

    Returns:
        ``per_seed``: seed -> evaluation -> head -> ``min``, ``max``, ``range``, ``std`` (ddof 1),
        ``mean`` and (seeds with a fleet) ``fleet_minus_mean``; ``summary``: per evaluation and head
        over seeds ``mean_std``, ``max_range`` and ``fleet_minus_mean`` (the fleet against
        train-local's mean over orders, not against one order); ``fleet_in_range`` / ``cells``: how
        many seed/evaluation/head fleet AUCs lie within train-local's [min, max].

    Raises:
        MetapsError: a seed with fewer than 2 shuffles (no spread to measure).
    """
    import statistics

    from common.errors import MetapsError

    out: dict[str, Any] = {"per_seed": {}, "summary": {}}
    inside = cells = 0
    for seed, runs in per_seed.items():
        if len(runs) < 2:
            raise MetapsError(f"local_spread: seed {seed} has {len(runs)} train-local shuffle(s); need >= 2")
        out["per_seed"][seed] = {}
        for e in EVALS:
            out["per_seed"][seed][e] = {}
            for h in HEADS:
                v = [r[e][h] for r in runs.values()]
                cell = {"min": min(v), "max": max(v), "range": max(v) - min(v), "std": statistics.stdev(v),
                        "mean": statistics.fmean(v), "shuffles": len(v)}
                if seed in fleet:
                    cells += 1
                    inside += int(cell["min"] <= fleet[seed][e][h]["fleet"] <= cell["max"])
                    cell["fleet_minus_mean"] = fleet[seed][e][h]["fleet"] - cell["mean"]
                out["per_seed"][seed][e][h] = cell
    for e in EVALS:
        out["summary"][e] = {}
        for h in HEADS:
            cs = [out["per_seed"][s][e][h] for s in per_seed]
            out["summary"][e][h] = {"mean_std": statistics.fmean(c["std"] for c in cs),
                                    "max_range": max(c["range"] for c in cs)}
            if any("fleet_minus_mean" in c for c in cs):
                out["summary"][e][h]["fleet_minus_mean"] = statistics.fmean(
                    c["fleet_minus_mean"] for c in cs if "fleet_minus_mean" in c)
    out["fleet_in_range"], out["cells"] = inside, cells
    return out


def _show(res: dict[str, Any]) -> None:
    for e in EVALS:
        _progress(f"      {e}: " + "; ".join(f"{h} local {res[e][h]['local']:.4f} fleet {res[e][h]['fleet']:.4f} "
                                             f"({res[e][h]['diff']:+.4f})" for h in HEADS))


def _diff_means(per_seed: dict[Any, dict[str, Any]]) -> dict[str, float]:
    """``EVAL_HEAD_diff_mean``: the mean of ``fleet - local`` over seeds, per evaluation and head."""
    return {f"{e}_{h}_diff_mean": sum(r[e][h]["diff"] for r in per_seed.values()) / len(per_seed)
            for e in EVALS for h in HEADS}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="16k rows, 250 users, 25%% held out (default 1M rows, 10%%)")
    ap.add_argument("--smoke", action="store_true",
                    help=f"{SMOKE_ROWS} rows, seed 3, 1 epoch, 1 PS x 1 worker (every step once; figures meaningless)")
    ap.add_argument("--rows", type=int, default=0, help="generated rows (default: 1M, --quick 16k)")
    ap.add_argument("--seeds", default="", help="comma-separated seeds (default 3,4,5; --smoke 3)")
    ap.add_argument("--epochs", type=int, default=0, help="[train] epochs (default 2 up to 50k rows, else 1; smoke 1)")
    ap.add_argument("--ps", type=int, default=0, help="PS shards of the fleet (default 2; --smoke 1)")
    ap.add_argument("--workers", type=int, default=0, help="workers of the fleet (default 2; --smoke 1)")
    ap.add_argument("--set", action="append", default=[], dest="sets", metavar="SECTION.KEY=VALUE",
                    help="a job override for the fleet only (metaps launch --set), e.g. ps.sync=sync; repeatable")
    ap.add_argument("--variant", action="append", default=[], dest="variants", metavar="LABEL=SPEC",
                    help="another fleet beside the main one, on the same data and the same train-local: SPEC is "
                         "comma-separated PxW (e.g. 1x1) and/or SECTION.KEY=VALUE overrides, e.g. "
                         "sync=ps.sync=sync; repeatable (each reported with its own goal under variants)")
    ap.add_argument("--local-shuffles", type=int, default=0, metavar="N",
                    help="train-local N times per seed, [controller.dds] seed 0..N-1 (its data order): "
                         "the spread is the order noise the fleet's gap is judged against (N >= 2; 0: off)")
    args = ap.parse_args(argv)
    if args.local_shuffles == 1 or args.local_shuffles < 0:
        raise SystemExit(f"--local-shuffles: expected 0 (off) or >= 2, got {args.local_shuffles}")
    parsed = [parse_variant(v) for v in args.variants]
    if len({v[0] for v in parsed}) != len(parsed):
        raise SystemExit(f"--variant: labels must differ, got {[v[0] for v in parsed]}")
    logging.basicConfig(level=logging.WARNING)
    seeds = [int(x) for x in (args.seeds or ("3" if args.smoke else "3,4,5")).split(",") if x.strip()]
    rows = args.rows or (SMOKE_ROWS if args.smoke else 0)
    from bench.quality_setup import cold_sizes

    n = cold_sizes(args.quick or args.smoke, rows)[0]
    epochs = args.epochs or (1 if args.smoke else 2 if n <= 50_000 else 1)
    ps = args.ps or (1 if args.smoke else 2)
    workers = args.workers or (1 if args.smoke else 2)
    out: dict[str, Any] = {"rows": n, "epochs": epochs, "seeds": seeds, "ps": ps, "workers": workers,
                           "fleet_sets": args.sets, "first_k": FIRST_K, "per_seed": {}}
    t0 = time.perf_counter()
    variants = [(label, vps or ps, vw or workers, vsets) for label, vps, vw, vsets in parsed]
    for seed in seeds:
        out["per_seed"][seed] = one_seed(seed, rows, epochs, ps, workers, args.sets, args.smoke, args.quick, variants,
                                         args.local_shuffles)
    if args.local_shuffles:
        out["local_spread"] = local_spread({s: r.pop("local_runs") for s, r in out["per_seed"].items()}, out["per_seed"])
        for e in EVALS:
            _progress(f"train-local over {args.local_shuffles} shuffles, {e}: " + "; ".join(
                f"{h} mean std {out['local_spread']['summary'][e][h]['mean_std']:.4f} "
                f"max range {out['local_spread']['summary'][e][h]['max_range']:.4f}, "
                f"fleet - their mean {out['local_spread']['summary'][e][h]['fleet_minus_mean']:+.4f}" for h in HEADS))
        _progress(f"fleet AUC inside train-local's range: {out['local_spread']['fleet_in_range']} of "
                  f"{out['local_spread']['cells']} cells")
    if variants:
        out["variants"] = {}
        for label, vps, vw, vsets in variants:
            per = {seed: r["variants"][label] for seed, r in out["per_seed"].items()}
            g = parity_goal(per)
            out["variants"][label] = {"ps": vps, "workers": vw, "sets": vsets, "goal": g, **_diff_means(per)}
            _progress(f"variant {label}: goal {'met' if g['met'] else 'MISSED'}, worst margin {g['worst_margin']:+.4f}")
    goal = parity_goal(out["per_seed"])
    out["goal"] = goal
    out["goal_met"] = goal["met"]
    out["worst_margin"] = goal["worst_margin"]
    out["max_abs_diff"] = goal["max_abs_diff"]
    out.update(_diff_means(out["per_seed"]))
    out["elapsed_s"] = time.perf_counter() - t0
    w = goal["worst"]
    _progress(f"goal ({goal['goal']}): {'met' if goal['met'] else 'MISSED'}, worst margin {goal['worst_margin']:+.4f} "
              f"(seed {w['seed']}, {w['eval']}, {w['head']}: fleet - local {w['diff']:+.4f})")
    print(json.dumps(out, default=float), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
