"""``metaps deliver`` and ``metaps predict``.

Examples::

    metaps deliver --run runs/main --out bundles --incremental --keep 5 \\
        --holdout data/holdout.parquet --max-auc-drop 0.005          # one shot (cron)
    metaps deliver --run runs/main --out bundles --every 10m --no-gate   # periodic loop, ungated
    metaps predict --bundle bundles --data day2.parquet --out scores.parquet    # labels optional
    metaps predict --bundle bundles --support first.parquet --data day2.parquet --out scores.parquet \\
        --keep-columns user_id,click                                  # adapted per user, key + label kept

``deliver`` shows its stages on stderr (verify, export (rows), dense, gate, publish):
a bar each on a terminal, else (or with ``--no-progress``) log lines ``msg="progress"``
with done/total/pct/per_s/eta_s every 5 s and at each stage's end; stdout holds only
the result (one JSON object with ``--json``). The gate's steps are the consistency
check, the holdout AUC, one per adaptation candidate and the published bundle's AUC;
each candidate also logs a line as it is scored (``msg="adaptation candidate scored"``:
its name, mean AUC, AUC per head, ``done``, ``left``).

``deliver`` without ``--holdout`` refuses (exit 1) unless ``--no-gate`` is given; the
manifest's ``gate.gated`` records which it was.

Exit codes of ``deliver``: 0 published or nothing newer, 1 error (bad input, no gate),
3 refused by the validation gate (the reasons are printed).
"""

from __future__ import annotations

import argparse
import logging
import sys
import time
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from delivery.config import DeliveryConfig, RowDtype, parse_interval
from common import exit_codes
from common.log import kv
from metaps.roles.output import emit

log = logging.getLogger(__name__)

EXIT_REFUSED = exit_codes.REFUSED


def register(sub: argparse._SubParsersAction) -> None:
    d = sub.add_parser("deliver", help="export a checkpoint as a serving bundle and publish it atomically")
    src = d.add_mutually_exclusive_group(required=True)
    src.add_argument("--run", type=Path, help="run directory (its latest checkpoint is delivered)")
    src.add_argument("--checkpoint", type=Path, help="a checkpoint directory")
    d.add_argument("--out", type=Path, required=True, help="publish root (versions + LATEST)")
    d.add_argument("--incremental", action="store_true", help="publish a delta on LATEST when possible")
    d.add_argument("--keep", type=int, default=5, help="versions to keep (chains are never broken; default 5)")
    d.add_argument("--if-checkpoint", action="store_true",
                   help="with --run: exit 0 saying so when the run has no committed checkpoint yet "
                        "(a schedule that starts before the run's first checkpoint)")
    d.add_argument("--every", default="", help="run as a loop with this interval, e.g. 10m (needs --run)")
    d.add_argument("--holdout", default="", help="holdout data for the AUC gate (Parquet/CSV or Meta-IO dir)")
    d.add_argument("--holdout-rows", type=int, default=0, help="evaluate at most this many holdout rows (0 = all)")
    d.add_argument("--no-gate", action="store_true",
                   help="publish without a holdout AUC gate (consistency checks still run; the manifest records "
                        "gate.gated = false). Without --holdout, deliver refuses unless this is given")
    d.add_argument("--max-auc-drop", type=float, default=0.01, help="refuse if AUC drops more than this (default 0.01)")
    d.add_argument("--dtype", choices=[x.value for x in RowDtype], default="fp32", help="row storage (default fp32)")
    d.add_argument("--max-chain", type=int, default=8, help="deltas on one base before a full bundle (default 8)")
    d.add_argument("--force", action="store_true", help="deliver even if LATEST is from the same checkpoint")
    d.add_argument("--no-progress", action="store_true",
                   help="no progress bar; a progress log line every 5 s and at the end of each stage")
    d.add_argument("--threads", type=int, default=1,
                   help="torch intra-op threads (default 1: the gate's many small tensor ops lose more to thread "
                        "hand-offs than they gain, up to 7x its time on a loaded 2-core box; results are the same)")
    d.add_argument("--max-ticks", type=int, default=None, help=argparse.SUPPRESS)
    d.set_defaults(func=_deliver)

    p = sub.add_parser("predict", help="score a Parquet/CSV file with a published bundle (labels optional)")
    p.add_argument("--bundle", type=Path, required=True, help="a publish root (LATEST) or a bundle directory")
    p.add_argument("--data", type=Path, required=True, help="Parquet/CSV file or folder, read with the bundle's schema")
    p.add_argument("--out", type=Path, required=True,
                   help="output Parquet file of scores (written aside, renamed at the end: a failure leaves none)")
    p.add_argument("--batch-rows", type=int, default=4096, help="rows per prediction batch (default 4096)")
    p.add_argument("--support", type=Path, default=None,
                   help="labeled rows (Parquet/CSV) to adapt on per task key before scoring (default: none, "
                        "base model only); tasks without support rows are scored by the base model")
    p.add_argument("--keep-columns", default="",
                   help="comma-separated input columns copied verbatim into the output, e.g. user_id,click (default none)")
    p.add_argument("--warn-unknown", type=float, default=0.5,
                   help="warn when more than this share of looked-up ids is unknown to the bundle (default 0.5)")
    p.add_argument("--no-progress", action="store_true",
                   help="no progress bar; a progress log line every 5 s and at the end (as off a terminal)")
    p.set_defaults(func=_predict)


def delivery_config(fields: Mapping[str, Any], no_gate: bool = False, where: str = "metaps deliver") -> DeliveryConfig:
    """The checked :class:`DeliveryConfig` of one ``metaps deliver``: fields by name, and the gate rule.

    Args:
        fields: ``DeliveryConfig`` fields (``out``, ``holdout``, ``incremental``, ``keep``, ...).
        no_gate: publish without a holdout AUC gate (recorded in the manifest as ``gate.gated = false``).
        where: how a bad field's error names these arguments.

    Raises:
        ConfigError: a bad field; DeliveryError: no holdout and no ``no_gate``.
    """
    from delivery.bundle import DeliveryError
    from common.config import from_mapping

    cfg = from_mapping(DeliveryConfig, dict(fields), where=where)
    if not cfg.holdout and not no_gate:
        raise DeliveryError(
            "no --holdout given: bundles are published only after the holdout AUC gate; "
            "pass --holdout DATA, or --no-gate to publish ungated (recorded in the manifest as gate.gated = false)"
        )
    return cfg


def set_threads(threads: int, where: str) -> None:
    """``torch.set_num_threads(threads)`` for a command's ``--threads``.

    Raises:
        ConfigError: ``threads < 1``.
    """
    from common.errors import ConfigError

    if threads < 1:
        raise ConfigError(f"{where}: --threads must be >= 1, got {threads}")
    import torch

    torch.set_num_threads(threads)


def _deliver(args: argparse.Namespace) -> int:
    from delivery.job import PeriodicDelivery, Status, deliver_once
    from metaps.progress import command_progress

    set_threads(args.threads, "metaps deliver")
    cfg = delivery_config(
        {"out": str(args.out), "incremental": args.incremental, "keep": args.keep, "dtype": args.dtype,
         "max_chain": args.max_chain, "holdout": args.holdout, "max_auc_drop": args.max_auc_drop,
         "holdout_rows": args.holdout_rows, "every": args.every},
        no_gate=args.no_gate,
    )
    if cfg.every:
        if args.run is None:
            print("metaps deliver: error: --every needs --run (a run directory to watch)", file=sys.stderr)
            return 2
        with command_progress(args.no_progress) as progress:
            loop = PeriodicDelivery(cfg, args.run, progress=progress)
            done = [o for o in loop.run(parse_interval(cfg.every), max_ticks=args.max_ticks) if o is not None]
        emit(args, {"outcomes": [_outcome_dict(o) for o in done]}, [_outcome_line(o) for o in done] or ["no ticks"])
        return 0
    if args.if_checkpoint and args.run is not None and not has_checkpoint(args.run):
        emit(args, {"status": "no_checkpoint", "version": "", "kind": "", "checkpoint": "", "run": str(args.run)},
             f"{args.run} has no committed checkpoint yet; nothing to deliver")
        return 0
    with command_progress(args.no_progress) as progress:
        o = deliver_once(cfg, run=args.run, checkpoint=args.checkpoint, force=args.force, progress=progress)
    emit(args, _outcome_dict(o), _outcome_line(o))
    if o.status is Status.REFUSED:
        print(f"metaps deliver: refused by the validation gate: {o.reason}", file=sys.stderr)
        return EXIT_REFUSED
    return 0


def _outcome_dict(o: Any) -> dict[str, Any]:
    """One delivery's result as plain data (``--json``)."""
    return {"status": o.status.value, "version": o.version, "kind": o.kind, "checkpoint": str(o.checkpoint),
            "auc": o.gate.auc if o.gate else {}, "adapt": o.gate.adapt if o.gate else {}, "reason": o.reason}


def _auc_text(auc: Mapping[str, Any]) -> str:
    flat = {k: v for k, v in auc.items() if isinstance(v, (int, float))}
    return ", ".join(f"{k} {v:.4f}" for k, v in sorted(flat.items()))


def _outcome_line(o: Any) -> str:
    """One delivery's result for a person."""
    ckpt = Path(str(o.checkpoint)).name
    if o.status.value == "published":
        auc = _auc_text(o.gate.auc) if o.gate else ""
        line = f"published {o.version} ({o.kind}) from {ckpt}" + (f"; holdout AUC {auc}" if auc else "")
        summary = getattr(o.gate, "adapt_summary", "") if o.gate else ""
        return line + (f"; {summary}" if summary else "")
    if o.status.value == "up_to_date":
        return f"up to date: {ckpt} is already published"
    return f"{o.status.value}: {o.version or '-'} from {ckpt}" + (f" ({o.reason})" if o.reason else "")


def _row_count(data: Path) -> int | None:
    """Rows of the Parquet file(s) at ``data`` from their footers (None for CSV or unreadable: no percent)."""
    import pyarrow.parquet as pq

    files = sorted(data.rglob("*.parquet")) if data.is_dir() else [data]
    if not files or any(f.suffix != ".parquet" for f in files):
        return None
    try:
        return sum(pq.ParquetFile(f).metadata.num_rows for f in files)
    except (OSError, ValueError):
        return None  # predict itself says what is wrong with the file


def has_checkpoint(run: Path) -> bool:
    """Whether the run directory ``run`` holds a committed checkpoint (``--if-checkpoint``)."""
    from ps.checkpoint import latest_checkpoint

    root = Path(run) / "checkpoints"
    return root.is_dir() and latest_checkpoint(root) is not None


def _predict(args: argparse.Namespace) -> int:
    from rich.console import Console

    from delivery.predict import predict_to_parquet
    from metaps.progress import TaskProgress

    keep = [c.strip() for c in args.keep_columns.split(",") if c.strip()]
    bar_on_terminal = sys.stderr.isatty() and not args.no_progress
    t0 = time.monotonic()
    # a bar on a terminal; else (or --no-progress) msg="progress" log lines, as launch, build and deliver
    with TaskProgress("rows scored", _row_count(Path(args.data)),
                      console=Console(stderr=True) if bar_on_terminal else None, log_every_s=5.0) as bar:
        res = predict_to_parquet(args.bundle, args.data, args.out, args.batch_rows, support=args.support,
                                 keep_columns=keep, warn_unknown=args.warn_unknown, progress=bar.update)
        if not bar.drawn and bar.logged != (bar.last.done if bar.last else None):
            bar.log_line()  # the end, also of a run shorter than one log period
    log.info("predicted", extra=kv(rows=res.rows, seconds=round(time.monotonic() - t0, 1), out=str(res.out)))
    if res.warn_unknown:
        print(f"metaps predict: warning: {res.unknown_share:.0%} of looked-up ids ({res.unknown_ids:,} of "
              f"{res.looked_up_ids:,}) are unknown to bundle {res.bundle} (threshold {args.warn_unknown:.0%}); "
              f"is this data from the model's domain?", file=sys.stderr)
    data: dict[str, Any] = {"bundle": res.bundle, "rows": res.rows, "out": str(res.out),
                             "unknown_ids": res.unknown_ids, "unknown_share": round(res.unknown_share, 6),
                             "adapted": res.adapted, "recipe": res.recipe, "recipe_from": res.recipe_from}
    how = f" (adapted on --support: {res.recipe}, {res.recipe_from})" if res.adapted else ""
    human = f"scored {res.rows:,} rows with bundle {res.bundle}{how} -> {res.out}"
    if res.labels:  # evaluation only when the data has labels
        data["eval"] = {"auc": res.auc, "labels": res.labels}
        human += f"; AUC {_auc_text(res.auc)}"
    emit(args, data, human)
    return 0
