"""Fault injection for tests, benchmarks and demos: stragglers, slow PS, kills.

Mounted at ``[faults]`` of the job TOML. A worker fault is scheduled from its training,
by step number or by seconds after its first training step, so it fires whatever the
box's start-up took::

    [[faults.faults]]
    target = "worker"      # worker | ps
    index = 1
    kind = "slow"          # slow: the worker's own work x factor
    factor = 3.0
    basis = "step"         # "compute" (default): its forward/backward x factor; "step": its whole step
    start_step = 20        # from its step 20 (the run's step numbers, as in the report) ...
    end_step = 80          # ... to before step 80 (0 = to the end)

    [[faults.faults]]
    target = "worker"
    index = 0
    kind = "slow"
    factor = 4.0
    since = "train"        # start_s / duration_s count from the worker's first training step
    start_s = 5.0
    duration_s = 10.0      # 0 = until the end

    [[faults.faults]]
    target = "worker"
    index = 0
    kind = "kill"          # kill: the process exits once it has run step at_step
    at_step = 30

    [[faults.faults]]
    target = "ps"
    index = 1
    kind = "latency"       # latency: added seconds per request
    latency_s = 0.02       # since = "launch" (the default): start_s / at_s count from the launch

``since = "launch"`` (seconds after the launcher's start, ``$METAPS_T0``) is the default and
what a PS fault uses (a PS runs no training steps), and the benches that time their phases
from the launch (``bench.stragglers`` E2, ``bench.chaos``) rely on it. A demo should not: a
launch-relative window passes unseen when training starts late (a loaded box) or ends early
(an idle one).

**What fired.** An injector records each of its faults that actually applied, with when: the
first and last step (workers) and time, the steps or requests it touched and the seconds it
slept. With ``record_dir`` set it writes them to ``record_dir/<role>-<index>.<pid>.json`` (at the
first firing, at most every :data:`RECORD_EVERY_S` after, at :meth:`FaultInjector.flush` and just
before an injected kill); ``metaps.run_report`` reads them (``report.json`` ``faults``), and the
report, plots and summaries name only what fired, never the config.

Workers and PS build a :class:`FaultInjector` for themselves and ask it::

    inj = FaultInjector(job.faults, "worker", rank, t0=job_start, record_dir=run_dir / "faults")
    inj.arm_training()                                        # at the worker's first training step
    time.sleep(inj.step_delay(compute_s, own_step_s, step=step))  # a slowed worker: its work x (factor - 1)
    time.sleep(inj.added_latency())           # in a PS request handler
    if inj.kill_due(step=step, start_step=s0): os._exit(137)  # an injected crash
"""

from __future__ import annotations

import enum
import logging
import os
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping

from common.errors import MetapsError
from common.log import kv

log = logging.getLogger(__name__)

RECORD_EVERY_S = 2.0
"""How often at most a firing fault's record file is rewritten (its first firing is written at once)."""


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
    KILL = "kill"        # die at `at_s` / after step `at_step`


class FaultClock(str, enum.Enum):
    """What a fault's seconds (``start_s``, ``duration_s``, ``at_s``) count from."""

    LAUNCH = "launch"  # the launcher's start ($METAPS_T0): PS faults, benches timed from the launch
    TRAIN = "train"    # the worker's first training step (workers only)


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
        start_s: slow/latency: seconds after ``since`` when it begins.
        duration_s: slow/latency: how long it lasts; 0 = persistent.
        at_s: kill: seconds after ``since`` when the process dies.
        since: what the seconds count from, ``launch`` (default) or ``train`` (:class:`FaultClock`;
            workers only: their first training step).
        start_step: slow (workers): the first step it applies to (the run's step numbers); with
            ``end_step``, schedules it by steps instead of seconds (PS-mode and all-reduce loops;
            the DD loop, ``workers/dd.py``, applies seconds-scheduled faults only).
        end_step: slow (workers): the step it stops before; 0 = to the end.
        at_step: kill (workers): the process exits once it has run this step (an incarnation that
            started past it, the agent's replacement, is spared).
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
    since: FaultClock = FaultClock.LAUNCH
    start_step: int = 0
    end_step: int = 0
    at_step: int = 0

    def __post_init__(self) -> None:
        object.__setattr__(self, "target", FaultTarget(self.target))
        object.__setattr__(self, "kind", FaultKind(self.kind))
        object.__setattr__(self, "basis", SlowBasis(self.basis))
        object.__setattr__(self, "since", FaultClock(self.since))

    @property
    def by_step(self) -> bool:
        """Scheduled by step numbers (``start_step`` / ``end_step`` / ``at_step``), not seconds."""
        return bool(self.start_step or self.end_step or self.at_step)

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
        if self.start_step < 0 or self.end_step < 0 or self.at_step < 0:
            raise ValueError(f"{where}: start_step, end_step and at_step must be >= 0")
        if self.end_step and self.end_step <= self.start_step:
            raise ValueError(f"{where}: end_step ({self.end_step}) must be > start_step ({self.start_step})")
        if self.by_step and self.target is not FaultTarget.WORKER:
            raise ValueError(f"{where}: start_step / end_step / at_step schedule worker faults only "
                             "(a PS runs no training steps): use start_s with since = \"launch\"")
        if self.since is FaultClock.TRAIN and self.target is not FaultTarget.WORKER:
            raise ValueError(f"{where}: since = \"train\" is for worker faults (a PS runs no training steps)")
        if self.by_step and (self.start_s or self.duration_s or self.at_s):
            raise ValueError(f"{where}: scheduled both by steps and by seconds; set one")
        if self.kind is FaultKind.KILL and (self.start_step or self.end_step):
            raise ValueError(f"{where}: a kill is scheduled by at_step (or at_s), not start_step / end_step")
        if self.kind is not FaultKind.KILL and self.at_step:
            raise ValueError(f"{where}: at_step is for kill faults; a {self.kind.value} fault takes start_step / end_step")
        if self.kind is FaultKind.KILL and self.since is FaultClock.TRAIN:
            raise ValueError(f"{where}: a kill counted from training would kill every restarted incarnation "
                             "again; use at_step (or at_s since the launch)")

    def active(self, elapsed: float) -> bool:
        """Whether a seconds-scheduled slow/latency fault applies ``elapsed`` seconds after its clock."""
        if elapsed < self.start_s:
            return False
        return self.duration_s == 0 or elapsed < self.start_s + self.duration_s

    def active_at_step(self, step: int) -> bool:
        """Whether a step-scheduled slow fault applies to step ``step``."""
        return step >= self.start_step and (self.end_step == 0 or step < self.end_step)

    def describe(self) -> str:
        """``worker 1 slow x3 (step)``: what the fault does, without its schedule."""
        what = f"{self.target.value} {self.index} {self.kind.value}"
        if self.kind is FaultKind.SLOW:
            what += f" x{self.factor:g} ({self.basis.value})"
        elif self.kind is FaultKind.LATENCY:
            what += f" +{self.latency_s * 1000:g} ms per request"
        return what


@dataclass(frozen=True)
class FaultConfig:
    """``[faults]``: the list of injected faults (empty = none).

    Example::

        FaultConfig(faults=[Fault("worker", 1, "slow", factor=4.0, start_step=20)])
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

    def numbered_for_node(self, role: str, index: int) -> list[tuple[int, Fault]]:
        """(position in ``[[faults.faults]]``, fault) of the faults on one node."""
        return [(i, f) for i, f in enumerate(self.faults) if f.target.value == role and f.index == index]


class FaultInjector:
    """The faults that apply to one process, and a record of those that fired.

    Args:
        cfg: the job's ``[faults]``.
        role: ``worker`` or ``ps``.
        index: this process's rank / shard.
        t0: the launch (``since = "launch"``; same clock as ``clock``); default: now.
        clock: ``time.time`` by default, so processes of one job share t0.
        record_dir: where to write what fired (``<role>-<index>.<pid>.json``); None: kept in memory only.
    """

    def __init__(self, cfg: FaultConfig, role: str, index: int, t0: float | None = None,
                 clock: Callable[[], float] = time.time, record_dir: str | os.PathLike[str] | None = None) -> None:
        FaultTarget(role)
        cfg.validate()
        self.role, self.index = role, index
        self._numbered = cfg.numbered_for_node(role, index)
        self._faults = [f for _, f in self._numbered]
        self._clock = clock
        self.t0 = clock() if t0 is None else t0
        self.train_t0: float | None = None  # the first training step (arm_training): since = "train"
        self._fired: dict[int, dict[str, Any]] = {}
        self._lock = threading.Lock()
        self._path = (Path(record_dir) / f"{role}-{index}.{os.getpid()}.json") if record_dir is not None else None
        self._dirty = False
        self._written = 0.0

    @property
    def empty(self) -> bool:
        return not self._faults

    def arm_training(self, now: float | None = None) -> None:
        """The worker's first training step is done: ``since = "train"`` clocks start now (once)."""
        if self.train_t0 is None:
            self.train_t0 = self._clock() if now is None else now

    def _elapsed(self, f: Fault, now: float) -> float | None:
        """Seconds since ``f``'s clock; None before a ``train`` clock is armed."""
        if f.since is FaultClock.TRAIN:
            return None if self.train_t0 is None else now - self.train_t0
        return now - self.t0

    def _applies(self, f: Fault, now: float, step: int | None) -> bool:
        if f.by_step:
            return step is not None and f.active_at_step(step)
        e = self._elapsed(f, now)
        return e is not None and f.active(e)

    def _active(self, kind: FaultKind, now: float, step: int | None) -> list[tuple[int, Fault]]:
        return [(i, f) for i, f in self._numbered if f.kind is kind and self._applies(f, now, step)]

    def slowdown(self, now: float | None = None, step: int | None = None) -> float:
        """Current step-time multiplier (1.0 = normal; active factors multiply)."""
        t = self._clock() if now is None else now
        m = 1.0
        for _, f in self._active(FaultKind.SLOW, t, step):
            m *= f.factor
        return m

    def step_delay(self, compute_s: float, own_step_s: float | None = None, now: float | None = None,
                   step: int | None = None) -> float:
        """Extra seconds a slowed worker sleeps after a step (recorded as fired when > 0).

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
            step: the step just run (step-scheduled faults apply only when it is given).
        """
        t = self._clock() if now is None else now
        active = self._active(FaultKind.SLOW, t, step)
        by_basis = {SlowBasis.COMPUTE: 1.0, SlowBasis.STEP: 1.0}
        for _, f in active:
            by_basis[f.basis] *= f.factor
        own = compute_s if own_step_s is None else own_step_s
        delay = (max(0.0, compute_s) * (by_basis[SlowBasis.COMPUTE] - 1.0)
                 + max(0.0, own) * (by_basis[SlowBasis.STEP] - 1.0))
        if delay > 0:
            for i, f in active:
                self._mark(i, f, t, step, sleep_s=delay)
        return delay

    def added_latency(self, now: float | None = None) -> float:
        """Seconds a PS adds to the request it is serving now (recorded as fired when > 0)."""
        t = self._clock() if now is None else now
        active = self._active(FaultKind.LATENCY, t, None)
        for i, f in active:
            self._mark(i, f, t, None, sleep_s=f.latency_s)
        return sum(f.latency_s for _, f in active)

    def kill_due(self, now: float | None = None, born: float | None = None, step: int | None = None,
                 start_step: int | None = None) -> bool:
        """True once a kill fault is due; the firing is recorded and written at once (the caller exits).

        Args:
            now: the current time (default: the clock).
            born: when this process started (same clock). A seconds kill fires only in a
                process that was alive at ``at_s``, so the replacement its agent starts
                afterwards is not killed again.
            step: the step just run (an ``at_step`` kill applies only when it is given).
            start_step: the step this incarnation started after (its resumed clock): an
                ``at_step`` kill spares an incarnation that started at or past it.
        """
        t = self._clock() if now is None else now
        b = None if born is None else born - self.t0
        for i, f in self._numbered:
            if f.kind is not FaultKind.KILL:
                continue
            if f.at_step:
                due = step is not None and step >= f.at_step and (start_step is None or start_step < f.at_step)
            else:
                due = t - self.t0 >= f.at_s and (b is None or b < f.at_s)
            if due:
                self._mark(i, f, t, step, sleep_s=0.0)
                self.flush()
                return True
        return False

    # -- what fired ---------------------------------------------------------------------
    def _mark(self, i: int, f: Fault, now: float, step: int | None, sleep_s: float) -> None:
        with self._lock:
            rec = self._fired.get(i)
            first = rec is None
            if rec is None:
                rec = self._fired[i] = {
                    "fault": i, "target": f.target.value, "index": f.index, "kind": f.kind.value,
                    "what": f.describe(), "factor": f.factor, "basis": f.basis.value, "latency_s": f.latency_s,
                    "schedule": _schedule(f), "since": f.since.value, "pid": os.getpid(),
                    "first_time": now, "first_step": step, "last_time": now, "last_step": step,
                    "count": 0, "sleep_s": 0.0, "train_t0": self.train_t0, "launch_t0": self.t0}
                log.warning("fault injection: fault fired", extra=kv(fault=i, what=rec["what"], schedule=rec["schedule"],
                                                                     step=step))
            rec["last_time"], rec["count"] = now, rec["count"] + 1
            if step is not None:
                rec["last_step"] = step
            rec["sleep_s"] += sleep_s
            self._dirty = True
            due = first or now - self._written >= RECORD_EVERY_S
        if due:
            self.flush()

    def fired(self) -> list[dict[str, Any]]:
        """The faults that fired so far, one record each (see the module docstring), in config order."""
        with self._lock:
            return [dict(self._fired[i]) for i in sorted(self._fired)]

    def flush(self) -> None:
        """Write the record file now if anything fired since the last write (no-op without ``record_dir``)."""
        if self._path is None:
            return
        with self._lock:
            if not self._dirty:
                return
            self._dirty = False
            self._written = self._clock()
            body = {"role": self.role, "index": self.index, "pid": os.getpid(),
                    "fired": [dict(self._fired[i]) for i in sorted(self._fired)]}
        from common.atomic_write import write_json_atomic

        try:
            self._path.parent.mkdir(parents=True, exist_ok=True)
            write_json_atomic(self._path, body)
        except OSError as exc:  # a full disk must not stop training over a demo record
            log.warning("fault record not written", extra=kv(path=str(self._path), error=str(exc)[:200]))


def _schedule(f: Fault) -> str:
    """The fault's configured schedule in words (``steps 20-79``, ``5 s after its first step for 10 s``)."""
    if f.at_step:
        return f"after step {f.at_step}"
    if f.by_step:
        return f"steps {f.start_step}-{f.end_step - 1}" if f.end_step else f"from step {f.start_step}"
    clock = "its first training step" if f.since is FaultClock.TRAIN else "the launch"
    if f.kind is FaultKind.KILL:
        return f"{f.at_s:g} s after {clock}"
    span = f" for {f.duration_s:g} s" if f.duration_s else ""
    return f"{f.start_s:g} s after {clock}{span}"


def read_fired(record_dir: str | os.PathLike[str]) -> list[dict[str, Any]]:
    """Every fault firing recorded under ``record_dir`` (one record per fault per process), oldest first.

    Unreadable files are skipped with a warning (a process killed mid-write leaves at most a temp file).
    """
    import json

    out: list[dict[str, Any]] = []
    d = Path(record_dir)
    if not d.is_dir():
        return out
    for p in sorted(d.glob("*.json")):
        try:
            body = json.loads(p.read_text())
        except (OSError, ValueError) as exc:
            log.warning("unreadable fault record", extra=kv(path=str(p), error=str(exc)[:200]))
            continue
        out.extend(r for r in body.get("fired") or [] if isinstance(r, dict))
    return sorted(out, key=lambda r: float(r.get("first_time") or 0.0))


def ps_added_latency(cfg: FaultConfig, shard: int, t0: float | None = None,
                     record_dir: str | os.PathLike[str] | None = None) -> Callable[[], float] | None:
    """The per-request delay hook of PS ``shard`` (``ps.servicer`` sleeps its value), or None.

    ``t0`` defaults to ``$METAPS_T0`` (the launcher's job start, shared by every
    process of a job) or now, so ``start_s`` / ``duration_s`` mean the same on
    every node. None when no latency fault targets this shard (no per-request cost).
    What fired is written under ``record_dir`` (default: ``$METAPS_RUN_DIR/faults`` when set).

    Example::

        hook = ps_added_latency(job.faults, shard=1)
        build_server(..., added_latency_s=hook)
    """
    if not any(f.kind is FaultKind.LATENCY for f in cfg.for_node("ps", shard)):
        return None
    if t0 is None and os.environ.get("METAPS_T0"):
        t0 = float(os.environ["METAPS_T0"])
    if record_dir is None and os.environ.get("METAPS_RUN_DIR"):
        record_dir = Path(os.environ["METAPS_RUN_DIR"]) / "faults"
    inj = FaultInjector(cfg, "ps", shard, t0=t0, record_dir=record_dir)
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
