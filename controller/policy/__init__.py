"""Straggler policies as a package (as DLRover's ``scaler/``): the base and one module per policy.

    base.py   the Policy interface, the actions, StragglerDetector, DetectOnlyPolicy (``none``)
    nd.py     AntDT-ND: PS mode on shared clusters (smaller shards, restart, move vshards)
    dd.py     AntDT-DD: per-worker batch sizes for all-reduce mode

:func:`make_policy` builds the one ``[controller] policy`` names. The actions and the
interface are re-exported here, so ``from controller.policy import Action`` reads as before.
Imports go one way only: ``nd`` and ``dd`` import ``base``, this module imports all three.

Example::

    policy = make_policy(ControllerConfig(policy=PolicyKind.DD))
    actions = policy.evaluate(monitor.snapshot(now), now)
"""

from __future__ import annotations

from controller.config import ControllerConfig, PolicyKind
from controller.policy.base import (Action, ActionKind, DetectOnlyPolicy, MoveVshards, Policy, Recovered,
                                    RejoinClock, ReleaseClock, RestartNode, RestoreShards, SetBatchSizes, ShrinkShards, SlowDetected,
                                    StragglerDetector, Verdict, WindowCursor, detection_actions)
from controller.policy.dd import DdPolicy
from controller.policy.nd import NdPolicy


def make_policy(cfg: ControllerConfig) -> Policy:
    """The built-in policy named by ``cfg.policy``.

    Args:
        cfg: the controller settings; ``policy`` picks the policy (``nd`` | ``dd`` | ``none``),
            ``monitor`` its detection thresholds, ``nd`` / ``dd`` its own settings.

    Raises:
        ValueError: ``cfg.policy`` names no built-in policy.
    """
    try:
        kind = PolicyKind(cfg.policy)
    except ValueError:
        raise ValueError(f"[controller] policy: unknown policy {cfg.policy!r}; expected one of "
                         f"{[k.value for k in PolicyKind]}") from None
    if kind is PolicyKind.ND:
        return NdPolicy(cfg.monitor, cfg.nd)
    if kind is PolicyKind.DD:
        return DdPolicy(cfg.monitor, cfg.dd)
    return DetectOnlyPolicy(cfg.monitor)


__all__ = [
    "Action", "ActionKind", "DdPolicy", "DetectOnlyPolicy", "MoveVshards", "NdPolicy", "Policy", "Recovered",
    "RejoinClock", "ReleaseClock", "RestartNode", "RestoreShards", "SetBatchSizes", "ShrinkShards", "SlowDetected", "StragglerDetector",
    "Verdict", "WindowCursor", "detection_actions", "make_policy",
]
