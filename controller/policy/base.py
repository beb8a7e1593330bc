"""Straggler policies, the base: the interface, the actions, and slow-node detection.

The built-in policies live beside it (:mod:`controller.policy.nd`,
:mod:`controller.policy.dd`); :func:`controller.policy.make_policy` picks one.

A policy looks at the Monitor's closed windows and returns actions; the
controller carries them out and records every one as an event (time, node,
evidence, action). Write your own by subclassing :class:`Policy`::

    class PageMe(Policy):
        def evaluate(self, snap, now):
            return [SlowDetected(f"worker:{w}", {"t": t})
                    for w, t in snap.latest.worker_batch_time.items() if t > 1.0]

Detection (:class:`StragglerDetector`): a node is *slow in a window* when its
value > ``ratio`` x the median of its peers; it is *flagged* after
``consecutive`` slow windows in a row; one normal window clears it::

             slow window                  slow window (streak == consecutive)
    NORMAL ---------------> SUSPECT(1..k-1) ------------------------------> FLAGGED
       ^                        |                                            |
       +------ normal window ---+------------- normal window ----------------+
                                                      (emits Recovered)

A window where a node reports nothing leaves its streak unchanged (a very slow
worker may not finish a batch inside one window).
"""

from __future__ import annotations

import abc
import enum
import statistics
from dataclasses import dataclass, field
from typing import Any, Mapping

from controller.config import MonitorConfig
from controller.monitor import MonitorSnapshot, WindowStats


class ActionKind(str, enum.Enum):
    SLOW_DETECTED = "slow_detected"
    RECOVERED = "recovered"
    SHRINK_SHARDS = "shrink_shards"
    RESTORE_SHARDS = "restore_shards"
    RESTART = "restart"
    MOVE_VSHARDS = "move_vshards"
    SET_BATCH_SIZES = "set_batch_sizes"
    RELEASE_CLOCK = "release_clock"
    REJOIN_CLOCK = "rejoin_clock"


@dataclass(frozen=True)
class Action:
    """Base of every decision. ``node`` is ``role:index``; ``evidence`` the figures."""

    node: str
    evidence: dict[str, Any] = field(default_factory=dict)

    @property
    def kind(self) -> ActionKind:
        raise NotImplementedError


@dataclass(frozen=True)
class SlowDetected(Action):
    @property
    def kind(self) -> ActionKind:
        return ActionKind.SLOW_DETECTED


@dataclass(frozen=True)
class Recovered(Action):
    @property
    def kind(self) -> ActionKind:
        return ActionKind.RECOVERED


@dataclass(frozen=True)
class ShrinkShards(Action):
    """The worker's next shards are ``slow_shrink`` times smaller."""

    worker: int = 0

    @property
    def kind(self) -> ActionKind:
        return ActionKind.SHRINK_SHARDS


@dataclass(frozen=True)
class RestoreShards(Action):
    worker: int = 0

    @property
    def kind(self) -> ActionKind:
        return ActionKind.RESTORE_SHARDS


@dataclass(frozen=True)
class ReleaseClock(Action):
    """The worker leaves the PS step clocks (bounded staleness) while it is flagged slow."""

    worker: int = 0

    @property
    def kind(self) -> ActionKind:
        return ActionKind.RELEASE_CLOCK


@dataclass(frozen=True)
class RejoinClock(Action):
    """The worker, no longer flagged slow, rejoins the PS step clocks."""

    worker: int = 0

    @property
    def kind(self) -> ActionKind:
        return ActionKind.REJOIN_CLOCK


@dataclass(frozen=True)
class RestartNode(Action):
    """Tell the node's agent to restart its process."""

    role: str = "worker"
    index: int = 0

    @property
    def kind(self) -> ActionKind:
        return ActionKind.RESTART


@dataclass(frozen=True)
class MoveVshards(Action):
    """Move ``n`` vshards from PS ``src`` to PS ``dst`` (executed by a PsMover)."""

    src: int = 0
    dst: int = 0
    n: int = 0

    @property
    def kind(self) -> ActionKind:
        return ActionKind.MOVE_VSHARDS


@dataclass(frozen=True)
class SetBatchSizes(Action):
    """Per-worker batch sizes; they sum to the global batch."""

    sizes: dict[int, int] = field(default_factory=dict)

    @property
    def kind(self) -> ActionKind:
        return ActionKind.SET_BATCH_SIZES


class Policy(abc.ABC):
    """Turns Monitor snapshots into actions. Called once per controller tick."""

    name = "policy"

    @abc.abstractmethod
    def evaluate(self, snapshot: MonitorSnapshot, now: float) -> list[Action]:
        """Actions for the windows closed since the last call (may be empty)."""


@dataclass(frozen=True)
class Verdict:
    """One node in one window: its value, its peers' median and its streak."""

    value: float
    peer_median: float
    slow: bool
    streak: int
    flagged: bool


class StragglerDetector:
    """Ratio-to-peer-median detection with a consecutive-window requirement.

    Args:
        ratio: slow when value > ratio x median(peers).
        consecutive: slow windows in a row before a node is flagged.
        min_peers: fewer peers than this and the window is not judged.

    Example::

        det = StragglerDetector(ratio=2.0, consecutive=3)
        for _ in range(3):
            v = det.observe({0: 5, 1: 5, 2: 5, 3: 5, 4: 15, 5: 15})
        det.flagged   # {4, 5}
    """

    def __init__(self, ratio: float = 2.0, consecutive: int = 3, min_peers: int = 1) -> None:
        MonitorConfig(ratio=ratio, consecutive=consecutive, min_peers=min_peers).validate()
        self.ratio = ratio
        self.consecutive = consecutive
        self.min_peers = min_peers
        self.streak: dict[int, int] = {}
        self.flagged: set[int] = set()

    def observe(self, values: Mapping[int, float]) -> dict[int, Verdict]:
        """Judge one window (node -> value, larger = slower); update streaks and flags."""
        out: dict[int, Verdict] = {}
        if len(values) - 1 < self.min_peers:
            return out
        for node, value in values.items():
            peers = [v for k, v in values.items() if k != node]
            med = statistics.median(peers)
            slow = med > 0 and value > self.ratio * med
            self.streak[node] = self.streak.get(node, 0) + 1 if slow else 0
            if self.streak[node] >= self.consecutive:
                self.flagged.add(node)
            elif not slow:
                self.flagged.discard(node)
            out[node] = Verdict(value, med, slow, self.streak[node], node in self.flagged)
        return out

    def reset(self, node: int) -> None:
        """Forget a node's history (e.g. it was restarted)."""
        self.streak.pop(node, None)
        self.flagged.discard(node)


class WindowCursor:
    """Yields each closed window once across successive snapshots."""

    def __init__(self) -> None:
        self.last = -1

    def new(self, snapshot: MonitorSnapshot) -> list[WindowStats]:
        fresh = [w for w in snapshot.windows if w.index > self.last]
        if fresh:
            self.last = fresh[-1].index
        return fresh


class DetectOnlyPolicy(Policy):
    """Flags slow workers and PS as events; takes no action (``policy = "none"``)."""

    name = "none"

    def __init__(self, cfg: MonitorConfig) -> None:
        self.workers = StragglerDetector(cfg.ratio, cfg.consecutive, cfg.min_peers)
        self.ps = StragglerDetector(cfg.ratio, cfg.consecutive, cfg.min_peers)
        self._cursor = WindowCursor()

    def evaluate(self, snapshot: MonitorSnapshot, now: float) -> list[Action]:
        actions: list[Action] = []
        for w in self._cursor.new(snapshot):
            actions += detection_actions("worker", self.workers, w.worker_batch_time, w.index)
            actions += detection_actions("ps", self.ps, w.ps_latency, w.index)
        return actions


def detection_actions(role: str, det: StragglerDetector, values: Mapping[int, float], window: int) -> list[Action]:
    """SlowDetected / Recovered for the nodes whose flag changed in this window."""
    before = set(det.flagged)
    verdicts = det.observe(values)
    out: list[Action] = []
    for node in sorted(det.flagged - before):
        v = verdicts[node]
        out.append(SlowDetected(f"{role}:{node}", _evidence(v, det, window)))
    for node in sorted(before - det.flagged):
        seen = verdicts.get(node)
        out.append(Recovered(f"{role}:{node}", _evidence(seen, det, window) if seen else {"window": window}))
    return out


def _evidence(v: Verdict, det: StragglerDetector, window: int) -> dict[str, Any]:
    return {"window": window, "value": round(v.value, 6), "peer_median": round(v.peer_median, 6),
            "ratio": round(v.value / v.peer_median, 3) if v.peer_median else None,
            "threshold_ratio": det.ratio, "streak": v.streak}
