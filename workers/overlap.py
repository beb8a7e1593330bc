"""``[train] overlap = "auto"``: overlap row traffic with compute only where it is faster.

With overlap a step's traffic (one message per shard: push t-1, dense t-1, pull t+1; or,
off the one-message path, the row pull and push on a background lane) travels while the
step computes (``workers/trainer.py``). On free cores that hides
the network and the PS-side work; on a box whose cores are all busy (the PS
process, the prefetch thread and gRPC's threads beside the worker) the lane's
work competes with the step instead, and overlapping can be slower than not.
So the worker measures it::

    steps  0..W-1        warm-up (not timed): first pulls, lazy set-up
    steps  W..W+2KR-1    alternate windows of K steps: overlapped, serial, overlapped, ...
                         (R windows each); a step's time is its whole cycle, iteration
                         start to iteration start (the caller's work after the step included)
    then                 the faster mode (median of its windows' mean step times) for the
                         rest of the run; the decision and both figures go to the log and
                         the worker's report (``overlap``)

A switch is safe at any step: leaving overlap lands the in-flight push before
the next serial step (rows fresh again), entering it pulls the next batch before
this step's push (rows one step stale, as always with overlap). The choice
depends on timing, so two runs may choose differently: set ``overlap = true`` or
``false`` for a fixed schedule (the parity tests do). In-process rows
(``train-local``) have nothing to hide: "auto" is off there without measuring.

Example::

    probe = OverlapProbe("auto", in_process=False)
    for step in range(n):
        overlapped = probe.overlap(step)
        ...
        probe.record(step, cycle_s)
    probe.report()   # {"mode": "auto", "chosen": "off", "on_ms": 14.2, "off_ms": 11.9, ...}
"""

from __future__ import annotations

import logging
import statistics
from typing import Any

from common.log import kv

__all__ = ["AUTO", "OverlapProbe"]

log = logging.getLogger(__name__)

AUTO = "auto"
"""``[train] overlap`` value: measure, then keep the faster mode."""


class OverlapProbe:
    """Decides, step by step, whether a worker overlaps its row traffic.

    Args:
        setting: ``[train] overlap``: True (always), False (never) or "auto".
        in_process: the rows are an in-process store (nothing to hide: "auto" is off).
        warmup: untimed steps before the first window.
        window: steps per window.
        rounds: windows of each mode.
    """

    def __init__(self, setting: bool | str, in_process: bool, warmup: int = 3, window: int = 4, rounds: int = 3) -> None:
        if setting not in (True, False, AUTO):
            raise ValueError(f"overlap must be true, false or 'auto', got {setting!r}")
        self.setting = setting
        self.warmup, self.window, self.rounds = warmup, window, rounds
        self._times: dict[bool, list[list[float]]] = {True: [], False: []}
        self._start: int | None = None
        self.chosen: bool | None = None if setting == AUTO and not in_process else bool(setting is True)
        self.why = ("set" if setting != AUTO else "in-process rows: nothing to hide") if self.chosen is not None else ""

    @property
    def probing(self) -> bool:
        """Still measuring (no decision yet)."""
        return self.chosen is None

    def overlap(self, step: int) -> bool:
        """Whether step ``step`` (the trainer's step number) runs overlapped."""
        if self.chosen is not None:
            return self.chosen
        if self._start is None:
            self._start = step + self.warmup
        if step < self._start:
            return True
        return ((step - self._start) // self.window) % 2 == 0  # on, off, on, off, ...

    def record(self, step: int, cycle_s: float) -> None:
        """Step ``step`` took ``cycle_s`` (iteration to iteration); decides after the last window."""
        if self.chosen is not None or self._start is None or step < self._start:
            return
        k = (step - self._start) // self.window
        on = k % 2 == 0
        windows = self._times[on]
        if len(windows) <= k // 2:
            windows.append([])
        windows[k // 2].append(cycle_s)
        if k == 2 * self.rounds - 1 and len(self._times[False][-1]) == self.window:
            self._decide()

    def _decide(self) -> None:
        on = statistics.median(statistics.fmean(w) for w in self._times[True])
        off = statistics.median(statistics.fmean(w) for w in self._times[False])
        self.chosen = on <= off
        self.why = f"measured: {on * 1e3:.2f} ms/step overlapped vs {off * 1e3:.2f} serial"
        log.info("overlap decided", extra=kv(overlap="on" if self.chosen else "off", on_ms=round(on * 1e3, 2),
                                             off_ms=round(off * 1e3, 2), windows=self.rounds, steps=self.window))

    def report(self) -> dict[str, Any]:
        """The setting, the mode in use (None: still measuring) and, when measured, both figures."""
        out: dict[str, Any] = {"setting": self.setting, "chosen": None if self.chosen is None else
                               ("on" if self.chosen else "off"), "why": self.why or "still measuring (run too short)"}
        for on, key in ((True, "on_ms"), (False, "off_ms")):
            if self._times[on]:
                out[key] = round(statistics.median(statistics.fmean(w) for w in self._times[on] if w) * 1e3, 3)
        return out
