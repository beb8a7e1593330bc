"""Suite-wide ordering: the heaviest test modules start first (xdist load balance).

``make test`` runs ``-n 2 --dist loadscope``: each module goes whole to one worker, in
the order of the collection. (Three workers on the two cores were faster, 570 s against 635 s on
2026-12-02, as a third fills the fleet tests' waits, but the extra load made the two-worker launch
of tests/metaps/test_launch.py start a worker too late to get a shard: back to two.) xdist's default (``--loadscope-reorder``) sorts modules by
their number of tests, which sends the heaviest modules (one or two long real-fleet or
subprocess-chain tests each: the README chain, mypy, the all-reduce fleets) to the very
end, where one worker runs them alone while the other sits idle: a tail of minutes.
Longest-first is the classic fix: :data:`HEAVY_FIRST` lists the modules measured slowest
(``--durations``, 2 Dec 2026; about 30 s and more of wall each on a loaded 2-core box), in
that order, and every other module keeps its collection order after them. The list only
orders work: a module missing from it (or a stale entry) still runs, only later.
"""

from __future__ import annotations

import json
import os
import resource
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

SINGLE_THREAD = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
"""One math thread per process, for this process and every process a test starts (unless the
caller set them). ``make test`` runs two xdist workers on two cores, each starting fleets of
processes: a box far more oversubscribed than any deployment. There, OpenMP's second thread
spin-waits for a descheduled first one and burns CPU doing nothing: ``metaps deliver`` with its
gate took 25 CPU-s at the default 2 threads and 8.5 at 1, the README chain 185 against 137
(2 Dec 2026, load ~8). Fleet workers and PS shards already run one thread (``[train] threads``,
the PS role); this covers the CLIs, the benches' smoke runs and the in-process tests."""
for _name in SINGLE_THREAD:
    os.environ.setdefault(_name, "1")

HEAVY_FIRST = (
    "tests/test_readme.py",
    "tests/bench/test_bench_smoke_fleets.py",
    "tests/deploy/test_k8s_pods.py",
    "tests/bench/test_chaos_judge.py",
    "tests/deploy/test_k8s_pods_per_role.py",
    "tests/bench/test_bench_smoke.py",
    "tests/metaps/test_launch.py",
    "tests/metaps/test_launch_continue.py",
    "tests/metaps/test_launch_allreduce_rank_kill.py",
    "tests/metaps/test_launch_checkpoint_disk_full.py",
    "tests/metaps/test_security.py",
    "tests/test_types.py",
    "tests/workers/test_dd_allreduce.py",
    "tests/workers/test_learning.py",
    "tests/workers/test_ps_restart.py",
    "tests/workers/test_allreduce.py",
    "tests/deploy/test_k8s_pods_allreduce.py",
    "tests/workers/test_release_slow_clock.py",
    "tests/workers/test_eval_protocols.py",
    "tests/metaps/test_launch_max_steps.py",
    "tests/workers/test_dd_slicer.py",
    "tests/metaps/test_launch_recovery_failure.py",
    "tests/metaps/test_launch_agents.py",
    "tests/metaps/test_security_handstart.py",
    "tests/scripts/test_multi_host.py",
    "tests/metaps/test_coverage_honest.py",
    "tests/controller/test_ps_recovery.py",
    "tests/controller/test_ps_recovery_inprocess.py",
    "tests/workers/test_tail_split.py",
    "tests/metaps/test_api.py",
    "tests/metaps/test_launch_startup_stop.py",
    "tests/metaps/test_tls.py",
    "tests/delivery/test_disk_full.py",
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


LOG_SUFFIXES = (".log", ".out", ".err")
"""Files under a failed test's ``tmp_path`` whose tails the report shows (process output)."""
MAX_LOGS = 12
MAX_CHARS = 4000


def _log_tails(root: Path) -> Iterator[tuple[str, str]]:
    """(relative path, last :data:`MAX_CHARS` characters) of the newest :data:`MAX_LOGS` log files under ``root``."""
    try:
        found = [p for p in root.rglob("*") if p.suffix in LOG_SUFFIXES and p.is_file()]
    except OSError:
        return
    found.sort(key=lambda p: p.stat().st_mtime if p.exists() else 0.0, reverse=True)
    for p in found[:MAX_LOGS]:
        try:
            text = p.read_text(errors="replace")
        except OSError:
            continue
        yield str(p.relative_to(root)), text[-MAX_CHARS:]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    """A failed test that started processes shows their output: the tails of the log files
    under its ``tmp_path`` (launcher output, every fleet process's log) go into the report."""
    outcome = yield
    rep = outcome.get_result()  # type: ignore[attr-defined]
    tmp = getattr(item, "funcargs", {}).get("tmp_path")
    if not rep.failed or not isinstance(tmp, Path):
        return
    for name, tail in _log_tails(tmp):
        rep.sections.append((f"process output: {name} (last {MAX_CHARS} chars)", tail))


CPU_LOG = os.environ.get("METAPS_TEST_CPU_LOG", "")
"""Where the suite's CPU goes: with ``METAPS_TEST_CPU_LOG=FILE`` every test appends one JSON line
(nodeid, wall s, CPU s of the pytest process and of its reaped child processes; a module's fixtures
count in its first test). ``python -m tests.cpu_report FILE`` sums them per module (docs/testing.md)."""


def _cpu() -> tuple[float, float]:
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    return me.ru_utime + me.ru_stime, kids.ru_utime + kids.ru_stime


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None) -> Iterator[None]:
    if not CPU_LOG:
        yield
        return
    t0, (s0, c0) = time.monotonic(), _cpu()
    yield
    t1, (s1, c1) = time.monotonic(), _cpu()
    line = json.dumps({"nodeid": item.nodeid, "wall": round(t1 - t0, 3), "self": round(s1 - s0, 3),
                       "children": round(c1 - c0, 3)})
    with open(CPU_LOG, "a") as f:  # one short line per write: O_APPEND keeps the xdist workers' lines whole
        f.write(line + "\n")
