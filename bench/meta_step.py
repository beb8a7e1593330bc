"""Meta step vectorized over tasks (vmap) against the per-task Python loop.

Same model, same meta batch, same config; one step = forward + inner loop +
outer gradients (dense and rows). Reports tasks/s of both and their ratio, for
DNN and ESMM, first- and second-order.

    python -m bench.meta_step [--quick] [--threads 2] [--tasks 64]

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


def _time_step(model, batch, rows, cfg: MetaConfig, reps: int) -> tuple[float, float]:
    """Median seconds per meta step over ``reps`` runs, and the last outer loss."""
    times, value = [], float("nan")
    for _ in range(reps):
        t0 = time.perf_counter()
        res = meta_step(model, batch, rows, cfg)
        times.append(time.perf_counter() - t0)
        value = float(res.outer_loss)
    return statistics.median(times), value


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
    ap.add_argument("--quick", action="store_true", help="one timed step per configuration (about a minute)")
    ap.add_argument("--threads", type=int, default=2, help="torch intra-op threads (2 on purpose)")
    ap.add_argument("--tasks", type=int, default=64)
    ap.add_argument("--support", type=int, default=16)
    ap.add_argument("--query", type=int, default=16)
    ap.add_argument("--vocab", type=int, default=500, help="id range per column (sets unique rows per table)")
    ap.add_argument("--adapt", default="both", choices=[a.value for a in AdaptTarget])
    ap.add_argument("--inner-steps", type=int, default=1)
    ap.add_argument("--loop-tasks", type=int, default=0,
                    help="time the loop on the first N tasks only (its cost is linear in tasks); "
                         "default: all tasks, 16 with --quick")
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    reps = 1 if args.quick else 3
    loop_tasks = args.loop_tasks or (min(16, args.tasks) if args.quick else args.tasks)

    # ~30 id columns over 12 tables, as an AntM2C-like log: user, scene, 24 sparse
    # columns on 8 tables, 3 multi-hot tag lists, 1 text field; 4 dense, 1 image vector.
    schema = synthetic_schema(n_sparse=24, n_multi_hot=3, n_text=1, n_tables=8, max_len=6, n_dense=4, vector_dim=16)
    g = torch.Generator().manual_seed(0)
    batch = random_meta_batch(schema, args.tasks, args.support, args.query, vocab=args.vocab, generator=g)
    # The loop's batch: the first loop_tasks task slots of the same batch (same unique ids and rows).
    loop_batch = _first_tasks(batch, loop_tasks)
    unique = sum(u.numel() for u in batch.unique_ids.values())
    print(
        f"meta_step bench: {args.tasks} tasks x (S={args.support}, Q={args.query}), "
        f"{len(schema.id_columns)} id columns, {len(schema.tables)} tables, {unique} unique rows, "
        f"threads={args.threads}, adapt={args.adapt}, inner_steps={args.inner_steps}, loop timed on {loop_tasks} tasks",
        flush=True,
    )
    figures: dict[str, dict[str, float]] = {}
    for kind in ("dnn", "esmm"):
        model = build_model(schema, ModelConfig(kind=kind))
        rows = random_rows(batch.unique_ids, model.dims, g)
        for first_order in (True, False):
            name = f"{kind}_{'first' if first_order else 'second'}_order"
            cfgs = {
                vec: MetaConfig(inner_steps=args.inner_steps, inner_lr=0.1, first_order=first_order,
                                adapt=AdaptTarget(args.adapt), vectorize=vec)
                for vec in (True, False)
            }
            # Warm both paths (first calls pay one-time dispatch/trace costs); --quick warms on 2 tasks.
            warm = _first_tasks(batch, 2) if args.quick else batch
            meta_step(model, warm, rows, cfgs[True])
            meta_step(model, _first_tasks(warm, min(loop_tasks, 2 if args.quick else loop_tasks)), rows, cfgs[False])
            t_vmap, loss_vmap = _time_step(model, batch, rows, cfgs[True], reps)
            t_loop, loss_loop = _time_step(model, loop_batch, rows, cfgs[False], reps)
            vmap_tps, loop_tps = args.tasks / t_vmap, loop_tasks / t_loop
            fig = {"vmap_tasks_per_s": vmap_tps, "loop_tasks_per_s": loop_tps, "speedup": vmap_tps / loop_tps}
            if loop_tasks == args.tasks:  # same batch: the outer losses must agree
                fig["loss_abs_diff"] = abs(loss_vmap - loss_loop)
            figures[name] = fig
            print(
                f"  {name:22s} vmap {fig['vmap_tasks_per_s']:8.1f} tasks/s   loop {fig['loop_tasks_per_s']:8.1f} tasks/s"
                f"   speedup {fig['speedup']:5.2f}x",
                flush=True,
            )
    speedups = [f["speedup"] for f in figures.values()]
    result = {
        "bench": "meta_step",
        "vmap_speedup": math.exp(sum(math.log(s) for s in speedups) / len(speedups)),
        "vmap_speedup_min": min(speedups),
        "tasks": args.tasks,
        "support": args.support,
        "query": args.query,
        "threads": args.threads,
        "loop_tasks": loop_tasks,
        "quick": args.quick,
        "configs": figures,
    }
    print(json.dumps(result, sort_keys=True))
    return result


if __name__ == "__main__":
    main()
