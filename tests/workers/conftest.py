"""Fixtures for worker tests: tiny generated data built into Meta-IO, job configs, PS fleets."""

from __future__ import annotations

from pathlib import Path
from typing import Any, Iterator

import pytest

from meta_io.build import MetaIOBuildConfig, build
from meta_io.layout import Layout
from meta_io.synth import GeneratorConfig, generate
from metaps.job import JobConfig, job_from_mapping
from ps.factory import build_server

from tests.workers.procs import TOKEN  # noqa: E402 -- one token for in-process PS and worker processes


@pytest.fixture(scope="session")
def worker_data(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """3k generated rows, built as a meta layout, a plain layout and a held-out meta set."""
    root = tmp_path_factory.mktemp("worker-data")
    gen = generate(root / "raw", GeneratorConfig(rows=3000, users=300, items=200, seed=3, n_files=2,
                                                 row_group_rows=1000), progress=False)
    meta = build(gen.out_dir, gen.schema_path, root / "meta",
                 MetaIOBuildConfig(support=4, query=4, rows_per_batch=64)).out_dir
    plain = build(gen.out_dir, gen.schema_path, root / "plain",
                  MetaIOBuildConfig(layout=Layout.PLAIN, rows_per_batch=128)).out_dir
    return {"meta": meta, "plain": plain, "raw": gen.out_dir, "schema": gen.schema_path}


def make_job(train_path: Path, tmp: Path, *, mode: str = "meta", shards: int = 1, workers: int = 1,
             eval_path: Path | None = None, **sections: dict[str, Any]) -> JobConfig:
    """A small job: 8-dim tables, a tiny DNN, synchronous PS semantics, no overlap."""
    data: dict[str, Any] = {
        "data": {"train": str(train_path), "eval": str(eval_path or "")},
        "ps": {"shards": shards, "num_vshards": 16, "device": "cpu",
               "table_defaults": {"dim": 8, "capacity": 4096}},
        "model": {"kind": "dnn", "default_dim": 8, "hidden": [16, 8]},
        "meta": {"inner_steps": 1, "inner_lr": 0.1},
        "train": {"mode": mode, "workers": workers, "overlap": False, "log_every": 5},
        "rpc": {"token": TOKEN, "timeout_s": 20.0},
        "delivery": {"out": str(tmp / "bundles")},
        "run": {"dir": str(tmp / "run")},
    }
    for name, values in sections.items():
        data.setdefault(name, {}).update(values)
    return job_from_mapping(data, where="<test job>")


@pytest.fixture
def ps_servers() -> Iterator[Any]:
    """start(job) -> list of addresses of in-process PS shards for that job."""
    servers = []

    def start(job: JobConfig) -> list[str]:
        addrs = []
        for k in range(job.ps.shards):
            s = build_server(job.ps, job.rpc, job.table_configs(), k, wait_timeout_s=10.0)
            servers.append(s)
            addrs.append(f"127.0.0.1:{s.start('127.0.0.1:0')}")
        return addrs

    yield start
    for s in servers:
        s.stop(0)
