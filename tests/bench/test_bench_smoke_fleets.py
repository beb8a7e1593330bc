"""Every bench runs: the smoke runs that start fleets of processes (see tests/bench/test_bench_smoke.py).

A module of their own, so ``make test``'s xdist workers (a module to a worker) run
them beside the other smoke runs instead of after them. The four run at once (a module
fixture): most of a fleet smoke's wall is waiting (process start-up, heartbeats, a
recovery, a Job's failure), 200 s of wall for 86 CPU-s when they ran one after another.
"""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

from tests.bench.test_bench_smoke import FLEETS, SMOKES, judge_smoke, run_bench

# the fixture runs every smoke: the first test's limit covers the longest one
LIMIT_S = max(SMOKES[n].timeout_s for n in FLEETS) + 60


@pytest.fixture(scope="module")
def smoke_runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, tuple[int | None, str, str]]:
    """name -> (exit code or None on timeout, stdout, stderr) of each fleet bench's smoke run."""
    names = sorted(FLEETS)
    tmps = [tmp_path_factory.mktemp(f"smoke-{n}") for n in names]
    with ThreadPoolExecutor(len(names)) as pool:
        return dict(zip(names, pool.map(lambda nt: run_bench(nt[0], SMOKES[nt[0]], nt[1]), zip(names, tmps))))


@pytest.mark.timeout(LIMIT_S)
@pytest.mark.parametrize("name", sorted(FLEETS))
def test_fleet_bench_smoke_run_prints_its_figures(name: str, smoke_runs: dict[str, tuple[int | None, str, str]],
                                                 tmp_path: Path) -> None:
    judge_smoke(name, *smoke_runs[name])
