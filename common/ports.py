"""Holding a port for a server that another process will start: :class:`PortReservation`.

Every metaps gRPC and ``/metrics`` server binds its own port (0, or the configured one) and
publishes what it got. One port cannot be bound that way: the all-reduce rendezvous, whose
server (the gloo ``TCPStore`` of rank 0) is created inside ``torch.distributed`` at an address
every rank must know before it starts. For it the launcher *reserves* a port instead of
picking one and letting it go:

* a socket with ``SO_REUSEADDR`` is bound to ``host:0`` and kept open, never listening;
* the kernel never hands that port to anyone else: not to a ``bind(port 0)`` (another
  server's free port), not to an outgoing connection's local port, and a plain ``bind`` of
  the port fails with "address in use";
* a server that sets ``SO_REUSEADDR`` itself (the ``TCPStore``, gRPC) can still bind it and
  listen, because the reservation does not listen (Linux allows several such binds while
  none of them listens). A rank 0 that restarts binds it again; the port stays reserved
  between the two.

The reservation lasts until :meth:`PortReservation.close` (the launcher's run).

Example::

    with reserve_port() as r:
        start_workers(allreduce=f"127.0.0.1:{r.port}")
        ...
"""

from __future__ import annotations

import socket
from types import TracebackType

from common.errors import BindError


class PortReservation:
    """A bound, non-listening ``SO_REUSEADDR`` socket that keeps ``port`` from other processes.

    Args:
        host: the address to reserve the port on (IPv4).
        port: 0 for a port the kernel picks, else that port.

    Raises:
        BindError: the port cannot be reserved (in use; one line naming it).
    """

    def __init__(self, host: str = "127.0.0.1", port: int = 0) -> None:
        self.host = host
        self._sock: socket.socket | None = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            self._sock.bind((host, port))
        except OSError as exc:
            self._sock.close()
            raise BindError(f"cannot reserve {host}:{port}: {exc.strerror or exc}") from None
        self.port = int(self._sock.getsockname()[1])

    @property
    def held(self) -> bool:
        """True until :meth:`close`."""
        return self._sock is not None

    def close(self) -> None:
        """Let the port go (idempotent)."""
        if self._sock is not None:
            self._sock.close()
            self._sock = None

    def __enter__(self) -> "PortReservation":
        return self

    def __exit__(self, kind: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.close()


def reserve_port(host: str = "127.0.0.1", port: int = 0) -> PortReservation:
    """A :class:`PortReservation` of ``host:port`` (0: any free port)."""
    return PortReservation(host, port)
