"""Ports: what the controller needs from the PS fleet, as Protocols it defines.

The controller never imports ``ps``. The fleet operations it drives -- read who owns
which vshard, move vshards, check every shard answers, restore the fleet from a
checkpoint cut -- are the :class:`PsFleet` Protocol; the implementation over gRPC lives
next to the PS admin code (``ps.fleet_admin.GrpcPsFleet``) and the app floor (the
``metaps controller`` role, tests, benches) wires it in::

    fleet = GrpcPsFleet(job.rpc)                       # ps/fleet_admin.py
    srv = ControllerServer(cfg, state_dir, datasets, job.rpc, ps_fleet=fleet)
    srv.ps_mover = MigrationPsMover(srv.ps_addresses, fleet, keep=cfg.nd.keep)

Argument and return types are plain (ints, strs, sequences) or Protocols defined here
(:class:`MoveReport`, :class:`RestoreReport`), which the PS side's dataclasses satisfy
structurally, so neither side imports the other.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping, Protocol, Sequence


class MoveReport(Protocol):
    """What a vshard move did (``ps.migration.MigrationReport`` has these and more)."""

    @property
    def rows(self) -> int:
        """Rows moved, all tables."""
        ...


class RestoreReport(Protocol):
    """What a fleet restore did (``ps.fleet_admin.FleetRestore``)."""

    @property
    def dir(self) -> str:
        """The checkpoint directory every shard now holds."""
        ...

    @property
    def rows(self) -> int:
        """Rows loaded over every shard."""
        ...

    @property
    def map_version(self) -> int:
        """The partition map version every shard has after the restore."""
        ...

    @property
    def healed(self) -> Sequence[int]:
        """Shards whose partition map lagged and were brought to the newest."""
        ...

    @property
    def rejected(self) -> Sequence[Mapping[str, str]]:
        """``{"dir", "shard", "error"}`` for each newer directory a shard refused."""
        ...


class PsFleet(Protocol):
    """The PS fleet operations the controller drives (the mover and the recovery).

    Every call takes the shards' addresses in shard-id order (the controller's node
    registry knows them; ``ControllerServer.ps_addresses``).
    """

    def unreachable(self, addresses: Sequence[str]) -> str:
        """'' when every shard answers, else the first that does not (address and why).

        Args:
            addresses: every shard's address.
        """
        ...

    def vshards_of(self, addresses: Sequence[str], ps: int) -> list[int]:
        """The vshards shard ``ps`` owns in the newest partition map any shard holds.

        Args:
            addresses: every shard's address.
            ps: the shard id.
        """
        ...

    def migrate_vshards(self, addresses: Sequence[str], vshards: Sequence[int], dst: int, *,
                        freeze_lease_s: float) -> MoveReport:
        """Move ``vshards`` (rows and optimizer state) to shard ``dst`` while the fleet serves.

        Args:
            addresses: every shard's address.
            vshards: the vshards to move.
            dst: the receiving shard id.
            freeze_lease_s: a freeze ends by itself after this long (a crashed mover).
        """
        ...

    def restore(self, addresses: Sequence[str], ckpt_dirs: Sequence[str], *, pause_lease_s: float,
                while_paused: Callable[[str], None] | None,
                on_step: Callable[[str, dict[str, Any]], None] | None = None,
                skip: Mapping[str, Sequence[int]] | None = None, renew_s: float = 0.0) -> RestoreReport:
        """Restore every shard from the first of ``ckpt_dirs`` every shard accepts, under one pause.

        Args:
            addresses: every shard's address.
            ckpt_dirs: committed checkpoint directories, preferred first.
            pause_lease_s: the write pause ends by itself after this long.
            while_paused: called once with the directory restored, before the shards resume.
            on_step: called before each step acts (``pause``, ``restore`` {dir, shard}, ``resume``),
                after each shard's restore (``restored`` {dir, shard, rows}) and each pause renewal
                (``renewed``): the controller records its progress there, durably, first.
            skip: directory -> shards an interrupted restore already restored to it (not redone).
            renew_s: > 0: renew the pause this often while restoring (a short lease then bounds
                the pause by the controller's life).

        Raises:
            MetapsError: every directory refused, or a shard unreachable or failing.
        """
        ...

    def resume(self, addresses: Sequence[str]) -> None:
        """End the write pause on every shard (an interrupted recovery whose rollback was done).

        Args:
            addresses: every shard's address.

        Raises:
            MetapsError: a shard unreachable.
        """
        ...


class PsMover(Protocol):
    """Moves vshards (rows + optimizer state) between PS processes; blocks until done.

    ``controller.ps_mover.MigrationPsMover`` implements it over a :class:`PsFleet`; the
    ND policy's MoveVshards actions call it.
    """

    def move_vshards(self, src_ps: int, dst_ps: int, n_vshards: int) -> None:
        """Move ``n_vshards`` of PS ``src_ps``'s vshards to PS ``dst_ps``."""
        ...


__all__ = ["MoveReport", "PsFleet", "PsMover", "RestoreReport"]
