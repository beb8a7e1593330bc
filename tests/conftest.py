"""Suite-wide ordering: the heaviest test modules start first (xdist load balance).

``make test`` runs ``-n 2 --dist loadscope``: each module goes whole to one worker, in
the order of the collection. xdist's default (``--loadscope-reorder``) sorts modules by
their number of tests, which sends the heaviest modules (one or two long real-fleet or
subprocess-chain tests each: the README chain, mypy, the all-reduce fleets) to the very
end, where one worker runs them alone while the other sits idle: a tail of minutes.
Longest-first is the classic fix: :data:`HEAVY_FIRST` lists the modules measured slowest
(``--durations``, Dec 2026; about 30 s and more of wall each on a loaded 2-core box), in
that order, and every other module keeps its collection order after them. The list only
orders work: a module missing from it (or a stale entry) still runs, only later.
"""

from __future__ import annotations

import pytest

HEAVY_FIRST = (
    "tests/test_readme.py",
    "tests/bench/test_bench_smoke_fleets.py",
    "tests/deploy/test_k8s_pods.py",
    "tests/bench/test_bench_smoke.py",
    "tests/metaps/test_launch.py",
    "tests/metaps/test_launch_continue.py",
    "tests/metaps/test_security.py",
    "tests/test_types.py",
    "tests/workers/test_dd_allreduce.py",
    "tests/workers/test_learning.py",
    "tests/workers/test_ps_restart.py",
    "tests/workers/test_allreduce.py",
    "tests/workers/test_release_slow_clock.py",
    "tests/workers/test_eval_protocols.py",
    "tests/metaps/test_launch_max_steps.py",
    "tests/workers/test_dd_slicer.py",
    "tests/metaps/test_launch_recovery_failure.py",
    "tests/metaps/test_launch_agents.py",
    "tests/scripts/test_multi_host.py",
    "tests/metaps/test_coverage_honest.py",
    "tests/controller/test_ps_recovery.py",
    "tests/workers/test_tail_split.py",
    "tests/workers/test_parity.py",
    "tests/workers/test_parity_multi.py",
    "tests/workers/test_overlap.py",
    "tests/ps/test_checkpoint_service.py",
    "tests/workers/test_hygiene.py",
)
"""Test modules, slowest first (paths relative to the repository root)."""


def pytest_configure(config: pytest.Config) -> None:
    # keep the collection order below (xdist would re-sort modules by their number of tests)
    if hasattr(config.option, "loadscopereorder"):
        config.option.loadscopereorder = False


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Stable sort: modules of :data:`HEAVY_FIRST` first, in its order; each module's tests stay together, in order."""
    rank = {path: i for i, path in enumerate(HEAVY_FIRST)}
    last = len(HEAVY_FIRST)
    items.sort(key=lambda item: rank.get(item.nodeid.split("::", 1)[0], last))
