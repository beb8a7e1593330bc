"""The real :class:`~controller.ports.PsMover`: ND's MoveVshards over the :class:`~controller.ports.PsFleet` port.

Picks ``n`` vshards the slow PS owns now (from the newest partition map any PS
holds) and moves them, rows and optimizer state, to the destination PS while
workers keep pushing (the fleet's ``migrate_vshards``, ``ps.migration`` underneath,
loses no update). By default one vshard stays on the source (``keep``), so repeated
moves never empty a PS. ``metaps controller`` builds one over the addresses the PS
processes registered (``ControllerServer.ps_addresses``) and a ``ps.fleet_admin.GrpcPsFleet``.

Example::

    fleet = GrpcPsFleet(job.rpc)                                   # wired by the app floor
    srv.ps_mover = MigrationPsMover(srv.ps_addresses, fleet)       # addresses from the node registry
"""

from __future__ import annotations

import logging
from typing import Callable

from controller.ports import MoveReport, PsFleet
from common.errors import MetapsError
from common.log import kv

log = logging.getLogger(__name__)


class NothingToMove(MetapsError, ValueError):
    """The source PS owns no more vshards than it must keep (a drained slow PS); not a failure."""


class MigrationPsMover:
    """Moves vshards between live PS shards.

    Args:
        addresses: every PS shard's address, in shard-id order; or a callable returning
            them at move time (``ControllerServer.ps_addresses``: the registered PS).
        fleet: the PS fleet operations (``ps.fleet_admin.GrpcPsFleet``).
        freeze_lease_s: passed to the migration (a crashed mover cannot freeze forever).
        keep: vshards always left on the source (1: the slow PS keeps a little traffic, so
            its latency stays measured; 0: a persistently slow PS can be drained completely,
            which is what helps when its slowness is per request rather than per row).
    """

    def __init__(self, addresses: list[str] | Callable[[], list[str]], fleet: PsFleet,
                 freeze_lease_s: float = 120.0, keep: int = 1) -> None:
        if not callable(addresses) and not addresses:
            raise ValueError("MigrationPsMover needs the PS addresses")
        if keep < 0:
            raise ValueError(f"MigrationPsMover keep must be >= 0, got {keep}")
        self._addresses = addresses if callable(addresses) else list(addresses)
        self.fleet = fleet
        self.freeze_lease_s = freeze_lease_s
        self.keep = keep
        self.reports: list[MoveReport] = []

    @property
    def addresses(self) -> list[str]:
        return list(self._addresses()) if callable(self._addresses) else self._addresses

    def move_vshards(self, src_ps: int, dst_ps: int, n_vshards: int) -> None:
        """Move up to ``n_vshards`` of PS ``src_ps``'s vshards to PS ``dst_ps``, keeping ``keep`` on the source.

        Raises:
            ValueError: ``src_ps``/``dst_ps`` not two different shards of the fleet.
            NothingToMove: the source owns no more than it keeps.
        """
        addresses = self.addresses
        n = len(addresses)
        if not (0 <= src_ps < n and 0 <= dst_ps < n) or src_ps == dst_ps:
            raise ValueError(f"move_vshards: src {src_ps} and dst {dst_ps} must be different PS in 0..{n - 1}")
        owned = self.fleet.vshards_of(addresses, src_ps)
        take = owned[:max(0, min(n_vshards, len(owned) - self.keep))]
        if not take:
            raise NothingToMove(f"move_vshards: PS {src_ps} owns {len(owned)} vshard(s) and keeps {self.keep}; "
                             f"nothing left to move")
        report = self.fleet.migrate_vshards(addresses, take, dst_ps, freeze_lease_s=self.freeze_lease_s)
        self.reports.append(report)
        log.info("vshards moved", extra=kv(src=src_ps, dst=dst_ps, vshards=len(take),
                                           rows=report.rows))
