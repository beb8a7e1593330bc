"""Episode planning: cut each task's rows into episodes and support/query slots (pure numpy).

The episode rule is stated in :mod:`meta_io.build.pipeline` and docs/design/meta_io.md.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from meta_io.layout import Bucket


@dataclass(frozen=True)
class EpisodePlan:
    """Where every row of a run of whole tasks goes (rows task-major, split order).

    Per row (length N): ``episode``, ``pos`` (position in its episode),
    ``is_query``, ``slot`` (slot within its bucket's task layout).
    Per episode (length E): ``task``, ``n_rows``, ``n_support``, ``n_query``, ``level``
    (index into the bucket list).
    """

    episode: np.ndarray
    pos: np.ndarray
    is_query: np.ndarray
    slot: np.ndarray
    task: np.ndarray
    n_rows: np.ndarray
    n_support: np.ndarray
    n_query: np.ndarray
    level: np.ndarray


def plan_episodes(task_rows: np.ndarray, support: int, query: int, buckets: list[Bucket]) -> EpisodePlan:
    """Apply the episode rule to tasks of ``task_rows`` rows each (all >= 2).

    Vectorized: no loop over rows or tasks (only over the few buckets).

    Args:
        task_rows: int array, rows per task, tasks in output order.
        support: S. query: Q. buckets: from :func:`meta_io.layout.make_buckets`.

    Example::

        >>> p = plan_episodes(np.array([5, 13]), 8, 4, make_buckets(8, 4))
        >>> p.n_rows.tolist(), p.n_query.tolist()
        ([5, 6, 7], [2, 2, 2])
    """
    n = np.asarray(task_rows, dtype=np.int64)
    if n.size and int(n.min()) < 2:
        raise ValueError("plan_episodes needs tasks of >= 2 rows (1-row tasks are leftover)")
    width = support + query
    n_tasks = n.size
    total = int(n.sum())
    episodes_per_task = -(-n // width)
    task_of_row = np.repeat(np.arange(n_tasks, dtype=np.int64), n)
    task_first_row = np.cumsum(n) - n
    r = np.arange(total, dtype=np.int64) - task_first_row[task_of_row]
    ep_in_task = r * episodes_per_task[task_of_row] // n[task_of_row]
    first_ep = np.cumsum(episodes_per_task) - episodes_per_task
    episode = first_ep[task_of_row] + ep_in_task
    n_eps = int(episodes_per_task.sum())
    n_e = np.bincount(episode, minlength=n_eps).astype(np.int64)
    # round half up, in integers: floor(n_e*Q/(S+Q) + 1/2)
    n_q = np.clip((2 * n_e * query + width) // (2 * width), 1, n_e - 1)
    n_s = n_e - n_q
    ep_first_row = np.cumsum(n_e) - n_e
    pos = np.arange(total, dtype=np.int64) - ep_first_row[episode]
    is_query = pos >= n_s[episode]
    # smallest bucket that fits: buckets shrink monotonically, so count the fits
    fits = np.zeros(n_eps, dtype=np.int64)
    for b in buckets:
        fits += (n_s <= b.support) & (n_q <= b.query)
    level = fits - 1
    bucket_support = np.array([b.support for b in buckets], dtype=np.int64)
    row_level = level[episode]
    slot = np.where(is_query, bucket_support[row_level] + pos - n_s[episode], pos)
    return EpisodePlan(
        episode=episode,
        pos=pos,
        is_query=is_query,
        slot=slot,
        task=np.repeat(np.arange(n_tasks, dtype=np.int64), episodes_per_task),
        n_rows=n_e,
        n_support=n_s,
        n_query=n_q,
        level=level,
    )
