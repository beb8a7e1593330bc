"""Meta step vectorized over tasks (vmap) against the per-task Python loop.

Same model, same meta batch, same config; one step = forward + inner loop +
outer gradients (dense and rows). Both paths run the same number of tasks (no
extrapolation), interleaved, ``--reps`` times (default 3); the figures are medians.
Reports tasks/s of both and their ratio, for DNN and ESMM, first- and second-order.

    python -m bench.meta_step [--quick] [--threads 2] [--tasks 64] [--reps 3] [--device cuda]
    python -m bench.meta_step --smoke   # 4 tasks of S4/Q4, 1 rep, every configuration once: seconds, meaningless

The last output line is a JSON object: ``vmap_speedup`` (geometric mean over
the configurations), ``vmap_speedup_min`` and per-configuration figures.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import statistics
import time

import torch

from meta_io.batch import MetaBatch
from models import ModelConfig, build_model
from models.meta import AdaptTarget, MetaConfig, meta_step
from models.testing import random_meta_batch, random_rows, synthetic_schema


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def _once(model, batch, rows, cfg: MetaConfig, device: torch.device) -> tuple[float, float]:
    """Seconds of one meta step (device work included) and its outer loss."""
    _sync(device)
    t0 = time.perf_counter()
    res = meta_step(model, batch, rows, cfg)
    loss = float(res.outer_loss)  # waits for the device
    _sync(device)
    return time.perf_counter() - t0, loss


def _to_device(batch: MetaBatch, device: torch.device) -> MetaBatch:
    move = lambda t: t.to(device)  # noqa: E731
    return dataclasses.replace(
        batch, support=batch.support.map(move), query=batch.query.map(move),
        task_keys=move(batch.task_keys), task_mask=move(batch.task_mask),
        unique_ids={k: move(v) for k, v in batch.unique_ids.items()},
    )


def _first_tasks(batch: MetaBatch, n: int) -> MetaBatch:
    """The first ``n`` task slots of ``batch`` (same unique ids, so the same rows fit)."""
    return dataclasses.replace(
        batch,
        support=batch.support.map(lambda t: t[:n]),
        query=batch.query.map(lambda t: t[:n]),
        task_keys=batch.task_keys[:n],
        task_mask=batch.task_mask[:n],
    )


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--quick", action="store_true", help="16 tasks instead of 64 (a few minutes on a loaded box)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (2 on purpose)")
    ap.add_argument("--tasks", type=int, default=0,
                    help="tasks per meta-batch, timed on both paths (default 64, 16 with --quick, 4 with --smoke)")
    ap.add_argument("--smoke", action="store_true",
                    help="smallest size that runs every configuration and prints the JSON line (4 tasks, support "
                         "and query 4, vocab 50, 1 rep; seconds, figures meaningless)")
    ap.add_argument("--reps", type=int, default=None,
                    help="timed repetitions per path (median; >= 3; default 3, 1 with --smoke)")
    ap.add_argument("--support", type=int, default=16)
    ap.add_argument("--query", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=500, help="id range per column (sets unique rows per table)")
    ap.add_argument("--adapt", default="both", choices=[a.value for a in AdaptTarget])
    ap.add_argument("--inner-steps", type=int, default=1)
    ap.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (model, batch and rows live there)")
    args = ap.parse_args(argv)
    if args.reps is None:
        args.reps = 1 if args.smoke else 3
    if args.reps < 3 and not args.smoke:
        ap.error(f"--reps must be >= 3 (the figures are medians), got {args.reps}")
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        ap.error(f"--device {args.device}: torch.cuda.is_available() is False on this machine")
    torch.set_num_threads(args.threads)
    tasks = args.tasks or (4 if args.smoke else 16 if args.quick else 64)
    if args.smoke:
        args.support, args.query, args.vocab = min(args.support, 4), min(args.query, 4), min(args.vocab, 50)

    # ~30 id columns over 12 tables, as an AntM2C-like log: user, scene, 24 sparse
    # columns on 8 tables, 3 multi-hot tag lists, 1 text field; 4 dense, 1 image vector.
    schema = synthetic_schema(n_sparse=24, n_multi_hot=3, n_text=1, n_tables=8, max_len=6, n_dense=4, vector_dim=16)
    g = torch.Generator().manual_seed(0)
    batch = random_meta_batch(schema, tasks, args.support, args.query, vocab=args.vocab, generator=g)
    unique = sum(u.numel() for u in batch.unique_ids.values())
    print(
        f"meta_step bench: {tasks} tasks x (S={args.support}, Q={args.query}) on both paths, "
        f"{len(schema.id_columns)} id columns, {len(schema.tables)} tables, {unique} unique rows, "
        f"threads={args.threads}, device={device}, adapt={args.adapt}, inner_steps={args.inner_steps}, "
        f"median of {args.reps} interleaved repetitions",
        flush=True,
    )
    batch_d = _to_device(batch, device)
    figures: dict[str, dict[str, float]] = {}
    for kind in ("dnn", "esmm"):
        model = build_model(schema, ModelConfig(kind=kind))
        rows = random_rows(batch.unique_ids, model.dims, g)
        model = model.to(device)
        rows = {k: v.to(device) for k, v in rows.items()}
        for first_order in (True, False):
            name = f"{kind}_{'first' if first_order else 'second'}_order"
            cfgs = {
                vec: MetaConfig(inner_steps=args.inner_steps, inner_lr=0.1, first_order=first_order,
                                adapt=AdaptTarget(args.adapt), vectorize=vec)
                for vec in (True, False)
            }
            # Warm both paths on 2 tasks (first calls pay one-time dispatch/trace costs).
            warm = _first_tasks(batch_d, 2)
            meta_step(model, warm, rows, cfgs[True])
            meta_step(model, warm, rows, cfgs[False])
            t_vmap, t_loop, ratios = [], [], []
            loss_vmap = loss_loop = float("nan")
            for _ in range(args.reps):  # interleaved, so load changes hit both paths alike
                tv, loss_vmap = _once(model, batch_d, rows, cfgs[True], device)
                tl, loss_loop = _once(model, batch_d, rows, cfgs[False], device)
                t_vmap.append(tv)
                t_loop.append(tl)
                ratios.append(tl / tv)
            vmap_tps, loop_tps = tasks / statistics.median(t_vmap), tasks / statistics.median(t_loop)
            fig = {"vmap_tasks_per_s": vmap_tps, "loop_tasks_per_s": loop_tps, "speedup": vmap_tps / loop_tps,
                   "speedup_per_rep": ratios, "loss_abs_diff": abs(loss_vmap - loss_loop)}
            figures[name] = fig
            print(
                f"  {name:22s} vmap {fig['vmap_tasks_per_s']:8.1f} tasks/s   loop {fig['loop_tasks_per_s']:8.1f} tasks/s"
                f"   speedup {fig['speedup']:5.2f}x (per rep {', '.join(f'{r:.2f}' for r in ratios)})",
                flush=True,
            )
    speedups = [f["speedup"] for f in figures.values()]
    result = {
        "bench": "meta_step",
        "vmap_speedup": math.exp(sum(math.log(s) for s in speedups) / len(speedups)),
        "vmap_speedup_min": min(speedups),
        "tasks": tasks,
        "support": args.support,
        "query": args.query,
        "threads": args.threads,
        "reps": args.reps,
        "device": str(device),
        "quick": args.quick,
        "smoke": args.smoke,
        "configs": figures,
    }
    print(json.dumps(result, sort_keys=True))
    return result


if __name__ == "__main__":
    main()
