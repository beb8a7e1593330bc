"""AntDT-ND: the straggler policy for PS mode on shared clusters.

Fast workers already pull more shards from the DDS (no action needed for
that). On top of detection (:mod:`controller.policy.base`):

    worker flagged slow        -> SlowDetected + ShrinkShards (smaller shards)
                                  + ReleaseClock (leaves the PS staleness clock; `release_slow_clock`)
    ... still slow for `restart_after` more windows -> RestartNode (its agent restarts it; the
                                  fresh process registers, so it rejoins the clock)
    worker back to normal      -> Recovered + RestoreShards + RejoinClock
    PS flagged slow            -> SlowDetected + MoveVshards(src=slow PS, dst=fastest PS, n)
    ... still slow after `cooldown_windows` -> another MoveVshards

Example::

    pol = NdPolicy(MonitorConfig(window_s=1.0), NdConfig(restart_after=2))
    actions = pol.evaluate(monitor.snapshot(), time.time())
"""

from __future__ import annotations

from controller.config import MonitorConfig, NdConfig
from controller.monitor import MonitorSnapshot
from controller.policy.base import (Action, MoveVshards, Policy, Recovered, RejoinClock, ReleaseClock, RestartNode,
                                    RestoreShards, ShrinkShards, SlowDetected, StragglerDetector, WindowCursor,
                                    detection_actions)


class NdPolicy(Policy):
    """See the module docstring.

    Args:
        monitor: detection thresholds.
        nd: restart and vshard-move settings.
    """

    name = "nd"

    def __init__(self, monitor: MonitorConfig, nd: NdConfig) -> None:
        nd.validate()
        self.cfg = nd
        self.workers = StragglerDetector(monitor.ratio, monitor.consecutive, monitor.min_peers)
        self.ps = StragglerDetector(monitor.ratio, monitor.consecutive, monitor.min_peers)
        self._cursor = WindowCursor()
        self._last_action: dict[str, int] = {}  # node -> window index of its last restart/move

    def _cooled(self, node: str, window: int) -> bool:
        last = self._last_action.get(node)
        return last is None or window - last >= self.cfg.cooldown_windows

    def evaluate(self, snapshot: MonitorSnapshot, now: float) -> list[Action]:
        out: list[Action] = []
        for w in self._cursor.new(snapshot):
            for a in detection_actions("worker", self.workers, w.worker_batch_time, w.index):
                out.append(a)
                idx = int(a.node.split(":")[1])
                if isinstance(a, SlowDetected):
                    out.append(ShrinkShards(a.node, a.evidence, worker=idx))
                    if self.cfg.release_slow_clock:
                        out.append(ReleaseClock(a.node, a.evidence, worker=idx))
                elif isinstance(a, Recovered):
                    out.append(RestoreShards(a.node, a.evidence, worker=idx))
                    if self.cfg.release_slow_clock:
                        out.append(RejoinClock(a.node, a.evidence, worker=idx))
            if self.cfg.restart_after > 0:
                for idx in sorted(self.workers.flagged):
                    node = f"worker:{idx}"
                    streak = self.workers.streak.get(idx, 0)
                    if streak >= self.workers.consecutive + self.cfg.restart_after and self._cooled(node, w.index):
                        self._last_action[node] = w.index
                        out.append(RestartNode(node, {"window": w.index, "slow_windows": streak,
                                                      "value": w.worker_batch_time.get(idx)},
                                               role="worker", index=idx))
                        self.workers.reset(idx)  # a fresh process earns a fresh streak
            for a in detection_actions("ps", self.ps, w.ps_latency, w.index):
                out.append(a)
            if self.cfg.move_vshards > 0:
                for src in sorted(self.ps.flagged):
                    node = f"ps:{src}"
                    others = {k: v for k, v in w.ps_latency.items() if k != src and k not in self.ps.flagged}
                    if not others or not self._cooled(node, w.index):
                        continue
                    dst = min(others, key=lambda k: (others[k], k))
                    self._last_action[node] = w.index
                    out.append(MoveVshards(node, {"window": w.index, "latency": w.ps_latency.get(src),
                                                  "dst_latency": others[dst]},
                                           src=src, dst=dst, n=self.cfg.move_vshards))
        return out
