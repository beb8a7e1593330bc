"""What ``bench.quality`` and the benches built on its setup share: the tuned job and the cold-start data.

A module of its own so that ``bench.quality`` (which runs ``bench.deepfm_parity`` as a
subcommand) and the benches that reuse its setup (``deepfm_parity``, ``fleet_quality``,
``quality_ceiling``, ``quality_curve``) import it without an import circle.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any


def job_for(train: Path, eval_: Path, run_dir: Path, mode: str, kind: str, epochs: int,
            meta: dict[str, Any] | None = None, sets: dict[str, dict[str, Any]] | None = None) -> Any:
    """The setup tuned in tests/workers/test_learning.py (documented in docs/BENCHMARKS.md).

    Args:
        train / eval_: the Meta-IO datasets.
        run_dir: the run's directory.
        mode: ``[train] mode`` (plain or meta).
        kind: ``[model] kind``.
        epochs: ``[train] epochs``.
        meta: the ``[meta]`` table (None: none).
        sets: section -> key -> value set over the tuned ``[model]``, ``[ps]`` and ``[train]`` tables
            (``bench.quality_curve --set``; e.g. ``{"model": {"dropout": 0.1}}``); validated by the job loader.
    """
    from metaps.job import job_from_mapping

    data: dict[str, Any] = {
        "data": {"train": str(train), "eval": str(eval_)},
        "ps": {"shards": 1, "num_vshards": 64, "device": "cpu",
               "table_defaults": {"dim": 8, "capacity": 400_000,
                                  "optimizer": {"kind": "rowwise_adagrad", "lr": 0.1}},
               "dense_optimizer": {"kind": "adam", "lr": 0.005}},
        "model": {"kind": kind, "default_dim": 8, "hidden": [64, 32]},
        "train": {"mode": mode, "workers": 1, "epochs": epochs, "overlap": False, "log_every": 200},
        "delivery": {"out": str(run_dir / "bundles")},
        "run": {"dir": str(run_dir)},
    }
    if meta:
        data["meta"] = meta
    _merge(data, sets or {})
    return job_from_mapping(data, where="<bench.quality>")


def _merge(into: dict[str, Any], over: dict[str, Any]) -> None:
    """Set ``over``'s keys in ``into``, recursing into tables both have (a nested ``--set`` keeps its siblings)."""
    for key, value in over.items():
        if isinstance(value, dict) and isinstance(into.get(key), dict):
            _merge(into[key], value)
        else:
            into[key] = value


def cold_sizes(quick: bool, rows: int = 0) -> tuple[int, int, int, float]:
    """``--cold-only``'s data: (rows, users, items, held-out user fraction).

    Args:
        quick: ``--quick`` (16k rows, 250 users, 25% held out) instead of 1M rows (10% held out).
        rows: ``--rows`` (0: the default of the mode).
    """
    rows = rows or (16_000 if quick else 1_000_000)
    return rows, max(250, rows // 64), max(200, rows // 80), 0.25 if quick else 0.1


def cold_generator_config(rows: int, users: int, items: int, seed: int) -> Any:
    """The ``GeneratorConfig`` of one ``--cold-only`` seed (the generator is deterministic in it).

    Args:
        rows / users / items: from :func:`cold_sizes`.
        seed: the study's seed (also the generator's).
    """
    from meta_io.synth import GeneratorConfig

    return GeneratorConfig(rows=rows, users=users, items=items, seed=seed, n_files=max(1, rows // 250_000),
                           row_group_rows=min(rows, 65_536))


def cold_split(gen: Any, tmp: Path, seed: int, fraction: float) -> Any:
    """The held-out users of one ``--cold-only`` seed: ``split_by_task`` of the generated data into ``tmp/usplit``.

    Args:
        gen: the ``GeneratedData`` of :func:`cold_generator_config`.
        tmp: the seed's scratch folder.
        seed: the study's seed (also the split's).
        fraction: held-out share of users (:func:`cold_sizes`).
    """
    from meta_io.holdout import split_by_task
    from meta_io.schema import load_schema

    return split_by_task(gen.out_dir, load_schema(gen.schema_path), tmp / "usplit", fraction=fraction, seed=seed)
