"""Which tables share one storage (and one step's lookup, gather and update).

Two tables can live in one :class:`ps.table_storage.GroupStorage` when a row of
either updates the same way: same dim, same optimizer settings, same gradient
clipping (:func:`storage_key`). Admission, eviction and initial rows stay per
table (they act per id, table by table). :func:`group_tables` is a pure
function of the table configs, so a worker computes the same groups as every
PS shard of its job (same ``[ps]`` section) and sends a step's ids group by
group, in the order the shard stores them::

    tables (job order)   user(16, radagrad) item(16, radagrad) price(8, adam) tag(16, radagrad)
    groups               [user, item, tag] (dim 16, rowwise adagrad) | [price] (dim 8, adam)

Groups are ordered by their first table, tables keep the given order inside a
group, and a group closes at :data:`MAX_GROUP_ROWS` rows (fbgemm's TBE row limit).
Torch-free: the controller and the launcher may import it.

Example::

    [g.names for g in group_tables(PsConfig().table_configs(["user", "item"]))]   # [("user", "item")]
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Hashable, Sequence

from ps.config import TableConfig

__all__ = ["MAX_GROUP_ROWS", "TableGroupSpec", "group_tables", "storage_key"]

MAX_GROUP_ROWS = 2**31 - 1
"""Rows one group may hold: fbgemm's exact rowwise Adagrad caps a TBE there."""


def storage_key(cfg: TableConfig) -> Hashable:
    """What must be equal for two tables to share one storage (dim, optimizer, clipping).

    Args:
        cfg: a table config.
    """
    return (int(cfg.dim), cfg.optimizer, float(cfg.grad_clip_norm), float(cfg.grad_clip_value))


@dataclass(frozen=True)
class TableGroupSpec:
    """One group: its tables (in storage order) and their common dim.

    Args:
        names: table names, in the order their rows are stored.
        dim: the row length of every table of the group.
    """

    names: tuple[str, ...]
    dim: int


def group_tables(cfgs: Sequence[TableConfig]) -> list[TableGroupSpec]:
    """Partition tables into storage groups (see the module docstring).

    Args:
        cfgs: the tables of a shard (``PsConfig.table_configs``), names unique.

    Returns:
        the groups, ordered by their first table; tables keep ``cfgs``' order inside each.
    """
    open_groups: dict[Hashable, list[TableConfig]] = {}
    order: list[list[TableConfig]] = []
    for c in cfgs:
        key = storage_key(c)
        g = open_groups.get(key)
        if g is not None and sum(int(t.capacity) for t in g) + int(c.capacity) > MAX_GROUP_ROWS:
            g = None
        if g is None:
            g = open_groups[key] = []
            order.append(g)
        g.append(c)
    return [TableGroupSpec(tuple(t.name for t in g), int(g[0].dim)) for g in order]
