"""Every bench runs: the smoke runs that start fleets of processes (see tests/bench/test_bench_smoke.py).

A module of their own, so ``make test``'s xdist workers (a module to a worker) run
them beside the other smoke runs instead of after them.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.bench.test_bench_smoke import FLEETS, check_smoke, smoke_params


@pytest.mark.parametrize("name", smoke_params(FLEETS))
def test_fleet_bench_smoke_run_prints_its_figures(name: str, tmp_path: Path) -> None:
    check_smoke(name, tmp_path)
