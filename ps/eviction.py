"""Choosing rows to evict when a table is full.

Pure functions over the table's per-row metadata arrays (all length = capacity)::

    row_ids    int64 [C]   id held by the row, -1 = free
    freq       int32 [C]   pushes that touched the row (LFU)
    last_step  int32 [C]   table step of the last push touching it (TTL)

Victims are picked with one ``argpartition`` (O(C)), never a Python loop.
Eviction frees ``max(needed, evict_fraction * capacity)`` rows at once so the
O(C) scan is amortized over many admissions.

Example::

    victims = pick_victims(cfg, row_ids, freq, last_step, step=10, needed=3, protect=rows_in_push)
"""

from __future__ import annotations

import numpy as np

from ps.config import EvictionConfig, EvictionPolicy


def pick_victims(
    cfg: EvictionConfig,
    row_ids: np.ndarray,
    freq: np.ndarray,
    last_step: np.ndarray,
    step: int,
    needed: int,
    protect: np.ndarray | None = None,
) -> np.ndarray:
    """Rows to evict so that at least ``needed`` rows can be allocated.

    Args:
        cfg: the table's eviction rule.
        row_ids, freq, last_step: per-row metadata (see the module docstring).
        step: the table's current step.
        needed: rows the caller must allocate beyond the free ones.
        protect: rows that must not be evicted (rows touched by the current request).

    Returns:
        int64 row indices (unique); empty when the policy is ``none`` or nothing
        can be evicted. May be fewer than ``needed`` only when fewer rows are evictable.
    """
    if needed <= 0 or cfg.policy == EvictionPolicy.NONE:
        return np.empty(0, dtype=np.int64)
    capacity = row_ids.shape[0]
    candidates = row_ids != -1  # -1 = free; negative ids are ids
    if protect is not None and protect.size:
        candidates[protect] = False  # candidates is a fresh array (comparison result)
    cand = np.nonzero(candidates)[0]
    if cand.size == 0:
        return np.empty(0, dtype=np.int64)
    target = min(max(int(needed), int(np.ceil(cfg.evict_fraction * capacity))), cand.size)
    if cfg.policy == EvictionPolicy.LFU:
        # least frequent first; ties broken by the oldest last touch
        score = freq[cand].astype(np.int64) * (1 << 32) + last_step[cand].astype(np.int64)
    else:  # TTL: expired rows, oldest first; if too few expired, the oldest rows anyway
        age = int(step) - last_step[cand].astype(np.int64)
        expired = age > cfg.ttl_steps
        n_exp = int(expired.sum())
        # all the expired rows up to target, but never fewer than needed
        target = min(target, n_exp) if n_exp >= needed else int(needed)
        score = last_step[cand].astype(np.int64)
    if target >= cand.size:
        return cand.astype(np.int64)
    part = np.argpartition(score, target - 1)[:target]
    return cand[part].astype(np.int64)
