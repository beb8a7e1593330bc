"""``metaps gen-data`` and ``metaps meta-io build|inspect|split-holdout|stage``.

Example::

    metaps gen-data --out data/ --rows 200000 --users 20000 --items 5000 --seed 1
    metaps meta-io build --input data/ --schema data/schema.json --out metaio/ --support 8 --query 4
        # progress on stderr: a bar per pass on a terminal, else (or with --no-progress) log
        # lines msg="progress" with done/total/pct/per_s/eta_s every 5 s and at each pass's end
    metaps meta-io inspect metaio/ [--verify]
    metaps meta-io split-holdout --input data/ --schema data/schema.json --out split/ --fraction 0.1
    metaps meta-io stage --from s3://bucket/metaio --to /data/metaio [--metadata-only] [--wait 600] \
        [--done-file /data/staged.json] [--overwrite]     # see meta_io.stage
"""

from __future__ import annotations

import argparse
import json
import time
from collections.abc import Mapping
from pathlib import Path
from typing import TYPE_CHECKING, Any

from common.config import from_mapping
from common.errors import ConfigError
from metaps.roles.output import emit, summary_replaces, wants_json

if TYPE_CHECKING:
    from meta_io.build import BuildResult
    from meta_io.build.pipeline import ProgressHook
    from meta_io.holdout import HoldoutSplit
    from meta_io.synth import GeneratedData


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add ``gen-data`` and ``meta-io`` to the ``metaps`` command line."""
    g = subparsers.add_parser("gen-data", help="generate AntM2C-like synthetic CTR/CVR logs (Parquet + schema)")
    g.add_argument("--out", required=True, help="output folder")
    g.add_argument("--rows", type=int, default=200_000, help="rows (impressions) to generate")
    g.add_argument("--users", type=int, default=20_000, help="distinct users (the tasks of Meta-IO)")
    g.add_argument("--items", type=int, default=5_000, help="distinct items")
    g.add_argument("--seed", type=int, default=0, help="random seed (same seed, same data)")
    g.add_argument("--files", type=int, default=None, help="Parquet files to write (default: generator's)")
    g.add_argument("--world", default="default", metavar="NAME",
                   help="named world (meta_io.synth.WORLDS): default, hidden (per-user click/cvr logit "
                        "offsets that no feature reveals: what only adaptation can learn) or taste (per-user "
                        "tastes over item groups that no feature reveals: one score per group, not one offset)")
    g.add_argument("--hidden-user-effect-std", type=float, default=None, metavar="STD",
                   help="per-user click logit offset no feature reveals (overrides the world's)")
    g.add_argument("--hidden-user-cvr-effect-std", type=float, default=None, metavar="STD",
                   help="per-user conversion logit offset no feature reveals (overrides the world's)")
    g.add_argument("--hidden-user-scene-effect-std", type=float, default=None, metavar="STD",
                   help="per-(user, scenario) click logit offset no feature reveals (overrides the world's)")
    g.set_defaults(func=_gen_data)

    m = subparsers.add_parser("meta-io", help="build, inspect, split and stage Meta-IO datasets")
    msub = m.add_subparsers(dest="meta_io_command", metavar="ACTION")
    b = msub.add_parser("build", help="lay out training logs by task into fixed-shape Arrow IPC files")
    b.add_argument("--input", required=True, help="Parquet/CSV file or folder")
    b.add_argument("--schema", required=True, help="schema file (.json or .toml)")
    b.add_argument("--out", required=True, help="dataset folder to write")
    b.add_argument("--task-key", default="", help="grouping column (default: the schema's task_key)")
    b.add_argument("--support", type=int, default=8, help="support slots S per episode")
    b.add_argument("--query", type=int, default=4, help="query slots Q per episode")
    b.add_argument("--split", choices=["time", "random"], default="time",
                   help="how a task's rows divide into support and query: by time or at random")
    b.add_argument("--layout", choices=["meta", "plain"], default="meta",
                   help="meta: support/query episodes per task; plain: rows in input order")
    b.add_argument("--seed", type=int, default=0, help="seed of the random split and shuffles")
    b.add_argument("--rows-per-batch", type=int, default=768, help="slots (rows) per record batch")
    b.add_argument("--no-buckets", action="store_true", help="pad every episode to S+Q (no size buckets)")
    b.add_argument("--memory-budget-mb", type=float, default=512.0, help="memory for one pass-2 partition")
    b.add_argument("--partitions", type=int, default=0, help="spill partitions (0: from the budget)")
    b.add_argument("--max-file-mb", type=float, default=64.0, help="roll to a new part file after this size")
    b.add_argument("--overwrite", action="store_true", help="replace a dataset already in --out")
    b.add_argument("--no-progress", action="store_true",
                   help="no progress bar; a progress log line every 5 s and at the end of each pass")
    b.add_argument("--done-file", default="",
                   help="write this file (the build's totals, JSON) once the dataset is complete: a gate "
                        "tied to this build, unlike a manifest that may be yesterday's")
    b.set_defaults(func=_build)
    i = msub.add_parser("inspect", help="summarize a built dataset")
    i.add_argument("path", help="dataset folder")
    i.add_argument("--verify", action="store_true",
                   help="read every byte and check it against the build's checksums (exit 1 on any mismatch)")
    i.set_defaults(func=_inspect)
    h = msub.add_parser("split-holdout", help="split input into train and held-out rows: by task (users unseen in "
                                              "training) or by time (the future)")
    h.add_argument("--input", required=True, help="Parquet/CSV file or folder")
    h.add_argument("--schema", required=True, help="schema file")
    h.add_argument("--out", required=True, help="writes OUT/train, OUT/holdout and OUT/schema.json")
    h.add_argument("--by", choices=["task", "time"], default="task",
                   help="task: hold out whole tasks (cold-start users); time: hold out the latest rows, every "
                        "task (train on the past, score the future)")
    how = h.add_mutually_exclusive_group()
    how.add_argument("--fraction", type=float, default=None,
                     help="--by task: share of tasks held out, chosen by a seeded hash of the task key; --by time: "
                          "share of rows held out, the latest (default 0.1)")
    how.add_argument("--keys", default=None,
                     help="--by task: hold out exactly the task keys in this file, one per line (e.g. "
                          "OUT/holdout_keys.txt of an earlier split), to reproduce an external split")
    how.add_argument("--cut", type=int, default=None,
                     help="--by time: hold out exactly the rows with a timestamp >= CUT (e.g. the cut in "
                          "OUT/time_cut.json of an earlier split)")
    h.add_argument("--seed", type=int, default=0, help="seed of the --by task --fraction choice")
    h.set_defaults(func=_split_holdout)
    st = msub.add_parser("stage", help="copy a built dataset between a data source URI (s3://, gs://, hdfs://, "
                                       "file://) and a folder, the manifest last, verified")
    st.add_argument("--from", dest="src", required=True, help="dataset URI or folder to copy from")
    st.add_argument("--to", dest="dst", required=True,
                    help="URI or folder to copy to (a folder is staged aside, verified, then renamed into place)")
    st.add_argument("--metadata-only", action="store_true",
                    help="copy manifest.json and index.arrow only (what the controller reads)")
    st.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                    help="wait up to SECONDS for the source's manifest.json to appear (default: fail at once)")
    st.add_argument("--done-file", default="",
                    help="write this file (src, dst, files, bytes; JSON) once the stage succeeded")
    st.add_argument("--overwrite", action="store_true", help="replace a different dataset already at --to")
    st.set_defaults(func=_stage)
    m.set_defaults(func=lambda args: _missing_action(m))


def _missing_action(parser: argparse.ArgumentParser) -> int:
    parser.print_help()
    return 2


def split_holdout(input_path: str | Path, schema: str | Path, out: str | Path, fraction: float | None = None,
                  seed: int = 0, keys: str | Path | None = None, by: str = "task",
                  cut: int | None = None) -> "HoldoutSplit":
    """Split logs into train and held-out rows: what ``metaps meta-io split-holdout`` runs.

    Args:
        input_path: Parquet/CSV file or folder.
        schema: schema file (.json or .toml).
        out: writes ``out/train``, ``out/holdout``, ``out/schema.json`` and what reproduces the
            split (the held-out keys file, or ``time_cut.json``).
        fraction: share of tasks (``by="task"``) or of the latest rows (``by="time"``) held out
            (None: 0.1); not with ``keys`` or ``cut``.
        seed: seed of the task ``fraction`` choice.
        keys: ``by="task"``: hold out exactly the task keys in this file, one per line.
        by: ``task`` (whole tasks, cold-start users) or ``time`` (rows at or after a cut time).
        cut: ``by="time"``: hold out the rows with a timestamp >= ``cut``.

    Returns:
        the :class:`meta_io.holdout.HoldoutSplit`.

    Raises:
        ConfigError: an option that does not go with ``by`` (one line naming it).
    """
    from meta_io.holdout import read_task_keys, split_by_task, split_by_time
    from meta_io.schema import load_schema
    from common.errors import ConfigError

    if by not in ("task", "time"):
        raise ConfigError(f"split-holdout: --by must be 'task' or 'time', got {by!r}")
    if by == "time" and keys:
        raise ConfigError("split-holdout: --keys names tasks; a time split takes --fraction or --cut")
    if by == "task" and cut is not None:
        raise ConfigError("split-holdout: --cut is a time; give --by time with it")
    share = 0.1 if fraction is None else fraction
    if by == "time":
        return split_by_time(input_path, load_schema(schema), out, share, cut)
    key_ids = read_task_keys(keys) if keys else None
    return split_by_task(input_path, load_schema(schema), out, share, seed, keys=key_ids)


def _split_holdout(args: argparse.Namespace) -> int:
    with summary_replaces("meta_io", "holdout split", "time split"):
        res = split_holdout(args.input, args.schema, args.out, args.fraction, args.seed, args.keys, args.by, args.cut)
    timed = res.time_cut is not None
    out = {"by": args.by, "train_rows": res.train_rows, "train_dir": str(res.train_dir),
           "holdout_rows": res.holdout_rows, "holdout_tasks": res.holdout_tasks, "holdout_dir": str(res.holdout_dir),
           "schema": str(res.schema_path), ("time_cut_file" if timed else "keys_file"): str(res.record)}
    if timed:
        out["time_cut"] = res.time_cut
    emit(args, out,
         [f"train   {res.train_rows:,} rows -> {res.train_dir}" + (f" (timestamp < {res.time_cut})" if timed else ""),
          f"holdout {res.holdout_rows:,} rows ({res.holdout_tasks:,} tasks) -> {res.holdout_dir}"
          + (f" (timestamp >= {res.time_cut})" if timed else ""),
          f"schema  {res.schema_path}",
          f"{'cut' if timed else 'keys'}    {res.record}"])
    return 0


def generate_data(out: str | Path, rows: int, users: int, items: int, seed: int = 0,
                  files: int | None = None, where: str = "gen-data arguments", world: str = "default",
                  hidden: Mapping[str, float | None] | None = None) -> "GeneratedData":
    """Generate AntM2C-like logs: what ``metaps gen-data`` runs.

    Args:
        out: output folder (Parquet files + ``schema.json``).
        rows / users / items: sizes (users are the tasks of Meta-IO).
        seed: random seed (same seed, same data).
        files: Parquet files to write (None: the generator's default).
        where: how a bad value's error names these arguments.
        world: a named world of :data:`meta_io.synth.WORLDS` (``hidden``, ``taste``: effects only adaptation
            can learn).
        hidden: ``GeneratorConfig`` hidden-effect fields (``hidden_user_effect_std``, ...) set over the
            world's; None values are left as the world sets them.

    Returns:
        the generator's :class:`meta_io.synth.GeneratedData`.
    """
    from meta_io.synth import WORLDS, GeneratorConfig, generate

    if world not in WORLDS:
        raise ConfigError(f"{where}: --world must be one of {sorted(WORLDS)}, got {world!r}")
    fields: dict[str, Any] = dict(rows=rows, users=users, items=items, seed=seed, **WORLDS[world])
    if files is not None:
        fields["n_files"] = files
    fields.update({k: v for k, v in (hidden or {}).items() if v is not None})
    cfg = from_mapping(GeneratorConfig, fields, where=where)
    return generate(out, cfg)


def _gen_data(args: argparse.Namespace) -> int:
    with summary_replaces("meta_io", "generated"):
        data = generate_data(args.out, args.rows, args.users, args.items, args.seed, args.files, world=args.world,
                             hidden={"hidden_user_effect_std": args.hidden_user_effect_std,
                                     "hidden_user_cvr_effect_std": args.hidden_user_cvr_effect_std,
                                     "hidden_user_scene_effect_std": args.hidden_user_scene_effect_std})
    emit(args, {"rows": data.rows, "out_dir": str(data.out_dir), "files": [str(f) for f in data.files],
                "schema": str(data.schema_path), "rows_per_s": data.rows_per_s, "peak_rss_mb": data.peak_rss_mb,
                "oracle_auc": dict(data.oracle_auc)},
         [f"wrote {data.rows:,} rows to {data.out_dir}", *(f"  {f}" for f in data.files),
          f"schema      {data.schema_path}",
          f"speed       {data.rows_per_s:,.0f} rows/s, peak RSS {data.peak_rss_mb:.0f} MiB",
          "oracle AUC  " + "  ".join(f"{k}={v:.4f}" for k, v in data.oracle_auc.items())])
    return 0


def build_dataset(input_path: str | Path, schema: str | Path, out: str | Path, fields: Mapping[str, Any],
                  where: str = "meta-io build arguments", progress: "ProgressHook | None" = None) -> "BuildResult":
    """Build a Meta-IO dataset: what ``metaps meta-io build`` runs.

    Args:
        input_path: Parquet/CSV file or folder.
        schema: schema file (.json or .toml).
        out: dataset folder to write.
        fields: :class:`meta_io.build.MetaIOBuildConfig` fields (``support``, ``query``, ``overwrite``, ...);
            checked by name and type.
        where: how a bad field's error names these arguments.
        progress: told ``(stage, done, total)`` as the two passes go
            (:mod:`meta_io.build.pipeline`); None: nothing told.

    Returns:
        the :class:`meta_io.build.BuildResult` (folder and manifest).
    """
    from meta_io.build import MetaIOBuildConfig, build

    cfg = from_mapping(MetaIOBuildConfig, dict(fields), where=where)
    return build(input_path, schema, out, cfg, progress=progress)


def _build(args: argparse.Namespace) -> int:
    fields = dict(
        layout=args.layout, support=args.support, query=args.query, split=args.split, seed=args.seed,
        task_key=args.task_key, rows_per_batch=args.rows_per_batch, bucketing=not args.no_buckets,
        memory_budget_mb=args.memory_budget_mb, partitions=args.partitions, max_file_mb=args.max_file_mb,
        overwrite=args.overwrite,
    )
    from metaps.progress import command_progress

    with summary_replaces("meta_io", "build done"), command_progress(args.no_progress) as progress:
        result = build_dataset(args.input, args.schema, args.out, fields, progress=progress)
    t = result.manifest["totals"]
    lines = [f"built {result.out_dir}: {t['input_rows']:,} rows -> {t['batches']} batches in {t['files']} files "
             f"({t['build_seconds']:.2f} s, {t['rows_per_s']:,} rows/s)"]
    if result.manifest["layout"] == "meta":
        lines.append(f"  support {t['support_rows']:,}  query {t['query_rows']:,}  leftover {t['leftover_rows']:,}  "
                     f"tasks {t['tasks']:,}  episodes {t['episodes']:,}  fill {t['fill_ratio']:.3f} "
                     f"(without buckets {t['fill_ratio_without_buckets']:.3f})")
    if args.done_file:
        from common.atomic_write import write_json_atomic

        Path(args.done_file).parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(args.done_file, {"out": str(result.out_dir), "totals": t, "time": time.time()})
    emit(args, t, lines)  # --json: the manifest totals, one object
    return 0


def _inspect(args: argparse.Namespace) -> int:
    from meta_io.inspect import format_summary, inspect_dataset

    summary = inspect_dataset(args.path, verify=args.verify)
    if wants_json(args):
        print(json.dumps(summary, indent=2))  # one object (indented: read by people too)
    else:
        print(format_summary(summary))
    return 1 if summary["problems"] else 0


def _stage(args: argparse.Namespace) -> int:
    from meta_io.stage import stage_dataset

    with summary_replaces("meta_io", "stage done"):
        res = stage_dataset(args.src, args.dst, metadata_only=args.metadata_only, wait_s=args.wait,
                            overwrite=args.overwrite)
    out = {"src": res.src, "dst": res.dst, "files": res.files, "bytes": res.bytes, "seconds": res.seconds,
           "skipped": res.skipped}
    if args.done_file:
        from common.atomic_write import write_json_atomic

        Path(args.done_file).parent.mkdir(parents=True, exist_ok=True)
        write_json_atomic(args.done_file, {**out, "metadata_only": args.metadata_only, "time": time.time()})
    what = "already staged (same manifest, every file there), nothing copied" if res.skipped else \
        f"{res.files} files, {res.bytes:,} bytes in {res.seconds:.2f} s"
    emit(args, out, f"staged {res.src} -> {res.dst}: {what}")
    return 0
