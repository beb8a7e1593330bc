"""Fault injection for tests, benchmarks and demos: stragglers, slow PS, kills.

Mounted at ``[faults]`` of the job TOML::

    [[faults.faults]]
    target = "worker"      # worker | ps
    index = 3
    kind = "slow"          # slow: the worker's own compute x factor
    factor = 4.0
    basis = "compute"      # or "step": its whole step but waits for slower workers, x factor
    start_s = 10.0         # seconds after the job start
    duration_s = 0.0       # 0 = until the end

    [[faults.faults]]
    target = "ps"
    index = 1
    kind = "latency"       # latency: added seconds per request
    latency_s = 0.02

    [[faults.faults]]
    target = "worker"
    index = 0
    kind = "kill"          # kill: the process exits at at_s
    at_s = 30.0

Workers and PS build a :class:`FaultInjector` for themselves and ask it::

    inj = FaultInjector(job.faults, "worker", rank, t0=job_start)
    time.sleep(inj.step_delay(compute_s, own_step_s))  # a slowed worker: its own work x (factor - 1)
    time.sleep(inj.added_latency())           # in a PS request handler
    if inj.kill_due(): os._exit(137)          # an injected crash
"""

from __future__ import annotations

import enum
import os
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

from common.errors import MetapsError


class FaultTarget(str, enum.Enum):
    WORKER = "worker"
    PS = "ps"


class SlowBasis(str, enum.Enum):
    """What a ``slow`` fault multiplies (see :meth:`FaultInjector.step_delay`)."""

    COMPUTE = "compute"  # the forward/backward on the batch: a slower processor, PS time unscaled
    STEP = "step"        # the whole step as the worker lived it (its pulls/pushes included) except
                         # its waits for slower workers: everything it does takes factor x as long


class FaultKind(str, enum.Enum):
    SLOW = "slow"        # multiply the worker's own work by `factor` (see FaultInjector.step_delay)
    LATENCY = "latency"  # add `latency_s` to every request
    KILL = "kill"        # die at `at_s`


@dataclass(frozen=True)
class Fault:
    """One injected fault. See the module docstring for the TOML form.

    Args:
        target: ``worker`` or ``ps``.
        index: the worker rank or PS shard.
        kind: ``slow`` | ``latency`` | ``kill``.
        factor: slow: step time multiplier (> 1).
        basis: slow: what ``factor`` multiplies, ``compute`` (default) or ``step`` (:class:`SlowBasis`).
        latency_s: latency: seconds added per request (> 0).
        start_s: slow/latency: seconds after t0 when it begins.
        duration_s: slow/latency: how long it lasts; 0 = persistent.
        at_s: kill: seconds after t0 when the process dies.
    """

    target: FaultTarget
    index: int
    kind: FaultKind
    factor: float = 1.0
    basis: SlowBasis = SlowBasis.COMPUTE
    latency_s: float = 0.0
    start_s: float = 0.0
    duration_s: float = 0.0
    at_s: float = 0.0

    def __post_init__(self) -> None:
        object.__setattr__(self, "target", FaultTarget(self.target))
        object.__setattr__(self, "kind", FaultKind(self.kind))
        object.__setattr__(self, "basis", SlowBasis(self.basis))

    def validate(self) -> None:
        where = f"{self.kind.value} fault on {self.target.value} {self.index}"
        if self.index < 0:
            raise ValueError(f"{where}: index must be >= 0")
        if self.kind is FaultKind.SLOW and not self.factor > 1.0:
            raise ValueError(f"{where}: factor must be > 1, got {self.factor}")
        if self.kind is FaultKind.LATENCY and not self.latency_s > 0:
            raise ValueError(f"{where}: latency_s must be > 0, got {self.latency_s}")
        if self.start_s < 0 or self.duration_s < 0 or self.at_s < 0:
            raise ValueError(f"{where}: start_s, duration_s and at_s must be >= 0, "
                             f"got {self.start_s}, {self.duration_s}, {self.at_s}")

    def active(self, elapsed: float) -> bool:
        """Whether a slow/latency fault applies ``elapsed`` seconds after t0."""
        if elapsed < self.start_s:
            return False
        return self.duration_s == 0 or elapsed < self.start_s + self.duration_s


@dataclass(frozen=True)
class FaultConfig:
    """``[faults]``: the list of injected faults (empty = none).

    Example::

        FaultConfig(faults=[Fault("worker", 1, "slow", factor=4.0)])
    """

    faults: list[Fault] = field(default_factory=list)

    def validate(self) -> None:
        for i, f in enumerate(self.faults):
            try:
                f.validate()
            except ValueError as exc:
                raise ValueError(f"faults[{i}]: {exc}") from None

    def for_node(self, role: str, index: int) -> list[Fault]:
        return [f for f in self.faults if f.target.value == role and f.index == index]


class FaultInjector:
    """The faults that apply to one process, evaluated against time since ``t0``.

    Args:
        cfg: the job's ``[faults]``.
        role: ``worker`` or ``ps``.
        index: this process's rank / shard.
        t0: job start (same clock as ``clock``); default: now.
        clock: ``time.time`` by default, so processes of one job share t0.
    """

    def __init__(self, cfg: FaultConfig, role: str, index: int, t0: float | None = None,
                 clock: Callable[[], float] = time.time) -> None:
        FaultTarget(role)
        cfg.validate()
        self._faults = cfg.for_node(role, index)
        self._clock = clock
        self.t0 = clock() if t0 is None else t0

    def _elapsed(self, now: float | None) -> float:
        return (self._clock() if now is None else now) - self.t0

    @property
    def empty(self) -> bool:
        return not self._faults

    def slowdown(self, now: float | None = None) -> float:
        """Current step-time multiplier (1.0 = normal; active factors multiply)."""
        e = self._elapsed(now)
        m = 1.0
        for f in self._faults:
            if f.kind is FaultKind.SLOW and f.active(e):
                m *= f.factor
        return m

    def step_delay(self, compute_s: float, own_step_s: float | None = None, now: float | None = None) -> float:
        """Extra seconds a slowed worker sleeps after a step.

        ``factor`` x slower means ``factor`` x as long for the same batch. With ``basis =
        "compute"`` (the default) that is the worker's forward/backward on the batch: time
        spent on the PS or waiting for peers does not depend on this worker's speed, and
        scaling it would make the injected slowdown grow with the other workers' load. With
        ``basis = "step"`` it is the whole step as the worker lived it (its pulls and pushes
        included) except its waits for slower workers: a worker that is factor x slower at
        everything it does, e.g. on a box where the forward/backward is a small part of a
        step (the E1 bench). Factors of the same basis multiply. A worker does not apply it
        to its incarnation's first step (its warm-up, not its speed; workers/worker.py, workers/dd.py).

        Args:
            compute_s: this step's forward/backward seconds (negative counts as 0).
            own_step_s: this step's seconds less its waits for slower workers (None: a loop
                that does not measure it; a ``step`` fault then scales ``compute_s``).
            now: the current time (default: the clock).
        """
        e = self._elapsed(now)
        by_basis = {SlowBasis.COMPUTE: 1.0, SlowBasis.STEP: 1.0}
        for f in self._faults:
            if f.kind is FaultKind.SLOW and f.active(e):
                by_basis[f.basis] *= f.factor
        step = compute_s if own_step_s is None else own_step_s
        return (max(0.0, compute_s) * (by_basis[SlowBasis.COMPUTE] - 1.0)
                + max(0.0, step) * (by_basis[SlowBasis.STEP] - 1.0))

    def added_latency(self, now: float | None = None) -> float:
        """Seconds a PS adds to the request it is serving now."""
        e = self._elapsed(now)
        return sum(f.latency_s for f in self._faults if f.kind is FaultKind.LATENCY and f.active(e))

    def kill_due(self, now: float | None = None, born: float | None = None) -> bool:
        """True once a kill fault's ``at_s`` has passed.

        Args:
            now: the current time (default: the clock).
            born: when this process started (same clock). A kill fires only in a
                process that was alive at ``at_s``, so the replacement its agent
                starts afterwards is not killed again.
        """
        e = self._elapsed(now)
        b = None if born is None else born - self.t0
        return any(f.kind is FaultKind.KILL and e >= f.at_s and (b is None or b < f.at_s) for f in self._faults)


def ps_added_latency(cfg: FaultConfig, shard: int, t0: float | None = None) -> Callable[[], float] | None:
    """The per-request delay hook of PS ``shard`` (``ps.servicer`` sleeps its value), or None.

    ``t0`` defaults to ``$METAPS_T0`` (the launcher's job start, shared by every
    process of a job) or now, so ``start_s`` / ``duration_s`` mean the same on
    every node. None when no latency fault targets this shard (no per-request cost).

    Example::

        hook = ps_added_latency(job.faults, shard=1)
        build_server(..., added_latency_s=hook)
    """
    if not any(f.kind is FaultKind.LATENCY for f in cfg.for_node("ps", shard)):
        return None
    if t0 is None and os.environ.get("METAPS_T0"):
        t0 = float(os.environ["METAPS_T0"])
    inj = FaultInjector(cfg, "ps", shard, t0=t0)
    return inj.added_latency


# ============================================================== test-only breaks (mutation tests)
# A judge that cannot fail proves nothing: ``bench.chaos``'s judge is shown to fail on
# deliberately broken builds (tests/bench/test_chaos_judge.py). The breaks are applied to
# a fleet's processes from outside the product: :func:`write_break_sitecustomize` writes a
# ``sitecustomize.py`` that calls :func:`install_test_breaks`; a fleet started with that
# directory first on ``PYTHONPATH`` and ``$METAPS_TEST_BREAK`` set runs broken. Nothing in
# the product reads ``$METAPS_TEST_BREAK``; without the sitecustomize nothing is broken.
TEST_BREAK_ENV = "METAPS_TEST_BREAK"
TEST_BREAKS = {
    "no_rollback": "a PS recovery does not roll the DDS back to the restored cut (its record still commits)",
    "restore_empty": "a PS Restore verifies and loads the checkpoint, then keeps zero rows (dense params kept)",
    "restore_never_swaps": "a PS Restore verifies and loads the checkpoint aside and never swaps it in: the live "
                           "shard keeps serving what it held; the reply says the cut's row count",
    "restore_partial": "a PS Restore swaps the checkpoint in, then keeps only 7 of every 8 rows; the reply says the "
                       "rows loaded",
}
"""Each break fakes only what its name says: the Restore reply's ``rows`` lie, while the digest of
what the shard serves (``ps.digest``, in the Restore reply) is computed by the unbroken handler
from the live store, as the honest build does. A build that also lied in its digest (computed
from the checkpoint instead of the store it serves from) would pass ``bench.chaos``'s restored
check: the judge trusts that the digest is read from the live store."""


class UnknownTestBreak(MetapsError):
    """``$METAPS_TEST_BREAK`` names a break that does not exist."""


def _break_no_rollback(mod: Any) -> None:
    import logging

    from common.log import kv

    def rollback_to(self: Any, cut_id: int, also: Callable[[Any, list[str]], None] | None = None) -> list[str]:
        logging.getLogger(__name__).warning("TEST BREAK no_rollback: the DDS is not rolled back",
                                            extra=kv(cut_id=cut_id))
        if also is not None:  # the recovery's own record commits as if the rollback had
            with self._dds._store.begin(write=True) as txn:
                also(txn, [])
        return []

    mod.CheckpointCoordinator.rollback_to = rollback_to


def _break_restore_empty(mod: Any) -> None:
    import logging

    from common.log import kv

    orig = mod.restore_shard_checkpoint

    def restore_shard_checkpoint(server: Any, ckpt_dir: Any) -> tuple[int, int]:
        _rows, step = orig(server, ckpt_dir)
        fresh = server.store.empty_like()
        fresh.dense = server.store.dense
        server.store = fresh
        logging.getLogger(__name__).warning("TEST BREAK restore_empty: restored rows dropped",
                                            extra=kv(dir=str(ckpt_dir)))
        return 0, step

    mod.restore_shard_checkpoint = restore_shard_checkpoint


def _break_restore_never_swaps(mod: Any) -> None:
    import logging
    from types import SimpleNamespace

    from common.log import kv

    orig = mod.restore_shard_checkpoint

    def restore_shard_checkpoint(server: Any, ckpt_dir: Any) -> tuple[int, int]:
        # verified and loaded into a store aside, which is then dropped: the live store (and map) stay
        aside = SimpleNamespace(store=server.store.empty_like(), shard_id=server.shard_id, pmap=server.pmap,
                                adopt_map=lambda pmap: None)
        rows, step = orig(aside, ckpt_dir)
        logging.getLogger(__name__).warning("TEST BREAK restore_never_swaps: the cut was loaded aside, never "
                                            "swapped in", extra=kv(dir=str(ckpt_dir), rows=rows))
        return rows, step

    mod.restore_shard_checkpoint = restore_shard_checkpoint


def _break_restore_partial(mod: Any) -> None:
    import logging

    import numpy as np

    from common.log import kv

    orig = mod.restore_shard_checkpoint

    def restore_shard_checkpoint(server: Any, ckpt_dir: Any) -> tuple[int, int]:
        rows, step = orig(server, ckpt_dir)
        dropped = 0
        for name, t in server.store.tables.items():
            ids = np.sort(t.row_ids[t.used_rows()])
            dropped += server.store.remove_ids(name, ids[::8])
        logging.getLogger(__name__).warning("TEST BREAK restore_partial: restored rows dropped",
                                            extra=kv(dir=str(ckpt_dir), rows=rows, dropped=dropped))
        return rows, step

    mod.restore_shard_checkpoint = restore_shard_checkpoint


_BREAK_TARGETS: dict[str, tuple[str, Callable[[Any], None]]] = {
    "no_rollback": ("controller.checkpoint", _break_no_rollback),
    "restore_empty": ("ps.coordinator", _break_restore_empty),
    "restore_never_swaps": ("ps.coordinator", _break_restore_never_swaps),
    "restore_partial": ("ps.coordinator", _break_restore_partial),
}


class _PatchAfterImport:
    """A ``sys.meta_path`` finder: once module ``name`` has executed, ``patch(module)`` runs (lazily,
    so a process that never imports it pays nothing)."""

    def __init__(self, patches: dict[str, Callable[[Any], None]]) -> None:
        self.patches = patches

    def find_spec(self, fullname: str, path: Any = None, target: Any = None) -> Any:
        patch = self.patches.get(fullname)
        if patch is None:
            return None
        import importlib.machinery

        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        loader = spec.loader
        exec_module = loader.exec_module

        def exec_and_patch(module: Any) -> None:
            exec_module(module)
            patch(module)

        loader.exec_module = exec_and_patch  # type: ignore[method-assign]
        return spec


def install_test_breaks(env: Mapping[str, str] | None = None) -> list[str]:
    """Break this process as ``$METAPS_TEST_BREAK`` (comma-separated :data:`TEST_BREAKS` names) says.

    TEST ONLY: called by the ``sitecustomize.py`` of :func:`write_break_sitecustomize`. Returns
    the breaks installed ([] when the variable is unset).

    Raises:
        UnknownTestBreak: a name not in :data:`TEST_BREAKS`.
    """
    import sys

    names = [n for n in (env if env is not None else os.environ).get(TEST_BREAK_ENV, "").split(",") if n]
    unknown = [n for n in names if n not in _BREAK_TARGETS]
    if unknown:
        raise UnknownTestBreak(f"${TEST_BREAK_ENV}: unknown break(s) {unknown}; known: {sorted(TEST_BREAKS)}")
    patches: dict[str, Callable[[Any], None]] = {}
    for n in names:
        module, patch = _BREAK_TARGETS[n]
        if module in sys.modules:
            patch(sys.modules[module])
        else:
            patches[module] = patch
    if patches:
        sys.meta_path.insert(0, _PatchAfterImport(patches))
    return names


def write_break_sitecustomize(directory: str | os.PathLike[str]) -> str:
    """Write ``directory/sitecustomize.py`` (calls :func:`install_test_breaks`); returns the directory.

    TEST ONLY. Put the directory first on ``PYTHONPATH`` and set ``$METAPS_TEST_BREAK``
    in the environment of the processes to break.
    """
    from pathlib import Path

    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    (d / "sitecustomize.py").write_text("from common.faults import install_test_breaks\n\ninstall_test_breaks()\n")
    return str(d)
